"""The scripts in examples/ run as a user copies them: on the CPU, in seconds, with no manager running."""

import json
import math
import os
import re
import runpy
import subprocess
import sys

import pytest

from tests.conftest import ROOT, torchrun_args
from tests.helpers.processes import free_port

EXAMPLES = ROOT / "examples"
TORCHRUN_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _run(command: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _usage_error(script: str, args: list[str], capsys) -> tuple[object, str]:
    """Run ``examples/<script> args`` in this process, as ``python`` runs it (``__main__``, its own
    ``argv``), until it exits: (its exit code, what it wrote to stderr). For the usage errors, which
    come before any work: a subprocess would spend seconds importing torch for each case (the
    tests that start the scripts for real cover the process around them). Anything but an exit
    raises, as a traceback would show."""
    saved = sys.argv
    sys.argv = [str(EXAMPLES / script), *args]
    try:
        with pytest.raises(SystemExit) as exited:
            runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    finally:
        sys.argv = saved
    return exited.value.code, capsys.readouterr().err


def _log_events(path) -> list[str]:
    return [json.loads(line)["event"] for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_integrate_trains_the_readme_loop_and_its_session_logs_start_to_finish(ipc_env, tmp_path):
    result = _run([sys.executable, str(EXAMPLES / "integrate.py"), "--app", "copied", "--epochs", "2",
                   "--iterations", "3"])
    assert result.returncode == 0, result.stderr
    done = re.search(r"done: (\d+) iterations, final loss ([0-9.]+)", result.stdout)
    assert done is not None, result.stdout
    assert int(done.group(1)) == 6 and math.isfinite(float(done.group(2)))
    events = _log_events(tmp_path / "logs" / "copied.sd.jsonl")
    assert events[0] == "start" and "finish" in events
    start = json.loads((tmp_path / "logs" / "copied.sd.jsonl").read_text().splitlines()[0])
    assert start["solo_time_source"] == "estimated"  # no --solo-time: the job estimates it


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_ddp_trains_on_two_ranks_that_split_every_global_batch(ipc_env, tmp_path):
    """The example keeps a plain DDP script's loader (DistributedSampler, 12 samples per rank) and
    remakes it with balanced_loader: every global batch of 24 is split by the DR."""
    result = _run([sys.executable, "-m", "torch.distributed.run", *torchrun_args(tmp_path / "torchrun", 2),
                   str(EXAMPLES / "torchrun_ddp.py"), "--app", "copied-ddp", "--batch-size", "12"], timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = {int(m.group(1)): int(m.group(2)) for m in
             re.finditer(r"rank (\d): done: 8 iterations, final loss [0-9.]+, (\d+) of 24 samples", result.stdout)}
    assert set(ranks) == {0, 1} and sum(ranks.values()) == 24, result.stdout
    events = _log_events(tmp_path / "logs" / "copied-ddp.sd.jsonl")  # rank 0's session speaks for the job
    assert events[0] == "start" and "finish" in events
    assert "does not follow the DR" not in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_integrate_takes_a_solo_time_in_seconds_written_with_an_exponent(ipc_env, tmp_path):
    # '1e3' is seconds, not a profile name (which would end the job with a traceback)
    result = _run([sys.executable, str(EXAMPLES / "integrate.py"), "--app", "exponent", "--epochs", "1",
                   "--iterations", "1", "--solo-time", "1e3"])
    assert result.returncode == 0, result.stderr
    start = json.loads((tmp_path / "logs" / "exponent.sd.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["solo_time"] == 1000.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", ["integrate.py", "torchrun_ddp.py"])
@pytest.mark.parametrize("value, message", [
    ("-5", "--solo-time: -5 seconds: must be a finite number of seconds > 0"),
    ("0", "--solo-time: 0 seconds: must be a finite number of seconds > 0"),
    ("inf", "--solo-time: inf seconds: must be a finite number of seconds > 0"),
    ("nan", "--solo-time: nan seconds: must be a finite number of seconds > 0"),
    ("a b", "--solo-time: profile name 'a b' is not valid"),
    ("", "--solo-time: profile name '' is not valid"),
])
def test_an_example_refuses_a_solo_time_that_is_neither_seconds_nor_a_profile_name_in_one_line(
        ipc_env, capsys, script, value, message):
    code, stderr = _usage_error(script, [f"--solo-time={value}"], capsys)
    assert code == 2 and message in stderr, stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", ["integrate.py", "torchrun_ddp.py", "lightning_train.py", "accelerate_train.py"])
@pytest.mark.parametrize("option, value, message", [
    ("--image-size", "0", "argument --image-size: must be an integer >= 1; got 0"),
    ("--image-size", "-3", "argument --image-size: must be an integer >= 1; got -3"),
    ("--image-size", "2.5", "argument --image-size: expected an integer, got '2.5'"),
    ("--epochs", "0", "argument --epochs: must be an integer >= 1; got 0"),
    ("--iterations", "-1", "argument --iterations: must be an integer >= 1; got -1"),
    ("--batch-size", "0", "argument --batch-size: must be an integer >= 1; got 0"),
])
def test_an_example_refuses_a_size_or_count_under_one_in_one_line(ipc_env, capsys, script, option, value, message):
    # a usage error, not a traceback from FakeData, the sampler or the session
    code, stderr = _usage_error(script, [f"{option}={value}"], capsys)
    assert code == 2 and message in stderr and stderr.startswith("usage: "), stderr
    assert stderr.strip().splitlines()[-1] == f"{script}: error: {message}"  # one line after the usage


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", ["integrate.py", "torchrun_ddp.py"])
@pytest.mark.parametrize("value", ["a/b", "", ".hidden"])
def test_an_example_refuses_an_app_name_the_manager_would_refuse_in_one_line(ipc_env, capsys, script, value):
    # a usage error, not a ValueError traceback from the Session after the model was built
    code, stderr = _usage_error(script, [f"--app={value}"], capsys)
    assert code == 2, stderr
    assert stderr.strip().splitlines()[-1].startswith(
        f"{script}: error: argument --app: app name {value!r} is not valid"), stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_torchrun_example_started_without_torchrun_says_so_in_one_line(ipc_env):
    # 'python examples/torchrun_ddp.py' says so, not a KeyError: 'LOCAL_RANK' traceback
    env = {name: value for name, value in os.environ.items() if name not in TORCHRUN_VARIABLES}
    result = subprocess.run([sys.executable, str(EXAMPLES / "torchrun_ddp.py")], cwd=ROOT, capture_output=True,
                            text=True, timeout=100, env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "torchrun_ddp.py: error: LOCAL_RANK, RANK, WORLD_SIZE not set: start it with torchrun, e.g. "
        "torchrun --standalone --nproc_per_node 2 examples/torchrun_ddp.py")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", ["integrate.py", "torchrun_ddp.py"])
def test_an_example_given_a_profile_name_with_no_stored_profile_says_so_in_one_line(ipc_env, tmp_path, script):
    # a valid name that no 'drbalance profile' stored: one line, not a ProfileNotFound traceback from
    # the Session after the model was built
    env = {**os.environ, "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}  # what torchrun sets, for torchrun_ddp.py
    result = subprocess.run([sys.executable, str(EXAMPLES / script), "--solo-time", "some-name"], cwd=ROOT,
                            capture_output=True, text=True, timeout=100, env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("usage: "), result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{script}: error: argument --solo-time: no solo-run profile named 'some-name' in "
                           f"{tmp_path / 'profiles.json'} "), result.stderr
    assert last.endswith("create it with: drbalance profile some-name -- python your_train.py ..."), result.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_example_measured_by_drbalance_profile_takes_the_name_it_is_being_stored_under(ipc_env, tmp_path):
    # the name is not stored yet while 'drbalance profile NAME' measures the example: no error then
    result = _run([sys.executable, "-m", "drbalance", "profile", "fresh", "--iterations", "4", "--warmup", "1",
                   "--", sys.executable, str(EXAMPLES / "integrate.py"), "--app", "measured", "--epochs", "1",
                   "--iterations", "6", "--solo-time", "fresh"])
    assert result.returncode == 0, result.stderr
    stored = json.loads((tmp_path / "profiles.json").read_text())["profiles"]
    assert stored["fresh"]["solo_time_s"] > 0
