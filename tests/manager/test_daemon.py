"""The real drbalance-manager process with real apps over real IPC and a scripted utilisation source."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import posix_ipc
import pytest

from drbalance.cli import main as drbalance
from drbalance.ipc import discovery
from drbalance.ipc.layout import Notice, NoticeKind
from tests.conftest import ROOT, leftovers, python_process, wait_for
from tests.helpers.processes import ManagerProcess, drain, first_line, stop_app, toy_app


def test_a_notice_gets_the_exclusive_placement_on_the_least_used_gpu(ipc_env, tmp_path):
    manager = ManagerProcess(tmp_path, ipc_env, (90, 80, 20, 50))
    try:
        app = toy_app("solo", "--epochs", "2", "--iterations", "3", "--exchange-timeout", "10")
        assert first_line(app)["ratio"] == [0, 0, 10, 0]  # GPU 2 is the least used (20%)
        out, err = app.communicate(timeout=60)
        assert app.returncode == 0, err
    finally:
        code, err = manager.stop()
    assert code == 0, err
    decision = manager.events("decision")[0]
    assert decision["app"] == "solo" and decision["branch"] == "exclusive" and decision["trigger"] == "register"
    # the app's own [1, 1, 1, 1]/4 as the policy sees it: at the manager's DR total
    assert decision["util"] == [90, 80, 20, 50] and decision["old_dr"] == [3, 3, 2, 2] and decision["dr_total"] == 10
    assert [e["reason"] for e in manager.events("app_removed")] == ["finished"]
    assert leftovers(ipc_env) == []  # clean shutdown removed the inbox and heartbeat too
    assert not ipc_env.manager_status().exists()


@pytest.mark.slow
def test_the_slowest_app_gets_the_util_branch_when_there_are_more_apps_than_gpus(ipc_env, tmp_path):
    manager = ManagerProcess(tmp_path, ipc_env, (90, 80, 20, 50))
    background = []
    try:
        for index in range(4):  # four apps, each placed alone on a GPU by the exclusive mode
            app = toy_app(f"bg{index}", "--epochs", "100000", "--iterations", "5", "--sleep", "0.05",
                          "--solo", "10000000")  # runs until stopped, with a small SD
            first_line(app)
            drain(app)  # it prints a line per iteration: a full pipe would block it
            background.append(app)
        slow = toy_app("slow", "--epochs", "2", "--iterations", "4", "--solo", "0.05", "--exchange-timeout", "10")
        assert first_line(slow)["ratio"] == [1, 1, 1, 1]  # 5 apps > 4 GPUs and no SD yet: kept
        out, err = slow.communicate(timeout=60)
        assert slow.returncode == 0, err
        ratios = [json.loads(line)["ratio"] for line in out.splitlines() if line.startswith('{"iteration"')]
    finally:
        for app in background:
            stop_app(app)
        manager.stop()
    placements = {e["app"]: e["new_dr"] for e in manager.events("decision") if e["app"].startswith("bg")}
    assert sorted(map(tuple, placements.values())) == sorted(
        [(10, 0, 0, 0), (0, 10, 0, 0), (0, 0, 10, 0), (0, 0, 0, 10)])
    util_decision = [e for e in manager.events("decision") if e["app"] == "slow" and e["trigger"] == "boundary"][0]
    # DR [3, 3, 2, 2] on GPUs with remaining 10/20/80/50 % -> proportional shares of 10
    assert util_decision["branch"] == "util" and util_decision["new_dr"] == [1, 1, 5, 3]
    assert ratios[4] == [1, 1, 5, 3]  # applied from the iteration after the first epoch's end


def test_a_killed_app_is_collected_with_its_objects(ipc_env, tmp_path):
    manager = ManagerProcess(tmp_path, ipc_env)
    try:
        app = toy_app("doomed", "--hang-after", "1")
        first_line(app)
        wait_for(lambda: manager.events("app_added"))
        os.kill(app.pid, signal.SIGKILL)
        app.wait()
        # how fast is measured by the fault campaign (docs/reliability.md); here: that it happens
        wait_for(lambda: ipc_env.listed_apps() == [] and ipc_env.listed_signals() == [])
        wait_for(lambda: not ipc_env.app_claim("doomed").exists())
    finally:
        manager.stop()
    assert [e["reason"] for e in manager.events("app_removed")] == ["process gone"]


def test_a_restarted_manager_picks_up_live_apps(ipc_env, tmp_path):
    first = ManagerProcess(tmp_path, ipc_env)
    app = toy_app("survivor", "--epochs", "100000", "--iterations", "3", "--sleep", "0.05")
    try:
        first_line(app)
        drain(app)
        wait_for(lambda: first.events("app_added"))
        first.stop()
        second = ManagerProcess(tmp_path, ipc_env, (10, 20, 30, 40))
        try:
            added = wait_for(lambda: second.events("app_added"))
            assert added[0]["app"] == "survivor" and added[0]["via"] in {"adopted", "notice"}
            decision = wait_for(lambda: second.events("decision"))[0]
            assert decision["app"] == "survivor"  # the survivor now talks to the new manager
            status = wait_for(lambda: json.loads(ipc_env.manager_status().read_text())["apps"])
            assert status[0]["name"] == "survivor"
        finally:
            second.stop()
    finally:
        stop_app(app)


@pytest.mark.slow
def test_a_flood_of_notices_from_32_apps_is_all_answered(ipc_env, tmp_path):
    manager = ManagerProcess(tmp_path, ipc_env, (50, 50, 50, 50), "--policy", "observe")
    start = time.time() + 4.0
    # correctness under a flood (nothing lost, nothing mixed up), with waits long enough for a busy
    # machine; how fast the answers come is measured by benchmarks/fault_campaign.py
    apps = [python_process("tests.helpers.flood_app", f"flood{i}", str(start), "5", "10", "20") for i in range(32)]
    try:
        results = []
        for process in apps:
            out, err = process.communicate(timeout=90)
            assert process.returncode == 0, err
            results.append(json.loads(out))
    finally:
        for process in apps:
            process.kill()
        manager.stop()
    assert all(r["sent"] == 5 and r["answered"] == 5 and r["generations"] == [1, 2, 3, 4, 5] for r in results), \
        [r["problems"] for r in results if r["answered"] != 5]
    decisions = manager.events("decision")
    assert len(decisions) == 32 * 5 and len({(d["app"], d["generation"]) for d in decisions}) == 160
    assert leftovers(ipc_env) == []


def test_malformed_notices_are_logged_and_ignored(ipc_env, tmp_path):
    manager = ManagerProcess(tmp_path, ipc_env)
    try:
        inbox = posix_ipc.MessageQueue(ipc_env.inbox(discovery.read_manager(ipc_env).inbox))
        inbox.send(b"definitely not a notice")
        inbox.send(Notice(NoticeKind.BOUNDARY, os.getpid(), 1, "ghost", time.time()).encode())  # no record
        inbox.close()
        wait_for(lambda: len(manager.events("invalid")) >= 2)
        app = toy_app("after", "--epochs", "1", "--iterations", "2", "--exchange-timeout", "10")
        assert first_line(app)["ratio"] == [0, 0, 10, 0]  # still serving
        app.communicate(timeout=60)
    finally:
        code, _ = manager.stop()
    assert code == 0
    errors = [e["error"] for e in manager.events("invalid")]
    assert any("bytes, expected 76" in e for e in errors) and any("ghost" in e for e in errors)


def test_second_manager_refuses_and_status_shows_apps(ipc_env, tmp_path, capsys):
    manager = ManagerProcess(tmp_path, ipc_env)
    app = toy_app("shown", "--epochs", "100000", "--iterations", "5", "--sleep", "0.05")
    try:
        first_line(app)
        drain(app)
        second = python_process("drbalance.manager.cli", "--source", f"scripted:{manager.util_file}")
        _, err = second.communicate(timeout=30)
        assert second.returncode == 1 and "is already running in namespace" in err
        wait_for(lambda: json.loads(ipc_env.manager_status().read_text())["apps"])
        assert drbalance(["status"]) == 0
        table = capsys.readouterr().out
        assert "shown" in table and "[0, 0, 10, 0]" in table and "90%, 80%, 20%, 50%" in table
    finally:
        stop_app(app)
        manager.stop()
    assert drbalance(["status"]) == 1
    assert "no drbalance-manager is running" in capsys.readouterr().err


def test_a_second_manager_with_another_runtime_directory_is_refused_too(ipc_env, tmp_path):
    """Its lock is elsewhere (say, started where XDG_RUNTIME_DIR is not set), but the first's
    heartbeat in /dev/shm gives it away: it must not run beside the first and adopt its jobs."""
    manager = ManagerProcess(tmp_path, ipc_env)
    try:
        elsewhere = {"DRBALANCE_RUNTIME_DIR": str(tmp_path / "elsewhere")}
        second = python_process("drbalance.manager.cli", "--source", f"scripted:{manager.util_file}",
                                "--duration", "60", env=elsewhere)
        try:
            _, err = second.communicate(timeout=30)
        finally:
            if second.poll() is None:  # it runs: the bug this test is about
                second.kill()
                second.communicate()
        assert second.returncode == 1 and f"another manager (pid {manager.process.pid}) runs in namespace" in err, err
        assert manager.alive() and discovery.read_manager(ipc_env).pid == manager.process.pid
    finally:
        code, err = manager.stop()
    assert code == 0, err


@pytest.mark.slow
def test_nvml_without_a_driver_and_bad_options_exit_non_zero(ipc_env):
    process = python_process("drbalance.manager.cli", "--source", "nvml")
    _, err = process.communicate(timeout=30)
    assert process.returncode == 2 and "NVML unavailable" in err
    assert "run on emulated GPUs: drbalance-manager --source emulated:4" in err  # the way on such a machine
    for args, message in ((["--source", "bogus"], "unknown utilisation source"),
                          (["--source", "scripted:/nonexistent.json"], "No such file"),
                          (["--sample-period", "0", "--source", "scripted:x"], "--sample-period: must be a positive"),
                          (["--sample-period", "inf", "--source", "scripted:x"], "--sample-period: must be a positive"),
                          (["--sample-period", "1e-9", "--source", "scripted:x"], "--sample-period: must be at least"),
                          (["--window", "0", "--source", "scripted:x"], "--window: must be an integer >= 1"),
                          (["--dr-total", "1000000", "--source", "scripted:x"],
                           "(--dr-total) must be an integer 1..65535"),
                          (["--log-keep", "1000000000", "--source", "scripted:x"],
                           "(--log-keep) must be an integer 0..1000"),
                          (["--policy", "magic"], "invalid choice")):
        process = python_process("drbalance.manager.cli", *args)
        _, err = process.communicate(timeout=30)
        assert process.returncode == 2 and message in err, (args, err)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_clean_shutdown_on_signals(ipc_env, tmp_path, signum):
    # SIGHUP (a closed terminal) as a login shell delivers it: not ignored, as 'nohup' would
    manager = ManagerProcess(tmp_path, ipc_env, restore_signals=True,
                             preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    manager.process.send_signal(signum)
    # no second signal: one sent while the interpreter finalises (default dispositions back) kills it
    code, err = manager.stop(signal_it=False)
    assert code == 0, err
    assert manager.events("stop")[0]["reason"] == signal.Signals(signum).name
    assert leftovers(ipc_env) == []


def test_a_manager_started_under_nohup_keeps_ignoring_sighup(ipc_env, tmp_path):
    manager = ManagerProcess(tmp_path, ipc_env, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    manager.process.send_signal(signal.SIGHUP)
    time.sleep(1.0)
    assert manager.alive(), manager.stderr()
    code, err = manager.stop()
    assert code == 0 and manager.events("stop")[0]["reason"] == "SIGTERM", err


def test_the_lock_owner_is_the_first_line_and_an_empty_file_is_read_again(tmp_path):
    from drbalance.manager.daemon import _lock_owner

    lock = tmp_path / "manager.lock"
    lock.write_text("4242\n99\n")  # a new pid written over a longer old one, before the cut
    fd = os.open(lock, os.O_RDONLY)
    try:
        assert _lock_owner(fd) == "4242"
        lock.write_text("")
        assert _lock_owner(fd, tries=3) == "unknown"
    finally:
        os.close(fd)


PAUSED_AFTER_OPENING_THE_SOURCE = """
import sys, time
from pathlib import Path
from drbalance.manager import cli

opened, go = Path(sys.argv[1]), Path(sys.argv[2])
real_open = cli.open_source

def open_then_wait(*args, **kwargs):
    source = real_open(*args, **kwargs)  # the emulated GPUs exist now
    opened.write_text("opened")
    deadline = time.monotonic() + 60
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return source

cli.open_source = open_then_wait
raise SystemExit(cli.main(sys.argv[3:]))
"""


@contextlib.contextmanager
def manager_paused_in_start_up(ipc_env, tmp_path, go):
    """A real manager on 2 emulated GPUs, held in its start-up just after they were made, until
    ``go`` exists (60 s at most); killed and its GPUs removed at the end, whatever happened."""
    from drbalance.emu.gpus import remove_emulated_gpus

    opened = tmp_path / "opened"
    process = subprocess.Popen(
        [sys.executable, "-c", PAUSED_AFTER_OPENING_THE_SOURCE, str(opened), str(go), "--source", "emulated:2",
         "--log", str(tmp_path / "m.jsonl")],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, restore_signals=True)
    try:
        wait_for(lambda: opened.exists() or process.poll() is not None)
        assert process.poll() is None, process.communicate()[1]
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        remove_emulated_gpus(ipc_env, 2)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_right_after_the_emulated_gpus_are_made_stops_the_manager_cleanly(ipc_env, tmp_path, signum):
    """The stop handlers are installed before the emulated GPUs are made: otherwise a SIGTERM then
    would kill the manager and leave them in /dev/shm (a SIGINT, a KeyboardInterrupt traceback and
    the same)."""
    go = tmp_path / "go"
    with manager_paused_in_start_up(ipc_env, tmp_path, go) as process:
        assert [e for e in leftovers(ipc_env) if ".emu." in e]  # what a stop must remove
        process.send_signal(signum)
        time.sleep(0.5)  # delivered while start-up is held
        go.write_text("go")
        _, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
        assert "Traceback" not in err and signal.Signals(signum).name in err, err
        assert leftovers(ipc_env) == [], err  # the GPUs' segments and semaphores
        assert not list(ipc_env.runtime_dir().glob("emu.*")), err  # and their lock files


def test_a_second_signal_during_a_start_up_that_hangs_stops_the_manager_at_once(ipc_env, tmp_path):
    """A stop signal during start-up waits for start-up to end (so the manager cleans up what it
    made); a second one ends it at once: a start-up that hangs (a driver call that never returns)
    must not need SIGKILL."""
    with manager_paused_in_start_up(ipc_env, tmp_path, tmp_path / "never") as process:
        process.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert process.poll() is None  # the first is kept for when start-up ends
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)  # the start-up holds for 60 s: only the second signal ends it
        assert process.returncode == -signal.SIGINT, err


def _sentinel(signum, frame):  # a handler main must leave in place
    raise AssertionError(f"sentinel handler called for {signum}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("case", "expected"), [
    ("unknown source", 2), ("missing script", 2), ("dr total", 2), ("already running", 1), ("ran", 0)])
def test_the_manager_command_restores_the_signal_handlers_it_found_on_every_return(ipc_env, tmp_path, case,
                                                                                    expected):
    """main() installed its stop handlers (and ignored SIGXFSZ) and left them installed when it
    returned, an error included: called in-process (tests, an embedding program), a later SIGTERM
    or Ctrl-C went to a manager that was gone instead of the caller's own handler."""
    from drbalance.manager import cli as manager_cli

    script = tmp_path / "util.json"
    script.write_text('{"gpus": 1, "steps": [{"at": 0, "util": [0]}]}')
    argv = {"unknown source": ["--source", "bogus"],
            "missing script": ["--source", f"scripted:{tmp_path / 'missing.json'}"],
            "dr total": ["--source", f"scripted:{script}", "--dr-total", "70000"],
            "already running": ["--source", f"scripted:{script}"],
            "ran": ["--source", f"scripted:{script}", "--duration", "0.2"]}[case]
    handled = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGXFSZ]
    before = {signum: signal.getsignal(signum) for signum in handled}
    other = None
    try:
        for signum in handled:
            signal.signal(signum, _sentinel)
        if case == "already running":
            other = ManagerProcess(tmp_path, ipc_env)
        assert manager_cli.main([*argv, "--log", str(tmp_path / "m.jsonl")]) == expected
        assert {signum: signal.getsignal(signum) for signum in handled} == dict.fromkeys(handled, _sentinel)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
        if other is not None:
            other.stop()


def test_notices_for_thousands_of_made_up_names_name_a_bounded_number_on_stderr(ipc_env, tmp_path, caplog,
                                                                                 monkeypatch):
    """A process of the same user can send some 188,000 notices for ever-new app names in 30 s.
    The manager keeps ``MAX_REPORTED`` problems, names those, counts the rest in one line, and the
    log still records every notice: a warning for each, all kept for a minute, would take 85 MB."""
    import logging

    from drbalance.manager import balancer, daemon
    from drbalance.manager.utilization import ScriptedSource

    monkeypatch.setattr(balancer, "MAX_REPORTED", 50)
    monkeypatch.setattr(balancer, "UNREPORTED_SAID_SECONDS", 0.0)
    script = tmp_path / "util.json"
    script.write_text('{"gpus": 1, "steps": [{"at": 0, "util": [0]}]}')
    manager = daemon.Manager(daemon.ManagerSettings(namespace=ipc_env.namespace, log_path=tmp_path / "m.jsonl"),
                             ScriptedSource(script))
    caplog.set_level(logging.WARNING, logger="drbalance.manager")
    manager.start()
    try:
        inbox = posix_ipc.MessageQueue(ipc_env.inbox(discovery.read_manager(ipc_env).inbox))
        for index in range(300):
            inbox.send(Notice(NoticeKind.REGISTER, os.getpid(), 1, f"ghost-{index}", time.time()).encode())
            manager.turn()  # the real inbox, read and handled as the loop does
        inbox.close()
        manager._forget_gone({})  # the rescan's bookkeeping: says how many were not named
    finally:
        manager.stop()
    named = [r for r in caplog.records if "cannot admit" in r.getMessage()]
    assert len(named) == 50 and len(manager._reported) <= 50
    assert "250 more problem(s)" in caplog.text
    invalid = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines() if '"invalid"' in line]
    assert len(invalid) == 300  # the log records every one


@pytest.mark.slow
def test_a_manager_on_a_machine_without_gpus_says_how_and_starts_on_the_jobs_emulated_gpus(ipc_env, tmp_path,
                                                                                          monkeypatch):
    """The README's ``drbalance-manager`` on a machine without NVIDIA GPUs: not only "NVML
    unavailable", but the way (``--source emulated:N``); and where ``DRBALANCE_EMULATED_GPUS`` is
    set, as for the jobs, it starts on those emulated GPUs without being told."""
    monkeypatch.delenv("DRBALANCE_EMULATED_GPUS", raising=False)
    process = python_process("drbalance.manager.cli", "--duration", "1")
    _, err = process.communicate(timeout=60)
    assert process.returncode == 2 and "NVML unavailable" in err, err
    assert "run on emulated GPUs: drbalance-manager --source emulated:4" in err and "DRBALANCE_EMULATED_GPUS" in err
    process = python_process("drbalance.manager.cli", "--duration", "1", "--log", str(tmp_path / "m.jsonl"),
                             env={"DRBALANCE_EMULATED_GPUS": "3"})
    _, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert "on DRBALANCE_EMULATED_GPUS=3 emulated GPUs" in err and "3 GPU(s)" in err
    assert not ipc_env.manager_status().exists()  # stopped cleanly, its emulated GPUs with it
