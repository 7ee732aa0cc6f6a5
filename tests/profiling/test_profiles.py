"""Solo-run profiles: the command measures a real script, stores it, the client resolves it."""

import json
import sys

import pytest
from torch import nn

from drbalance.cli import main as drbalance
from drbalance.client import BalancedDataParallel
from drbalance.client.session import Session
from drbalance.profiling.store import (
    Measurement,
    Profile,
    ProfileNotFound,
    extrapolate,
    load_profile,
    resolve_solo_time,
    run_profile,
    save_profile,
)
from tests.conftest import torchrun_args
from tests.helpers.processes import running


def test_profile_command_measures_a_real_script_and_the_session_resolves_the_name(ipc_env, tmp_path, capsys):
    status = drbalance([
        "profile", "toy", "--iterations", "30", "--warmup", "5", "--",
        sys.executable, "-m", "tests.helpers.toy_app", "--app", "prof", "--epochs", "4", "--iterations", "50",
        "--sleep", "0.02",
    ])
    assert status == 0
    profile = load_profile("toy")
    assert profile.iterations_total == 200 and profile.measured_iterations == 25 and profile.device == "cpu"
    assert 0.02 <= profile.iteration_time_s < 1.0  # a 0.02 s sleep per iteration; slack for a loaded machine
    assert profile.startup_s >= 0
    assert profile.solo_time_s == pytest.approx(profile.startup_s + 200 * profile.iteration_time_s)
    stored = json.loads((tmp_path / "profiles.json").read_text())
    assert stored["version"] == 1 and stored["profiles"]["toy"]["solo_time_s"] == profile.solo_time_s
    assert "toy\t" in capsys.readouterr().out

    session = Session(BalancedDataParallel(nn.Linear(2, 2)), "user", 4, 50, solo_time="toy",
                      sd_log=False, handle_sigterm=False)
    assert session.tracker.solo_time == pytest.approx(profile.solo_time_s)  # the same plan as the profiled one
    session.close()


def test_profile_mode_trains_alone_on_the_first_device(ipc_env, tmp_path, monkeypatch):
    output = tmp_path / "m.json"
    monkeypatch.setenv("DRBALANCE_PROFILE_OUTPUT", str(output))
    monkeypatch.setenv("DRBALANCE_PROFILE_ITERATIONS", "3")
    monkeypatch.setenv("DRBALANCE_PROFILE_WARMUP", "1")
    model = BalancedDataParallel(nn.Linear(2, 2), ratio=[2, 3, 5])
    session = Session(model, "profiled", 2, 5, solo_time="does-not-exist-yet", sd_log=False, handle_sigterm=False)
    assert model.ratio.shares == (10, 0, 0)
    session.step()
    session.step()
    with pytest.raises(SystemExit) as ended:
        session.step()
    assert ended.value.code == 0
    measurement = Measurement.read(output)
    assert len(measurement.iteration_times) == 3 and measurement.iterations_total == 10
    assert ipc_env.listed_apps() == []  # never touched the manager protocol


def test_unknown_profile_names_list_what_exists(ipc_env, tmp_path):
    with pytest.raises(ProfileNotFound, match=r"no solo-run profile named 'nope'.*profiles there: none"):
        Session(BalancedDataParallel(nn.Linear(2, 2)), "user", 1, 10, solo_time="nope", sd_log=False)
    assert ipc_env.listed_apps() == []  # a refused session leaves nothing behind


def test_bad_profile_runs_give_clear_errors(ipc_env, tmp_path):
    with pytest.raises(RuntimeError, match="without writing a measurement"):
        run_profile("x", [sys.executable, "-c", "pass"], 20, 5)
    with pytest.raises(RuntimeError, match="exited with status 3"):
        run_profile("x", [sys.executable, "-c", "raise SystemExit(3)"], 20, 5)
    with pytest.raises(ValueError, match="must be larger than --warmup"):
        run_profile("x", ["true"], 5, 5)
    with pytest.raises(ValueError, match="profile name"):
        run_profile("bad name", ["true"], 20, 5)
    with pytest.raises(ValueError, match="none after the 4 warm-up"):
        extrapolate(Measurement([0.1] * 4, 4, 100, "cpu"))
    (tmp_path / "profiles.json").write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        load_profile("any")


def test_a_profiles_file_that_could_not_take_the_result_is_refused_before_the_command_runs(tmp_path):
    marker = tmp_path / "ran"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    store = tmp_path / "profiles.json"
    store.write_text('{"version": 1, "profiles": {')  # cut off: an editor, a full disk of an older release
    with pytest.raises(ValueError, match="is not readable JSON"):
        run_profile("x", command, 20, 5, path=store)
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):  # its folder cannot be made: a file is in the way
        run_profile("x", command, 20, 5, path=tmp_path / "file" / "profiles.json")
    assert not marker.exists()  # nothing was measured only to be lost


def test_extrapolation_uses_the_mean_after_warmup():
    solo, mean, startup = extrapolate(Measurement([5.0, 1.0, 2.0, 3.0], 1, 100, "cpu"))
    assert mean == pytest.approx(2.0) and startup == pytest.approx(3.0) and solo == pytest.approx(203.0)
    _, _, startup = extrapolate(Measurement([1.0, 1.5, 2.0, 3.0], 1, 100, "cpu"))
    assert startup == 0.0  # a warm-up faster than the mean costs nothing


def test_profile_not_found_reads_as_one_sentence_with_its_hint_before_the_command(ipc_env, tmp_path):
    # the hint comes before the command, so it does not follow the command's "..." as ".... For 12.5 seconds"
    path = tmp_path / "profiles.json"
    with pytest.raises(ProfileNotFound) as missing:
        resolve_solo_time("12.5", 1)
    assert str(missing.value) == (
        f"no solo-run profile named '12.5' in {path} (profiles there: none); for 12.5 seconds, give the number "
        f"(12.5), not a string; or create the profile with: drbalance profile 12.5 -- python your_train.py ..."
    )
    with pytest.raises(ProfileNotFound) as missing:
        load_profile("nope")
    assert str(missing.value) == (f"no solo-run profile named 'nope' in {path} (profiles there: none); "
                                  f"create it with: drbalance profile nope -- python your_train.py ...")
    for not_seconds in ("inf", "0", "-5"):  # no "give the number" for numbers that are not a solo time
        with pytest.raises(ProfileNotFound) as missing:
            resolve_solo_time(not_seconds, 1)
        assert "give the number" not in str(missing.value) and str(missing.value).endswith("your_train.py ...")
    with pytest.raises(ValueError) as invalid:  # no "create it with: drbalance profile a b -- ..."
        resolve_solo_time("a b", 1)
    assert str(invalid.value) == "profile name 'a b' is not valid: use 1-64 letters, digits, '_', '.' or '-'"


def test_a_solo_time_that_is_neither_seconds_nor_a_profile_name_is_named_as_such(ipc_env):
    import numpy

    def session(solo_time):
        return Session(BalancedDataParallel(nn.Linear(2, 2)), "solo", 1, 2, solo_time=solo_time, sd_log=False,
                       handle_sigterm=False)

    with pytest.raises(ProfileNotFound, match=r"for 12\.5 seconds, give the number \(12\.5\), not a string"):
        session("12.5")
    for wrong in ([12.5], True):
        with pytest.raises(ValueError, match="solo_time must be the solo-run time in seconds"):
            session(wrong)
    with session(numpy.int64(30)) as accepted:  # a NumPy number is a number
        assert accepted.tracker.solo_time == 30.0




@pytest.mark.timeout(60)
def test_a_profile_run_stopped_at_its_timeout_leaves_none_of_the_commands_processes_behind(tmp_path):
    import os
    import signal

    from tests.conftest import wait_for

    pidfile = tmp_path / "trainer.pid"
    script = f"sleep 300 & echo $! > {pidfile}; wait"  # a wrapper script: the trainer is its child
    try:
        with pytest.raises(RuntimeError, match="did not finish within --timeout 2 s"):
            run_profile("x", ["sh", "-c", script], 20, 5, path=tmp_path / "profiles.json", timeout=2)
        trainer = int(pidfile.read_text())
        assert wait_for(lambda: not running(trainer), timeout=30)
    finally:
        if pidfile.exists() and running(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_single_rank_ddp_job_is_profiled_without_a_solo_time(ipc_env, tmp_path):
    """docs/ddp.md says to profile a DDP job's model with one rank; train_ddp.py asked for
    --solo-time even while being profiled, so that command failed."""
    status = drbalance([
        "profile", "ddp-one", "--iterations", "8", "--warmup", "2", "--",
        sys.executable, "-m", "torch.distributed.run", *torchrun_args(tmp_path / "torchrun", 1),
        "-m", "drbalance.runs.train_ddp", "--devices", "cpu", "--model", "alexnet", "--batch-size", "4",
        "--image-size", "64", "--iterations", "40", "--epochs", "1", "--no-progress",
    ])
    assert status == 0
    profile = load_profile("ddp-one")
    assert profile.iterations_total == 40 and profile.measured_iterations == 6
    assert profile.solo_time_s == pytest.approx(profile.startup_s + 40 * profile.iteration_time_s)


def test_a_hand_edited_profiles_file_is_refused_naming_it_never_a_traceback_nor_a_wrong_time(tmp_path):
    """Bytes that are not UTF-8 and JSON nested too deep are refused with the file's name (not a
    bare UnicodeDecodeError or RecursionError); a solo time of true is refused, not taken as 1 s,
    and one of 400 digits too, not an OverflowError traceback in the training script."""
    store = tmp_path / "profiles.json"
    entry = {"name": "x", "solo_time_s": 10.0, "iteration_time_s": 0.1, "iterations_total": 100,
             "measured_iterations": 90, "warmup_iterations": 10, "device": "cpu", "command": ["true"],
             "host": "h", "created": "c"}
    for content, message in (
        (b'{"version": 1, "profiles": {"x": \xff}}', "is not readable JSON"),
        (b'{"version": 1, "profiles": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "is not readable JSON"),
        (json.dumps({"version": 1, "profiles": {"x": {**entry, "solo_time_s": True}}}).encode(), "invalid solo time"),
        (json.dumps({"version": 1, "profiles": {"x": entry}}).replace("10.0", "1" + "0" * 400, 1).encode(),
         "invalid solo time"),
    ):
        store.write_bytes(content)
        with pytest.raises(ValueError, match=message) as refused:
            load_profile("x", store)
        assert str(store) in str(refused.value)


def test_a_stored_profile_is_scaled_to_the_plan_of_the_job_that_names_it(ipc_env, tmp_path):
    """A profile measured over 8 iterations gives a job of 32 iterations start-up + 32 x the mean,
    and the SD log says so; the 8-iteration solo time would make its SD four times too high."""
    save_profile(Profile(name="short", solo_time_s=0.25, iteration_time_s=0.03, iterations_total=8,
                         measured_iterations=6, warmup_iterations=2, device="cpu", command=["python", "x.py"],
                         host="h", created="c", startup_s=0.01))
    log = tmp_path / "job.sd.jsonl"
    with Session(BalancedDataParallel(nn.Linear(2, 2)), "job", 2, 16, solo_time="short", sd_log=log,
                 handle_sigterm=False) as session:
        assert session.tracker.solo_time == pytest.approx(0.01 + 32 * 0.03)
    start = json.loads(log.read_text().splitlines()[0])
    assert start["event"] == "start" and start["solo_time"] == pytest.approx(0.97)
    assert start["solo_time_source"] == "profile" and start["profile"] == "short"
    assert start["scaled_to_iterations"] == 32 and start["profile_iterations"] == 8
    assert start["profile_iteration_time"] == 0.03 and start["profile_startup"] == 0.01
    with Session(BalancedDataParallel(nn.Linear(2, 2)), "given", 2, 16, solo_time=5.0, sd_log=log,
                 handle_sigterm=False) as session:
        assert session.tracker.solo_time == 5.0  # seconds are the whole plan's, as given
    starts = [record for record in map(json.loads, log.read_text().splitlines()) if record["event"] == "start"]
    assert [start["solo_time_source"] for start in starts] == ["profile", "seconds"]


def test_a_profiles_file_without_start_up_times_still_loads(tmp_path):
    """Profiles written before the start-up cost was recorded load with a start-up of 0."""
    store = tmp_path / "profiles.json"
    entry = {"name": "old", "solo_time_s": 10.0, "iteration_time_s": 0.1, "iterations_total": 100,
             "measured_iterations": 90, "warmup_iterations": 10, "device": "cpu", "command": ["true"],
             "host": "h", "created": "c"}
    store.write_text(json.dumps({"version": 1, "profiles": {"old": entry}}))
    profile = load_profile("old", store)
    assert profile.startup_s == 0.0 and profile.solo_time(300) == pytest.approx(30.0)
    store.write_text(json.dumps({"version": 1, "profiles": {"old": {**entry, "startup_s": -1}}}))
    with pytest.raises(ValueError, match="invalid start-up time -1"):
        load_profile("old", store)
