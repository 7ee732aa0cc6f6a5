"""Progress bars (tqdm) of demo, launch and simulate --compare: off unless stderr is a terminal or
asked; with --progress they count what finished and estimate the time left."""

from __future__ import annotations

import io
import json
import re
import stat

import pytest

from drbalance import progress
from drbalance.cli import main as drbalance
from drbalance.runs.launch import iterations_done
from tests.conftest import python_process

TINY = {
    "name": "tiny", "gpus": 2, "placement": "round-robin",
    "apps": [
        {"name": "a1", "model": "alexnet", "batch": 32, "epochs": 2, "iterations_per_epoch": 3},
        {"name": "a2", "model": "alexnet", "batch": 32, "epochs": 2, "iterations_per_epoch": 2},
    ],
}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bars_only_on_a_terminal_or_when_asked():
    assert progress.wanted(None, io.StringIO()) is False  # a pipe or a file: clean output
    assert progress.wanted(None, Terminal()) is True
    assert progress.wanted(True, io.StringIO()) is True  # --progress
    assert progress.wanted(False, Terminal()) is False  # --no-progress
    off = progress.bar(False, 10, "x", "runs")
    off.update(3)
    assert isinstance(off, progress.NoBar) and off.n == 3


def test_iterations_done_counts_finished_apps_in_full_and_running_ones_as_the_manager_shows_them():
    totals = {"a": 10, "b": 20, "c": 5}
    status = {"apps": [{"name": "b", "iteration": 7}, {"name": "c", "iteration": 99}, {"name": "x", "iteration": 3}]}
    assert iterations_done(status, totals, finished={"a"}) == 10 + 7 + 5  # c capped at its plan; x is not ours
    assert iterations_done(None, totals, finished=set()) == 0  # no status file yet
    assert iterations_done({"apps": "junk"}, totals, finished={"c"}) == 5


def test_simulate_compare_shows_one_step_per_policy_only_when_asked(capsys):
    assert drbalance(["simulate", "demo-a", "--compare"]) == 0
    quiet = capsys.readouterr()
    assert quiet.err == "" and "fair" in quiet.out  # not a terminal: no bar
    assert drbalance(["simulate", "demo-a", "--compare", "--progress"]) == 0
    shown = capsys.readouterr()
    final = shown.err.replace("\r", "\n").strip().splitlines()[-1]
    assert re.search(r"simulate demo-a: 100%.*\| 6/6 runs \[.* elapsed, .* left", final), final
    def report(text: str) -> list[str]:  # without the line of timings
        return [line for line in text.splitlines() if not line.startswith("simulated in")]

    assert report(shown.out) == report(quiet.out)  # the report itself is unchanged


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_demo_and_launch_show_runs_and_iterations_with_progress_and_keep_outputs_private(ipc_env, tmp_path):
    scenario = tmp_path / "tiny.json"
    scenario.write_text(json.dumps(TINY))
    out = tmp_path / "demo"
    demo = python_process("drbalance", "demo", "--scenario", str(scenario), "--policies", "observe",
                          "--devices", "emulated", "--time-scale", "2", "--out", str(out), "--progress")
    stdout, stderr = demo.communicate(timeout=360)
    assert demo.returncode == 0, stderr
    lines = stderr.replace("\r", "\n").splitlines()
    assert any(re.search(r"^demo: 100%.*\| 1/1 runs", line) for line in lines), stderr
    assert any(re.search(r"^tiny: 100%.*\| 10/10 iterations .*2/2 apps done", line) for line in lines), stderr
    assert any(re.search(r"^tiny: .*\| \d+/10 iterations \[.* elapsed, .* left", line) for line in lines)
    assert "run 1/1: without balancing (observe) ..." in stdout and "done in" in stdout
    assert "\x1b" not in stdout  # bars on stderr only
    for path in (out / "observe" / "manager.out", out / "observe" / "apps" / "a1.out"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
