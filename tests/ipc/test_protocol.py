"""The training-side protocol between real processes over real POSIX IPC.

A real training process (tests/helpers/toy_app.py) talks to a minimal manager process built on
the manager-side primitives (tests/helpers/toy_manager.py). The daemon's own tests are in
tests/manager/test_daemon.py.
"""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import leftovers, python_process
from tests.helpers.processes import drain


def lines(process, timeout=60):
    out, err = process.communicate(timeout=timeout)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")], err


def start_manager(*args):
    manager = python_process("tests.helpers.toy_manager", *args)
    assert "ready" in manager.stdout.readline()
    return manager


def stop(process):
    """Stop a toy manager the way a user would (Ctrl-C), so it removes its inbox and heartbeat."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    process.communicate(timeout=30)


def test_notice_and_update_between_two_real_processes(ipc_env):
    manager = start_manager("--answer", "0,0,0,10", "--notices", "3")
    app = python_process("tests.helpers.toy_app", "--app", "pair", "--epochs", "2", "--iterations", "3",
                         "--exchange-timeout", "10")
    app_lines, err = lines(app)
    manager_lines, _ = lines(manager)
    assert app.returncode == 0, err
    assert app_lines[0] == {"iteration": 0, "ratio": [0, 0, 0, 10], "attached": True}  # REGISTER answered
    kinds = [(m["kind"], m["seq"]) for m in manager_lines if "kind" in m]
    # the end of the last epoch is the end of the run: a FINISH, no decision
    assert kinds == [("REGISTER", 1), ("BOUNDARY", 2), ("FINISH", 3)]
    boundary = [m for m in manager_lines if m.get("kind") == "BOUNDARY"][0]
    assert boundary["iteration"] == 3 and boundary["sd"] > 0  # step 3 read the record written at step 1
    assert leftovers(ipc_env) == []


def test_without_a_manager_training_finishes_in_bounded_time(ipc_env):
    app = python_process("tests.helpers.toy_app", "--app", "alone", "--epochs", "5", "--iterations", "4",
                         "--sleep", "0.01", "--exchange-timeout", "5.0")
    app_lines, err = lines(app)
    assert app.returncode == 0, err
    done = app_lines[-1]
    # no waiting for an absent manager: one wait for an answer alone would take the 5 s exchange timeout
    assert done["done"] and done["elapsed"] < 5.0, done
    assert all(line["ratio"] == [1, 1, 1, 1] for line in app_lines if "ratio" in line)
    assert err.count("no manager in namespace") == 1  # one warning, not one per boundary
    assert leftovers(ipc_env) == []


@pytest.mark.slow
def test_a_stuck_manager_costs_at_most_the_exchange_timeout_per_boundary(ipc_env):
    manager = start_manager("--silent", "--seconds", "20")  # heartbeats, never reads its inbox
    try:
        app = python_process("tests.helpers.toy_app", "--app", "patient", "--epochs", "12", "--iterations", "1",
                             "--sleep", "0", "--exchange-timeout", "0.1")
        app_lines, err = lines(app)
    finally:
        stop(manager)
    assert app.returncode == 0, err
    # 12 boundaries + register: at most 13 x 0.1 s of waiting (once the 10-message inbox is full,
    # notices fail within the send timeout instead). Generous slack for a busy machine; a job that
    # waited for the stuck manager would take its 20 s.
    assert app_lines[-1]["elapsed"] < 13 * 0.1 + 10, app_lines[-1]
    assert leftovers(ipc_env) == []


def against_toy_manager(app: str, manager_args: list[str], *app_args: str) -> tuple[list[dict], str]:
    """Run the toy app ``app`` (``app_args``) to its end beside a toy manager (``manager_args``);
    the app's lines and stderr (it must exit 0)."""
    manager = start_manager(*manager_args, "--seconds", "120")
    try:
        process = python_process("tests.helpers.toy_app", "--app", app, "--epochs", "1", "--decide-every", "2",
                                 *app_args)
        app_lines, err = lines(process, timeout=120)
    finally:
        stop(manager)
    assert process.returncode == 0, err
    return app_lines, err


def sd_events(app: str, *kinds: str) -> list[dict]:
    path = Path(os.environ["DRBALANCE_LOG_DIR"]) / f"{app}.sd.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] in kinds]


@pytest.mark.slow
def test_a_slow_manager_gets_short_waits_after_three_late_answers_and_full_ones_once_it_is_in_time(ipc_env):
    """A manager that is alive but slow (its heartbeat fresh, every answer 0.6 s late) would cost
    the job its whole wait at every boundary (0.5 s each: 20 boundaries of a 0.5 s job take 10 s).
    After three late answers in a row the job waits a tenth of it, until an answer comes in time."""
    from drbalance.client.session import LATE_ANSWERS_BEFORE_SHORT_WAITS, SHORT_WAIT_SHARE

    # the first 4 answers 0.6 s late; a boundary every 0.2 s, so the toy manager's inbox never fills
    # (a full inbox would detach the job: a new attachment starts with full waits anyway)
    app_lines, err = against_toy_manager("slowed", ["--delay", "0.6", "--slow-notices", "4"], "--iterations", "60",
                                         "--sleep", "0.1", "--exchange-timeout", "0.5")
    marks = sd_events("slowed", "no_answer", "slow_manager", "manager_in_time")
    events = [e["event"] for e in marks]
    late = LATE_ANSWERS_BEFORE_SHORT_WAITS
    assert events[:late + 1] == ["no_answer"] * late + ["slow_manager"], events
    assert "manager_in_time" in events, events  # the manager caught up: full waits again
    recovered = events.index("manager_in_time")
    assert [e["waited"] for e in marks[:late]] == [0.5] * late
    short = [e["waited"] for e in marks[late + 1:recovered]]
    assert short and set(short) == {0.5 * SHORT_WAIT_SHARE}, marks
    assert all(e["waited"] == 0.5 for e in marks[recovered + 1:] if e["event"] == "no_answer")
    assert not sd_events("slowed", "detached")
    assert "answered none of the last 3 notices of 'slowed'" in err and err.count("answered none of") == 1, err
    assert app_lines[-1]["done"]
    assert leftovers(ipc_env) == []


@pytest.mark.slow
def test_a_job_leaves_short_waits_when_a_late_answer_came_within_its_full_wait(ipc_env):
    """After the slow start, every answer comes 0.1 s after its notice: past the short wait (0.05 s)
    but within the full one (0.5 s). The late answer's time tells the job the manager keeps up
    again, so it leaves its short waits instead of keeping them to the end and taking every
    answer late."""
    against_toy_manager("recovered", ["--delay", "0.6", "--slow-notices", "4", "--later-delay", "0.1"],
                        "--iterations", "60", "--sleep", "0.1", "--exchange-timeout", "0.5")
    marks = sd_events("recovered", "slow_manager", "manager_in_time", "no_answer")
    events = [e["event"] for e in marks]
    assert "slow_manager" in events and "manager_in_time" in events, events
    after = [e for e in marks[events.index("manager_in_time") + 1:] if e["event"] == "no_answer"]
    assert all(e["waited"] == 0.5 for e in after), after  # full waits again: answers in time
    assert len(after) <= 2, after  # (at most the answers still queued behind the slow ones)
    assert leftovers(ipc_env) == []


def test_a_job_that_never_waits_for_answers_is_never_told_its_manager_is_slow(ipc_env):
    _, err = against_toy_manager("eager", [], "--iterations", "20", "--exchange-timeout", "0")
    assert len(sd_events("eager", "no_answer")) >= 3  # exchange_timeout 0: no answer is ever waited for
    assert not sd_events("eager", "slow_manager") and "answered none of" not in err, err
    assert leftovers(ipc_env) == []


def test_a_dead_manager_leaves_no_app_stuck_and_a_new_one_is_found(ipc_env):
    dead = start_manager()
    os.kill(dead.pid, signal.SIGKILL)
    dead.wait()
    # its inbox and heartbeat are still there, stale: the app must see that nobody is home. The app
    # runs until stopped, so that a slow start of the next manager on a busy machine cannot outlast it.
    app = python_process("tests.helpers.toy_app", "--app", "orphan", "--epochs", "100000", "--iterations", "2",
                         "--sleep", "0.1", "--exchange-timeout", "1.0")
    manager = None
    try:
        first = json.loads(app.stdout.readline())
        assert first == {"iteration": 0, "ratio": [1, 1, 1, 1], "attached": False}
        manager = start_manager("--answer", "10,0,0,0")
        seen = []
        for raw in app.stdout:
            seen.append(json.loads(raw))
            if seen[-1]["attached"] and seen[-1]["ratio"] == [10, 0, 0, 0]:
                break
        # in order: trained on alone, re-attached to the new manager, then used its DR
        assert seen and seen[-1] == {"iteration": seen[-1]["iteration"], "ratio": [10, 0, 0, 0], "attached": True}
        assert not seen[0]["attached"] or first["attached"] is False
    finally:
        app.terminate()  # SIGTERM: the app cleans up and dies of it
        app.wait(timeout=60)
        if manager is not None:
            stop(manager)
    assert app.returncode == -signal.SIGTERM
    assert leftovers(ipc_env) == []


@pytest.mark.slow
def test_sigterm_and_exceptions_remove_the_apps_objects(ipc_env):
    app = python_process("tests.helpers.toy_app", "--app", "termed", "--hang-after", "2")
    for _ in range(3):
        app.stdout.readline()
    assert ipc_env.listed_apps() == ["termed"]
    app.send_signal(signal.SIGTERM)
    app.wait(timeout=30)
    assert app.returncode == -signal.SIGTERM  # still dies of SIGTERM, as without drbalance
    assert leftovers(ipc_env) == []

    failing = python_process("tests.helpers.toy_app", "--app", "crashes", "--fail-after", "2")
    _, err = lines(failing)
    assert failing.returncode == 1 and "failing on purpose" in err
    assert leftovers(ipc_env) == []


@pytest.mark.slow
def test_an_app_whose_exit_hangs_after_sigterm_still_ends_within_the_grace(ipc_env):
    # A non-daemon thread that never ends: the interpreter would wait for it at exit for ever.
    app = python_process("tests.helpers.toy_app", "--app", "stuck", "--epochs", "100000", "--stuck-thread",
                         env={"DRBALANCE_EXIT_GRACE": "2"})
    for _ in range(2):  # from iteration 1 on, SIGTERM lands inside the script's `with session:` block
        app.stdout.readline()
    drain(app)
    app.send_signal(signal.SIGTERM)
    app.wait(timeout=120)
    err = app.stderr.read()
    assert app.returncode == 128 + signal.SIGTERM, err
    assert "still running 2 s after SIGTERM" in err and "DRBALANCE_EXIT_GRACE" in err
    assert "stuck_forever" in err  # the stuck thread's stack says where it waits
    assert leftovers(ipc_env) == []  # the `with` block closed the session before the interpreter waited


def test_a_sigterm_swallowed_by_a_finalizer_still_ends_the_job_at_its_next_step(ipc_env):
    # Python runs signal handlers in whatever the main thread executes, __del__ too, and ignores
    # (prints) an exception raised there: the job would train on until the exit grace.
    app = python_process("tests.helpers.toy_app", "--app", "finalized", "--epochs", "100000",
                         "--slow-finalizer-at", "2", env={"DRBALANCE_EXIT_GRACE": "600"})
    for raw in app.stdout:
        if json.loads(raw).get("finalizing"):
            break
    app.send_signal(signal.SIGTERM)  # lands while __del__ sleeps
    out, err = app.communicate(timeout=120)
    assert "Exception ignored" in err and "SessionTerminated" in err, err
    assert app.returncode == -signal.SIGTERM, err
    assert '"iteration": 2' not in out  # the step right after the finalizer raised it again
    assert leftovers(ipc_env) == []


def test_a_bad_exit_grace_is_a_clear_error_before_anything_is_created(ipc_env):
    app = python_process("tests.helpers.toy_app", "--app", "graceless", env={"DRBALANCE_EXIT_GRACE": "soon"})
    _, err = lines(app)
    assert app.returncode == 1 and "DRBALANCE_EXIT_GRACE='soon' is not a number of seconds" in err
    assert leftovers(ipc_env) == []


def test_the_sd_log_is_json_lines_with_the_documented_fields(ipc_env, tmp_path):
    manager = start_manager("--answer", "0,5,5,0", "--notices", "3")
    app = python_process("tests.helpers.toy_app", "--app", "logged", "--epochs", "2", "--iterations", "6",
                         "--exchange-timeout", "10")
    _, err = lines(app)
    lines(manager)
    assert app.returncode == 0, err
    records = [json.loads(line) for line in (tmp_path / "logs" / "logged.sd.jsonl").read_text().splitlines()]
    events = [r["event"] for r in records]
    assert events[:3] == ["start", "attached", "update"] and events[-2:] == ["finish", "closed"]
    assert events.count("boundary") == 1 and events.count("report") >= 1
    for record in records:
        assert {"t", "elapsed", "event", "app", "pid", "epoch", "iteration", "sd", "dr", "dr_total",
                "iter_time"} <= set(record)
    update = records[events.index("update")]
    assert update["old_dr"] == [1, 1, 1, 1] and update["new_dr"] == [0, 5, 5, 0] and update["branch"] == "toy"
    finish = records[events.index("finish")]
    assert finish["iteration"] == 12 and finish["sd"] > 0
    assert time.time() - finish["t"] < 120
