"""``drbalance status --watch``: the frame from hand-written status data, and the loop against a real manager."""

from __future__ import annotations

import io
import json
import signal

import pytest

from drbalance.cli import main as drbalance
from drbalance.manager.status import (
    CLEAR_SCREEN,
    StatusError,
    app_state,
    format_table,
    format_watch,
    utilization_bar,
    watch,
)
from tests.conftest import python_process, wait_for
from tests.helpers.processes import ManagerProcess, drain, first_line, stop_app, toy_app

GIB = 1024 ** 3


def status(**changes) -> dict:
    base = {
        "pid": 4242, "namespace": "lab", "policy": "fair", "decisions": 17, "started": 1000.0, "updated": 1300.0,
        "gpus": 3, "util": [100.0, 25.0, None],
        "memory": [{"used": 4 * GIB, "total": 16 * GIB}, None, {"used": 0, "total": 16 * GIB}],
        "apps": [
            {"name": "resnet", "pid": 11, "epoch": 3, "epochs": 90, "iteration": 30, "iterations_total": 900,
             "sd": 1.5, "dr": [2, 3, 5], "state": "RUNNING", "updated_ago": 0.2, "quiet_for": None,
             "steered": True},
            {"name": "bert", "pid": 12, "epoch": 1, "epochs": 3, "iteration": 2, "iterations_total": 9,
             "sd": None, "dr": [5, 5, 0], "state": "RUNNING", "updated_ago": 700.0, "quiet_for": 100.0,
             "steered": True},
            {"name": "elsewhere", "pid": 13, "epoch": 0, "epochs": 1, "iteration": 0, "iterations_total": 5,
             "sd": 1.0, "dr": [10], "state": "STARTING", "updated_ago": 1.0, "quiet_for": None, "steered": False},
        ],
        "foreign": [], "faults": {},
    }
    base.update(changes)
    return base


def test_bars_fill_in_proportion_and_say_when_a_reading_is_unknown():
    assert utilization_bar(100.0, 10) == "[##########] 100%"
    assert utilization_bar(25.0, 8) == "[##------]  25%"
    assert utilization_bar(0.0, 4) == "[----]   0%"
    assert utilization_bar(None, 4) == "[    ]  n/a"


def test_states_are_running_quiet_or_detached():
    apps = {app["name"]: app for app in status()["apps"]}
    assert app_state(apps["resnet"]) == "running"
    assert app_state(apps["bert"]) == "quiet"
    assert app_state(apps["elsewhere"]) == "detached"
    assert app_state({"state": "STARTING"}) == "starting"  # a status file of an older manager: no 'steered'


def test_a_frame_shows_every_gpu_and_every_app_with_its_sd_dr_and_state():
    frame = format_watch(status(), width=60, now=1300.0)
    lines = frame.splitlines()
    assert lines[0].startswith("drbalance  namespace lab  policy fair  manager pid 4242  up 5m  decisions 17")
    gpu_lines = [line for line in lines if line.startswith("GPU ")]
    assert gpu_lines == [
        "GPU 0  [####################] 100%  mem   4.0/16.0 GiB",
        "GPU 1  [#####---------------]  25%",
        "GPU 2  [                    ]  n/a  mem   0.0/16.0 GiB",
    ]
    rows = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0] in
            {"resnet", "bert", "elsewhere"}}
    assert rows["resnet"] == ["resnet", "running", "1.50", "3/90", "2", "3", "5"]
    assert rows["bert"] == ["bert", "quiet", "-", "1/3", "5", "5", "0"]
    assert rows["elsewhere"] == ["elsewhere", "detached", "1.00", "0/1", "10"]
    assert [line.split()[0] for line in lines if line.split() and line.split()[0] in rows] == \
        ["bert", "elsewhere", "resnet"]  # sorted by name


def test_a_frame_without_apps_and_with_a_failing_task_says_so():
    frame = format_watch(status(apps=[], faults={"sample": "OSError: gone"}), width=80)
    assert "(no apps)" in frame
    assert "WARNING: the manager's sample is failing: OSError: gone" in frame


def test_the_bars_grow_with_the_terminal():
    narrow = format_watch(status(), width=20)  # never narrower than the minimum
    wide = format_watch(status(), width=120)
    assert "[##########] 100%" in narrow
    assert "[" + "#" * 80 + "] 100%" in wide


def test_the_loop_redraws_in_place_on_a_terminal_and_separates_frames_plainly_otherwise():
    reads = iter([status(), StatusError("no drbalance-manager is running"), status(decisions=18)])
    out = io.StringIO()
    assert watch(lambda: _next(reads), 0.01, 3, out, clear=False, width=lambda: 60, sleep=lambda s: None) == 0
    text = out.getvalue()
    assert CLEAR_SCREEN not in text
    frames = text.split("\n\n", 1)
    assert "decisions 17" in frames[0]
    assert "no drbalance-manager is running (watching; Ctrl-C to stop)" in text  # kept watching
    assert "decisions 18" in text

    reads = iter([status(), status()])
    out = io.StringIO()
    watch(lambda: _next(reads), 0.01, 2, out, clear=True, width=lambda: 60, sleep=lambda s: None)
    assert out.getvalue().count(CLEAR_SCREEN) == 2


def test_ctrl_c_ends_the_loop_cleanly():
    out = io.StringIO()

    def interrupted(seconds):
        raise KeyboardInterrupt

    assert watch(status, 1.0, None, out, clear=False, width=lambda: 60, sleep=interrupted) == 0
    assert out.getvalue().count("drbalance  namespace") == 1


def _next(reads):
    item = next(reads)
    if isinstance(item, Exception):
        raise item
    return item


def test_watch_options_are_checked(ipc_env, capsys):
    """Usage errors (exit status 2) before anything is read; an interval beyond a day overflowed
    the clock the view sleeps on, a traceback after the first frame."""
    for argv, message in ((["status", "--count", "2"], "--interval and --count go with --watch"),
                          (["status", "--watch", "--json"], "--json prints the status once: choose one"),
                          (["status", "--namespace", "../x"], "namespace '../x' is not valid"),
                          (["status", "--watch", "--interval", "0"], "--interval: must be a positive number"),
                          (["status", "--watch", "--interval", "1e12"], "--interval: must be at most 86400")):
        with pytest.raises(SystemExit) as stopped:
            drbalance(argv)
        assert stopped.value.code == 2 and message in capsys.readouterr().err, argv


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_watch_against_a_real_manager_shows_the_running_app_frame_after_frame(ipc_env, tmp_path):
    manager = ManagerProcess(tmp_path, ipc_env, (90, 80, 20, 50))
    app = toy_app("watched", "--epochs", "100000", "--iterations", "3", "--sleep", "0.05")
    try:
        first_line(app)
        drain(app)  # it prints a line per iteration: a full pipe would block it
        wait_for(lambda: json.loads(ipc_env.manager_status().read_text())["apps"])  # written once a second
        watcher = python_process("drbalance.cli", "status", "--watch", "--interval", "0.5", "--count", "3")
        stdout, stderr = watcher.communicate(timeout=120)
        assert watcher.returncode == 0, stderr
        frames = stdout.split("\n\n")
        headers = [frame for frame in frames if frame.startswith("drbalance  namespace")]
        assert len(headers) == 3, stdout
        assert CLEAR_SCREEN not in stdout  # not a terminal: plain frames
        for line in ("GPU 0  [", "GPU 3  ["):
            assert stdout.count(line) == 3
        rows = [line.split() for line in stdout.splitlines() if line.startswith("watched")]
        assert len(rows) == 3 and all(row[1] in {"running", "starting"} for row in rows)
        assert rows[-1][-4:] == ["0", "0", "10", "0"]  # the exclusive placement on the least used GPU

        interrupted = python_process("drbalance.cli", "status", "--watch", "--interval", "0.5")
        wait_for(lambda: interrupted.stdout.readline().startswith("drbalance  namespace"), timeout=60)
        interrupted.send_signal(signal.SIGINT)
        out, err = interrupted.communicate(timeout=60)
        assert interrupted.returncode == 0 and "Traceback" not in err, err
    finally:
        stop_app(app)
        manager.stop()



@pytest.mark.timeout(120)
def test_ctrl_c_ends_the_watch_even_when_sigint_was_inherited_ignored(ipc_env):
    # A background job of a non-interactive shell starts with SIGINT ignored; the view must still stop.
    watcher = python_process("drbalance.cli", "status", "--watch", "--interval", "0.2",
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        wait_for(lambda: "watching; Ctrl-C to stop" in watcher.stdout.readline(), timeout=60)  # no manager here
        watcher.send_signal(signal.SIGINT)
        out, err = watcher.communicate(timeout=60)
        assert watcher.returncode == 0, err
        assert "Traceback" not in err
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()


@pytest.mark.timeout(30)
def test_a_planted_objects_name_reaches_the_terminal_escaped():
    """/dev/shm names are the neighbour's choice: any bytes but '/' and NUL. Printed raw, an escape
    sequence rewrote the victim's terminal (erased the very warning about it, hid what followed),
    and a byte that is not UTF-8 (a surrogate after os.scandir) made a strict UTF-8 stdout (the
    en_US.UTF-8 locale) refuse the table: 'drbalance status' failed."""
    from drbalance.manager.status import format_table

    planted = "drb.1000.lab.\x1b[2K\x1b[1A\rAPP (no apps)\x1b[8m\udcff"
    table = format_table(status(foreign=[{"object": planted, "owner_uid": 65534, "owner": "nobody (uid 65534)"}]))
    warning = next(line for line in table.splitlines() if "belongs to nobody" in line)
    assert "\x1b" not in table and "\r" not in table
    assert "/dev/shm/drb.1000.lab.\\x1b[2K\\x1b[1A\\rAPP (no apps)\\x1b[8m\\udcff belongs to" in warning
    table.encode("utf-8")  # strict: what a UTF-8 locale's stdout does


def test_an_estimated_sd_is_marked_in_the_frame_and_the_table():
    """An SD that divides by the job's own estimate of its solo time reads ``~1.50``,
    with a line that says what the mark means; a status file without the field shows plain SDs."""
    apps = status()["apps"]
    apps[0]["sd_estimated"] = True
    for text in (format_watch(status(apps=apps), width=60), format_table(status(apps=apps))):
        rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split()}
        assert "~1.50" in rows["resnet"] and "1.00" in rows["elsewhere"]
        assert "estimate of its solo-run time" in text
    assert "~" not in format_table(status()) and "estimate" not in format_watch(status())


def test_an_sd_that_is_only_a_lower_bound_is_shown_as_one():
    """While the job's estimate of its solo time can still only be too high, its SD is at least
    the number: ``>=1.50``, never ``~1.50``, with a line that says what the mark means."""
    apps = status()["apps"]
    apps[0].update(sd_estimated=True, sd_bound=True)
    for text in (format_watch(status(apps=apps), width=60), format_table(status(apps=apps))):
        rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split()}
        assert ">=1.50" in rows["resnet"] and "~1.50" not in rows["resnet"] and "1.00" in rows["elsewhere"]
        assert "the SD is at least this" in text and "~ SD from" not in text
