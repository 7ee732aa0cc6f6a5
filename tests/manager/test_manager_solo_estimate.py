"""A real manager sends its estimate of a job's solo iteration with every answer; a job given no
solo time that had no GPU alone divides its SD by it, and the record, the status file,
``drbalance status`` and the SD log say so."""

from __future__ import annotations

import json

import pytest

from drbalance.cli import main as drbalance
from drbalance.jsonlog import read_json_lines
from tests.conftest import wait_for
from tests.helpers.processes import ManagerProcess, drain, first_line, stop_app, toy_app


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_job_with_no_gpu_alone_takes_the_managers_estimate_and_every_view_says_so(ipc_env, tmp_path, capsys):
    """The toy job trains on the CPU path: it can never tell whether it had a GPU alone, so its own
    estimate stays a bound (``shared``). ``fair`` learns its windows and answers with an estimate."""
    manager = ManagerProcess(tmp_path, ipc_env, (0, 0, 0, 0), "--policy", "fair")
    app = toy_app("guessing", "--epochs", "100000", "--iterations", "3", "--sleep", "0.05", "--solo", "estimate")
    try:
        first_line(app)
        drain(app)

        def from_manager():
            apps = json.loads(ipc_env.manager_status().read_text())["apps"]
            return [entry for entry in apps if entry.get("solo_basis") == "manager"]

        shown = wait_for(from_manager, timeout=120)
        assert shown[0]["name"] == "guessing" and shown[0]["sd_estimated"] is True
        assert drbalance(["status"]) == 0
        rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.split()}
        assert rows["guessing"][4].startswith("*") and "manager's estimate" in " ".join(rows["*"])
    finally:
        stop_app(app)
        code, err = manager.stop()
    assert code == 0, err
    estimates = [event["solo_estimate"] for event in manager.events("decision") if event.get("solo_estimate")]
    assert estimates and all(seconds > 0 for seconds in estimates)
    log = [r for r in read_json_lines(tmp_path / "logs" / "guessing.sd.jsonl") if r.get("sd") is not None]
    bases = [r["solo_basis"] for r in log]
    assert bases[0] == "shared" and "manager" in bases  # its own bound first, the manager's once it came
    taken = next(r for r in log if r["solo_basis"] == "manager")
    iterations = taken["iterations_total"]
    assert any(taken["solo_time"] == pytest.approx(seconds * iterations) for seconds in estimates)
