"""Bad input to the commands is one line and a non-zero exit, never a traceback, and leaves nothing
behind; machine-readable output stays machine-readable."""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from drbalance import cli
from drbalance.workload.scenarios import load_scenario, scenario_from_json
from tests.conftest import python_process

pytestmark = pytest.mark.timeout(180)


def run(module: str, *args: str, env: dict | None = None) -> tuple[int, str, str]:
    process = python_process(module, *args, env=env)
    out, err = process.communicate(timeout=120)
    return process.returncode, out, err


@pytest.mark.parametrize("option", [("--dr-total", "0"), ("--sd-threshold", "-1"), ("--util-threshold", "200"),
                                    ("--window", "99999999999999999999")])  # not an OverflowError traceback
def test_an_out_of_range_manager_setting_is_one_line_and_leaves_no_emulated_gpus(ipc_env, option):
    code, _out, err = run("drbalance.manager.cli", "--source", "emulated:2", *option)
    assert code == 2 and "Traceback" not in err and "drbalance-manager:" in err, err
    assert not [entry for entry in os.listdir("/dev/shm") if f".{ipc_env.namespace}." in entry]


@pytest.mark.parametrize("argv, message", [
    (["simulate", "e2e-a", "--decide-every", "-1"], "--decide-every: must be an integer >= 0"),
    (["report", "nowhere", "--step", "0"], "--step: must be a positive number"),
    (["launch", "e2e-a", "--run-dir", "x", "--time-scale", "-1"], "--time-scale: must be a positive number"),
    (["demo", "--out", "x", "--time-scale", "0"], "--time-scale: must be a positive number"),
    (["launch", "e2e-a", "--run-dir", "x", "--real-batch", "0"], "--real-batch: must be an integer >= 1"),
    (["launch", "e2e-a", "--run-dir", "x", "--timeout", "-5"], "--timeout: must be a positive number"),
    (["profile", "x", "--warmup", "-1", "--", "true"], "--warmup: must be an integer >= 0"),
    (["launch", "e2e-a", "--run-dir", "x", "--sd-threshold", "nan"], "--sd-threshold: must be a finite number"),
    (["launch", "e2e-a", "--run-dir", "x", "--util-threshold", "101"], "--util-threshold: must be within 0..100"),
    (["simulate", "e2e-a", "--sd-threshold", "-1"], "--sd-threshold: must be a number >= 0"),
    (["simulate", "e2e-a", "--dr-total", "0"], "--dr-total: must be an integer >= 1"),
])
def test_numbers_that_would_change_meaning_or_crash_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["profile", "x", "--iterations", "5", "--warmup", "5", "--", "true"],
     "--warmup (5) must be smaller than --iterations (5)"),
    (["profile", "x", "--warmup", "200", "--", "true"], "--warmup (200) must be smaller than --iterations (200)"),
    (["profile", "x", "--iterations", "3", "--warmup", "7", "--", "true"],
     "--warmup (7) must be smaller than --iterations (3)"),
    (["profile", "a b", "--", "true"], "argument NAME: profile name 'a b' is not valid"),
    (["profile", "", "--", "true"], "argument NAME: profile name '' is not valid"),
    (["profile", "x"], "give the training command after '--'"),
    (["profile", "x", "--"], "give the training command after '--'"),
    (["profile", "x", "--profiles", "", "--", "true"], "argument --profiles: expected a file path, got ''"),
])
def test_a_profile_command_line_that_cannot_measure_is_a_usage_error_before_anything_runs(
        argv, message, ipc_env, tmp_path, capsys):
    # usage errors (exit status 2), not 'error:' lines with exit status 1; --profiles '' does not
    # silently mean the default file
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and message in err and "usage: drbalance profile" in err, err
    assert not (tmp_path / "profiles.json.lock").exists()  # refused before the store is touched


def test_manager_duration_must_be_positive():
    code, _out, err = run("drbalance.manager.cli", "--source", "emulated:2", "--duration", "-1")
    assert code == 2 and "--duration: must be a positive number" in err and "Traceback" not in err


def test_report_json_is_json_with_plots_and_a_second_report_over_the_same_glob_works(tmp_path, capsys):
    for policy in ("fair", "observe"):
        assert cli.main(["simulate", "e2e-a", "--policy", policy, "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    runs = sorted(str(path) for path in tmp_path.iterdir())
    assert cli.main(["report", *runs, "--json"]) == 0
    captured = capsys.readouterr()
    assert {entry["label"] for entry in json.loads(captured.out)} == {"fair", "observe"}
    assert "plots:" in captured.err  # the plots were written; their list goes to stderr
    again = sorted(str(path) for path in tmp_path.iterdir())  # now with runs/report, as runs/* matches it
    assert len(again) == 3 and cli.main(["report", *again, "--no-plots"]) == 0


@pytest.mark.parametrize("text, message", [
    ("[]", "must be a JSON object, got list"),
    ('{"name": "x", "apps": []}', "missing key(s) 'gpus'"),
    ('{"name": "x", "gpus": "four", "apps": []}', "'gpus' must be an integer"),
    ('{"name": "x", "gpus": 2, "apps": null}', "'apps' must be a list"),
    ('{"name": "x", "gpus": 2, "apps": [{"name": "a", "model": "alexnet", "batch": 32, "epochs": 1, '
     '"iterations_per_epoch": 5, "bogus": 1}]}', "app 0: unknown key(s) 'bogus'"),
    ('{"name": "x", "gpus": 2, "gpu_speed": 2, "apps": []}', "'gpu_speed' must be a list of one speed factor"),
    ('{"name": "x", "gpus": 2, "paper": [1], "apps": []}', "'paper' must be a JSON object"),
    ('{"name": "x", "gpus": 2, "paper": {"sd_diff_end": "low"}, "apps": []}', "'paper' must be a JSON object"),
    ('{"name": ["x"], "gpus": 2, "apps": []}', "'name' must be printable text"),
    ('{"name": "x\\u001b[2J", "gpus": 2, "apps": []}', "'name' must be printable text"),
    ('{"name": "x", "description": 7, "gpus": 2, "apps": []}', "'description' must be printable text"),
    ('{"name": "x", "gpus": 2, "gpus": 4, "apps": []}', "key 'gpus' is given twice"),
    ('{"name": "x", "gpus": 2, "apps": [{"name": "a", "model": "alexnet", "batch": 32, "batch": 64, "epochs": 1, '
     '"iterations_per_epoch": 5}]}', "key 'batch' is given twice"),
    ('{"name": "x", "gpus": 2, "apps": [{"name": "a", "model": "alexnet", "batch": 32, "epochs": 1, '
     '"iterations_per_epoch": 5, "ratio": 10}]}', "app 0: 'ratio' must be a list of shares"),
    ('{"name": "x", "gpus": 2, "apps": [{"name": "a", "model": "alexnet", "batch": 32, "epochs": 1, '
     '"iterations_per_epoch": 5, "ratio": [5, 6]}]}', "app 'a': ratio: DR shares [5, 6] sum to 11"),
])
def test_a_malformed_scenario_file_names_what_is_wrong(text, message):
    with pytest.raises(ValueError) as raised:
        scenario_from_json(text, "mine.json")
    assert message in str(raised.value) and "mine.json" in str(raised.value)


def _app(**fields: object) -> dict:
    return {"name": "a", "model": "alexnet", "batch": 32, "epochs": 1, "iterations_per_epoch": 5, **fields}


@pytest.mark.parametrize("app, message", [
    (_app(name="../../escaped"), "app name '../../escaped' is not valid"),
    (_app(name="x/y"), "app name 'x/y' is not valid"),
    (_app(name=""), "app name '' is not valid"),
    (_app(name=5), "app name 5 is not valid"),
    (_app(arrival=10**400), "arrival must be a finite number >= 0"),
    (_app(arrival="1"), "arrival must be a finite number >= 0"),
    (_app(batch=True), "batch must be a positive integer; got True"),
    (_app(model=5), "model must be a model name"),
])
def test_a_scenario_app_that_would_escape_its_folder_or_crash_is_refused_naming_the_file(app, message):
    with pytest.raises(ValueError) as raised:
        scenario_from_json(json.dumps({"name": "x", "gpus": 1, "apps": [app]}), "mine.json")
    assert message in str(raised.value) and "mine.json" in str(raised.value)


@pytest.mark.parametrize("field, value, message", [
    ("dr_total", 0, r"dr_total must be an integer 1\.\.65535"),
    ("dr_total", 70_000, r"dr_total must be an integer 1\.\.65535"),  # the daemon refuses it: 16-bit shares
    ("dr_total", "10", r"dr_total must be an integer 1\.\.65535"),
    ("dr_total", 10.0, r"dr_total must be an integer 1\.\.65535"),
    ("gpu_speed", [1e300], r"gpu_speed must hold 1 positive numbers of at most 1000"),  # the bound's LP fails
])
def test_a_scenario_dr_total_or_gpu_speed_the_simulator_cannot_use_is_refused_naming_the_file(field, value, message):
    with pytest.raises(ValueError, match=message) as raised:
        scenario_from_json(json.dumps({"name": "x", "gpus": 1, field: value, "apps": [_app()]}), "mine.json")
    assert "mine.json" in str(raised.value)


def test_a_scenario_of_more_gpus_than_a_record_carries_or_too_deep_is_refused():
    with pytest.raises(ValueError, match=r"gpus must be 1\.\.32"):
        scenario_from_json(json.dumps({"name": "x", "gpus": 10**12, "apps": [_app()]}), "mine.json")
    with pytest.raises(ValueError, match="mine.json: not a valid scenario: JSON nested too deeply"):
        scenario_from_json("[" * 100_000 + "]" * 100_000, "mine.json")


def test_a_scenario_file_that_is_not_a_regular_file_or_not_text_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00")
    for path, message in ((fifo, "not a regular file"), (tmp_path, "not a regular file"),
                          (binary, "not UTF-8 text")):
        with pytest.raises(ValueError) as raised:
            load_scenario(str(path))
        assert f"cannot read scenario file {path}: {message}" in str(raised.value)


def test_a_run_the_simulator_could_not_finish_is_refused_at_once(tmp_path, capsys):
    scenario = tmp_path / "late.json"
    scenario.write_text(json.dumps({"name": "late", "gpus": 1, "apps": [_app(arrival=2e7)]}))
    assert cli.main(["simulate", str(scenario), "--policy", "observe"]) == 1
    assert "app 'a': arriving at 2e+07 s" in capsys.readouterr().err


def test_a_run_the_simulator_could_not_finish_is_refused_naming_the_file_before_any_log(tmp_path, capsys):
    scenario = tmp_path / "slow.json"
    scenario.write_text(json.dumps({"name": "slow", "gpus": 2, "gpu_speed": [1, 1e-9], "apps": [_app()]}))
    out = tmp_path / "runs"
    assert cli.main(["simulate", str(scenario), "--compare", "--out", str(out)]) == 1
    error = capsys.readouterr().err
    assert f"{scenario}: app 'a': arriving at 0 s" in error and "alone on the slowest GPU (speed 1e-09)" in error
    assert not out.exists()


def test_simulate_refuses_an_out_that_holds_an_earlier_run_or_is_a_file_before_simulating(tmp_path, capsys):
    assert cli.main(["simulate", "e2e-a", "--policy", "observe", "--out", str(tmp_path / "runs")]) == 0
    before = sorted(path.name for path in (tmp_path / "runs" / "observe" / "apps").iterdir())
    capsys.readouterr()
    assert cli.main(["simulate", "e2e-skewed", "--policy", "observe", "--out", str(tmp_path / "runs")]) == 1
    assert "already holds an earlier run" in capsys.readouterr().err
    assert sorted(path.name for path in (tmp_path / "runs" / "observe" / "apps").iterdir()) == before
    afile = tmp_path / "afile"
    afile.write_text("")
    assert cli.main(["simulate", "e2e-a", "--policy", "observe", "--out", str(afile)]) == 1
    assert f"--out {afile}: exists and is not a folder" in capsys.readouterr().err


def test_an_os_error_of_a_command_is_one_line_not_a_traceback(tmp_path, capsys):
    assert cli.main(["simulate", "e2e-a", "--policy", "observe", "--out", str(tmp_path / "runs")]) == 0
    afile = tmp_path / "afile"
    afile.write_text("")
    capsys.readouterr()
    assert cli.main(["report", str(tmp_path / "runs" / "observe"), "--out", str(afile / "report")]) == 1
    assert "drbalance report: error:" in capsys.readouterr().err
    assert cli.main(["report", str(tmp_path / "runs" / "observe"), "--out", str(afile)]) == 1  # named, before any table
    assert capsys.readouterr() == ("", f"drbalance report: error: --out {afile} exists and is not a folder; give a "
                                       f"folder for the plots and report.md (made if missing)\n")
    assert cli.main(["report", str(tmp_path / "runs" / "observe"), "--no-plots", "--step", "1e-9"]) == 1
    assert "use a larger --step" in capsys.readouterr().err


def test_the_training_script_reports_a_bad_dr_in_one_line(tmp_path):
    code, _out, err = run("drbalance.runs.train", "--devices", "cpu", "--ratio", "0,0", "--solo-time", "1",
                          "--epochs", "1", "--iterations", "1", env={"DRBALANCE_NO_MANAGER": "1"})
    assert code == 2 and "Traceback" not in err, err
    assert "drbalance.runs.train: error: DR shares [0, 0] are all zero" in err


def test_report_names_a_file_given_as_a_run_and_a_corrupt_run_json(tmp_path, capsys):
    afile = tmp_path / "results.json"
    afile.write_text("{}")
    assert cli.main(["report", str(afile)]) == 1
    assert f"run directory {afile} is not a folder" in capsys.readouterr().err
    assert cli.main(["simulate", "e2e-a", "--policy", "observe", "--out", str(tmp_path / "runs")]) == 0
    (tmp_path / "runs" / "observe" / "run.json").write_text("{broken")
    capsys.readouterr()
    assert cli.main(["report", str(tmp_path / "runs" / "observe"), "--no-plots"]) == 1
    assert "run.json: not readable JSON" in capsys.readouterr().err
    (tmp_path / "runs" / "observe" / "run.json").write_text("[1]")
    assert cli.main(["report", str(tmp_path / "runs" / "observe"), "--no-plots"]) == 1
    assert "run.json: not a JSON object" in capsys.readouterr().err
    (tmp_path / "runs" / "observe" / "run.json").write_text('{"started": "x"}')
    assert cli.main(["report", str(tmp_path / "runs" / "observe"), "--no-plots"]) == 1
    assert "run.json: 'started' must be a number of seconds" in capsys.readouterr().err


def test_report_skips_records_without_a_numeric_time_and_says_so(tmp_path, capsys, caplog):
    assert cli.main(["simulate", "e2e-a", "--policy", "observe", "--out", str(tmp_path)]) == 0
    log = sorted((tmp_path / "observe" / "apps").iterdir())[0]
    with log.open("a") as handle:
        handle.write('{"t": "x", "event": "sd", "sd": 9.0}\n{"event": "sd", "sd": 9.0}\n')
    capsys.readouterr()
    assert cli.main(["report", str(tmp_path / "observe"), "--no-plots", "--json"]) == 0
    (summary,) = json.loads(capsys.readouterr().out)
    assert max(summary["final_sd"].values()) < 9.0  # the two records were not read
    assert f"{log}: skipped 2 record(s) without a numeric time 't'" in caplog.text


def test_a_process_the_launcher_waits_for_that_exits_first_is_named_with_its_last_words(tmp_path):
    from drbalance.runs.launch import _wait_for

    output = tmp_path / "manager.out"
    with open(output, "w") as out:
        process = subprocess.Popen([sys.executable, "-c", "print('starting'); print('NVML unavailable: no driver');"
                                    "raise SystemExit(2)"], stdout=out, stderr=subprocess.STDOUT)
        with pytest.raises(RuntimeError) as raised:
            _wait_for(lambda: False, 60, "drbalance-manager", process, output)
    message = str(raised.value)
    assert "exited with status 2: NVML unavailable: no driver" in message and str(output) in message


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly_with_141():
    process = python_process("drbalance", "simulate", "e2e-a", "--policy", "observe", "--json")
    process.stdout.close()  # the reader goes away before the first line: 'drbalance ... | head -0'
    err = process.stderr.read()
    assert process.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("buffered", [True, False])
@pytest.mark.parametrize("command", [("drbalance", "simulate", "e2e-a", "--policy", "observe", "--json"),
                                     ("drbalance", "simulate", "--help"), ("drbalance", "--version"),
                                     ("drbalance.manager.cli", "--help")])
def test_output_lost_to_a_full_disk_is_an_error_that_names_standard_output(command, buffered):
    """'drbalance simulate ... --json > /dev/full' said only "[Errno 28] No space left on device",
    and '--help > /dev/full' exited 0 (argparse drops the error); buffered, the write fails only
    at a flush."""
    with open("/dev/full", "w") as full:  # every write to it fails with ENOSPC, as on a full disk
        process = python_process(*command, stdout=full, env={"PYTHONUNBUFFERED": "" if buffered else "1"})
        _out, err = process.communicate(timeout=100)
    assert process.returncode == 1, err
    assert "cannot write standard output: No space left on device" in err, err
    assert err.count("cannot write standard output") == 1, err  # said once
    assert "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.timeout(120)
def test_a_command_started_with_its_output_closed_says_so_instead_of_losing_it():
    """'drbalance simulate ... --json >&-' exited 0: Python's print() drops what goes to a closed
    standard output."""
    process = python_process("drbalance", "simulate", "e2e-a", "--policy", "observe", "--json",
                             stdout=subprocess.DEVNULL, preexec_fn=lambda: os.close(1))
    _out, err = process.communicate(timeout=100)
    assert process.returncode == 2 and "standard output is closed" in err, err


@pytest.mark.parametrize("module", ["drbalance", "drbalance.manager.cli"])
def test_help_names_every_environment_variable_and_the_documented_defaults(module):
    from drbalance.helptext import environment_variables

    code, out, err = run(module, "--help", env={"COLUMNS": "400"})  # one line per variable
    assert code == 0, err
    listed = out.split("environment variables:", 1)[1]
    variables = environment_variables()
    assert len(variables) >= 8
    for name, text in variables:
        assert f"  {name}: {text}" in listed, name
    assert "DRBALANCE_RUNTIME_DIR" in listed and "(default: '$XDG_RUNTIME_DIR/drbalance'" in listed
    assert "DRBALANCE_PROFILE_WARMUP: leading profile iterations left out of the mean (default 10)" in listed


@pytest.mark.parametrize("command", ["launch", "demo"])
def test_cuda_devices_that_are_not_there_are_refused_before_anything_starts(command, tmp_path, monkeypatch, capsys):
    from drbalance.runs import launch

    monkeypatch.setattr(launch, "cuda_gpu_count", lambda: 1)  # a one-GPU machine; e2e-a needs 4
    run_dir = tmp_path / "run"
    scenario = ["e2e-a", "--run-dir"] if command == "launch" else ["--scenario", "e2e-a", "--out"]
    assert cli.main([command, *scenario, str(run_dir), "--devices", "cuda"]) == 1
    err = capsys.readouterr().err
    assert f"drbalance {command}: error: --devices cuda: the scenario needs 4 GPUs and torch sees 1" in err, err
    assert not run_dir.exists()


@pytest.mark.parametrize("option, message", [
    (("--batch-size", "0"), "--batch-size: must be an integer >= 1"),
    (("--epochs", "-1"), "--epochs: must be an integer >= 1"),
    (("--workers", "-1"), "--workers: must be an integer >= 0"),
    (("--lr", "0"), "--lr: must be a positive number"),
])
def test_the_ddp_training_script_refuses_numbers_that_cannot_train(option, message, capsys):
    from drbalance.runs.train_ddp import build_parser

    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["--solo-time", "1", *option])
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_the_training_script_refuses_an_empty_batch_in_one_line():
    code, _out, err = run("drbalance.runs.train", "--devices", "cpu", "--batch-size", "0", "--solo-time", "1",
                          env={"DRBALANCE_NO_MANAGER": "1"})
    assert code == 2 and "Traceback" not in err and "--batch-size: must be an integer >= 1" in err, err



def test_a_built_in_name_wins_over_a_file_of_that_name_and_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").write_text("{}")
    with caplog.at_level("WARNING"):
        assert load_scenario("a").description.startswith("paper (a)")
    assert "the built-in scenario, not the file a here (write ./a for the file)" in caplog.text
    with pytest.raises(ValueError, match="a: not a valid scenario"):
        load_scenario("./a")  # the file, when the user says so


def test_simulate_refuses_a_policy_or_scheduler_another_option_would_ignore(capsys):
    """A usage error (exit status 2): ``--scheduler themis --policy paper`` ran themis and exited 0."""
    for argv, given in ((["--compare", "--policy", "paper"], "--policy"), (["--compare", "--scheduler", "themis"],
                        "--scheduler"), (["--scheduler", "themis", "--policy", "paper"], "--policy")):
        with pytest.raises(SystemExit) as stopped:
            cli.main(["simulate", "e2e-a", *argv])
        assert stopped.value.code == 2 and f"{given} cannot be combined with it" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["simulate", "e2e-a", "--out", ""], "argument --out: expected a path, got ''"),
    (["report", "somewhere", "--out", ""], "argument --out: expected a path, got ''"),
    (["report", ""], "argument PATH: expected a path, got ''"),
    (["launch", "e2e-a", "--run-dir", ""], "argument --run-dir: expected a path, got ''"),
    (["demo", "--out", ""], "argument --out: expected a path, got ''"),
    (["launch", "e2e-a", "--run-dir", "x", "--time-scale", "1e308"], "--time-scale: must be at most 10000"),
    (["demo", "--out", "x", "--time-scale", "1e5"], "--time-scale: must be at most 10000"),
    (["simulate", "e2e-a", "--dr-total", "65536"], "--dr-total: must be an integer within 1..65535"),
])
def test_an_empty_path_or_a_number_past_what_works_is_a_usage_error(argv, message, tmp_path, monkeypatch, capsys):
    """An empty path (an unset shell variable) put a run's logs in the current folder; a time scale
    of 1e308 started a manager and six jobs, then overflowed the launcher's clock (a traceback)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing started


def test_what_follows_a_double_dash_is_parsed_or_refused_never_dropped(tmp_path, monkeypatch, capsys):
    """Every subcommand cut its command line at '--': ``launch S --run-dir R -- --policy observe``
    ran the default policy and exited 0. Only ``profile`` takes a program's command line there."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["launch", "e2e-a", "--run-dir", "run", "--", "--policy", "observe"])
    assert stopped.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert cli.main(["simulate", "--policy", "observe", "--", "e2e-a"]) == 0  # '--' ends the options, as usual
    assert "observe" in capsys.readouterr().out
    assert cli.split_command_line(["profile", "p", "--iterations", "5", "--", "python", "-m", "x", "--", "y"]) == (
        ["profile", "p", "--iterations", "5"], ["python", "-m", "x", "--", "y"])
    assert cli.split_command_line(["-v", "launch", "s", "--", "--policy", "x"]) == (
        ["-v", "launch", "s", "--", "--policy", "x"], [])


def test_verbose_may_follow_the_subcommand(capsys):
    assert cli.main(["simulate", "e2e-a", "--policy", "observe", "--json", "-v"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"]["observe"]["final_sd"]
    parser, _, _ = cli.build_parser(["simulate", "e2e-a", "-v"])
    assert parser.parse_args(["simulate", "e2e-a", "-v"]).verbose is True
    assert parser.parse_args(["-v", "simulate", "e2e-a"]).verbose is True  # not reset by the subcommand
    assert parser.parse_args(["simulate", "e2e-a"]).verbose is False


@pytest.mark.parametrize("policies, message", [
    ("fair,fair", "--policies names fair twice; each policy runs once"),
    ("bogus", "--policies takes names from"),
    (",", "--policies takes names from"),
])
def test_the_demo_refuses_a_policy_list_it_could_not_run_before_starting_anything(policies, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["demo", "--policies", policies, "--out", str(tmp_path / "demo")])
    assert exited.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()


def _one_rank_env() -> dict:
    """torchrun's variables for a job of one rank (the script's checks run as under torchrun)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


@pytest.mark.parametrize("option, message", [
    (("--ratio", "1,x", "--solo-time", "10"), "--ratio takes comma-separated integers, e.g. 5,5; got '1,x'"),
    (("--solo-time", "no-such-profile"), "no-such-profile"),
    (("--ratio", "0,0", "--solo-time", "10"), "--ratio: DR shares [0, 0] are all zero"),
    (("--ratio", "4,6", "--solo-time", "10"), "--ratio [4, 6]/10 has 2 entries but the job has 1 rank(s)"),
    (("--ratio", "1,1", "--solo-time", "10"), "--ratio [5, 5]/10 has 2 entries but the job has 1 rank(s)"),
])
@pytest.mark.slow
def test_the_ddp_training_script_reports_bad_input_found_while_setting_up_in_one_line(ipc_env, option, message):
    code, _out, err = run("drbalance.runs.train_ddp", "--model", "alexnet", "--devices", "cpu", "--epochs", "1",
                          "--iterations", "1", "--no-progress", *option, env=_one_rank_env())
    assert code == 2 and "Traceback" not in err, err
    assert "drbalance.runs.train_ddp: error (rank 0): " in err and message in err, err
    assert not [entry for entry in os.listdir("/dev/shm") if f".{ipc_env.namespace}." in entry]


def test_the_training_script_reports_an_sd_log_it_must_not_open_in_one_line(ipc_env, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "linked.sd.jsonl").symlink_to(tmp_path / "elsewhere")
    code, _out, err = run("drbalance.runs.train", "--model", "alexnet", "--devices", "cpu", "--epochs", "1",
                          "--iterations", "1", "--solo-time", "10", "--app", "linked", "--no-progress",
                          env={"DRBALANCE_LOG_DIR": str(logs)})
    assert code == 2 and "Traceback" not in err and "is a symbolic link" in err, err
    assert not (tmp_path / "elsewhere").exists()
    assert not [entry for entry in os.listdir("/dev/shm") if f".{ipc_env.namespace}." in entry]  # nothing left
    assert not list(ipc_env.runtime_dir().glob("**/*.claim"))  # the app's name is free again


def test_report_takes_a_run_json_without_a_start_and_skips_utilisation_that_is_not_a_list_of_numbers(
        tmp_path, capsys):
    assert cli.main(["simulate", "e2e-a", "--policy", "observe", "--out", str(tmp_path)]) == 0
    run_dir = tmp_path / "observe"
    info = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**info, "started": None}))  # accepted by the check: null
    with (run_dir / "manager.jsonl").open("a") as log:
        for util in ("null", "42", '{"0": 50}', "[NaN, true, 50]"):  # Python's json reads NaN
            log.write(f'{{"t": 1.0, "event": "util", "util": {util}}}\n')
    capsys.readouterr()
    assert cli.main(["report", str(run_dir), "--no-plots", "--json"]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    summary = json.loads(captured.out)[0]
    assert summary["makespan"] > 0 and 0 < summary["mean_util"] <= 100


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_cuda_visible_devices_that_shows_no_emulated_gpu_is_one_line_from_the_training_script(
        ipc_env, monkeypatch, capsys):
    from drbalance.runs import train

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    code = train.main(["--devices", "emulated:4", "--model", "mnasnet1_0", "--iterations", "1", "--solo-time", "1",
                       "--image-size", "64"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("drbalance.runs.train: error: CUDA_VISIBLE_DEVICES='7' starts with '7', which names none "
                          "of them, so no device is visible (as CUDA sees none) among this user's 4 emulated GPUs"), err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("module", ["drbalance.runs.train", "drbalance.runs.train_ddp"])
def test_a_device_index_after_cuda_is_refused_naming_gpus_not_dropped(module):
    """'--devices cuda:1' is refused: dropping the ':1' without a word would train on every CUDA GPU."""
    from importlib import import_module

    choose_devices = import_module(module).choose_devices
    for spec, hint in (("cuda:1", "--gpus 1"), ("cpu:2", "--gpus 2")):
        with pytest.raises(SystemExit, match=f"takes nothing after it; choose GPUs with --gpus.*{hint}"):
            choose_devices(spec)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("module", ["drbalance.runs.train", "drbalance.runs.train_ddp"])
def test_emulated_devices_take_a_memory_size_as_the_environment_variable_does(module, monkeypatch):
    """DRBALANCE_EMULATED_GPUS=4:16GiB (docs/emulation.md) is taken by train.py and train_ddp's
    '--devices auto' alike, not refused with "--devices emulated:N needs a GPU count"."""
    from importlib import import_module

    choose_devices = import_module(module).choose_devices
    kind, spec = choose_devices("emulated:4:16GiB")
    assert (kind, spec.count, spec.memory_bytes) == ("emulated", 4, 16 * 2**30)
    if not torch.cuda.is_available():
        monkeypatch.setenv("DRBALANCE_EMULATED_GPUS", "2:8GiB")
        kind, spec = choose_devices("auto")
        assert (kind, spec.count, spec.memory_bytes) == ("emulated", 2, 8 * 2**30)
    with pytest.raises(SystemExit, match="emulated GPU count must be an integer"):
        choose_devices("emulated:x")
    if not torch.cuda.is_available():  # a bad variable is named, not blamed on '--devices emulated:abc'
        monkeypatch.setenv("DRBALANCE_EMULATED_GPUS", "abc")
        with pytest.raises(SystemExit, match=r"--devices auto \(no CUDA\): DRBALANCE_EMULATED_GPUS='abc': emulated"):
            choose_devices("auto")


@pytest.mark.parametrize("main, argv, message", [
    ("drbalance.sim.mixes", ["--policies", "fair,bogus"], "--policies: unknown policies 'bogus'; known: fair"),
    ("drbalance.sim.mixes", ["--only", ","], "--only: no mixes given; known: 8x12"),
    ("drbalance.sim.mixes", ["--workers", "0"], "--workers: must be an integer >= 1"),
    ("benchmarks.random_mixes", ["--policies", "nope"], "--policies: unknown policies 'nope'"),
    ("benchmarks.random_mixes", ["--workers", "-2"], "--workers: must be an integer >= 1"),
])  # refused up front, not a traceback from a worker process after the first simulations have started
def test_the_mix_commands_refuse_unknown_names_and_no_workers_before_simulating(main, argv, message, capsys):
    module = importlib.import_module(main)
    with pytest.raises(SystemExit) as stopped:
        module.main(argv)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_simulate_out_refuses_a_planted_link_and_writes_private_files(tmp_path, capsys):
    """A run folder's ``apps`` planted as a link to another folder (a trap in a shared folder) is
    refused before anything is simulated, and nothing is written there; what --out writes is
    this user's alone (no group or other bits)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_dir = tmp_path / "runs" / "observe"
    run_dir.mkdir(parents=True)
    (run_dir / "apps").symlink_to(elsewhere)
    assert cli.main(["simulate", "e2e-a", "--policy", "observe", "--out", str(tmp_path / "runs")]) == 1
    assert "is a symbolic link" in capsys.readouterr().err
    assert list(elsewhere.iterdir()) == []
    out = tmp_path / "private"
    assert cli.main(["simulate", "e2e-a", "--policy", "observe", "--out", str(out)]) == 0
    written = out / "observe"
    assert json.loads((written / "run.json").read_text())["simulated"] is True
    for path in (out, written, written / "apps", written / "run.json", written / "manager.jsonl"):
        assert path.stat().st_mode & 0o077 == 0, path


@pytest.mark.parametrize("text, expected", [("1e3", 1000.0), (".5e2", 50.0), ("60", 60.0), ("2.5", 2.5),
                                            ("resnet50", "resnet50"), ("resnet50-b64.v2", "resnet50-b64.v2")])
def test_seconds_or_profile_name_reads_any_finite_positive_float_as_seconds(text, expected):
    from drbalance.argtypes import seconds_or_profile_name

    assert seconds_or_profile_name(text) == expected


@pytest.mark.parametrize("text, message", [
    ("-5", "-5 seconds: must be a finite number of seconds > 0"), ("0", "0 seconds"), ("-inf", "-inf seconds"),
    ("1e999", "1e999 seconds"), ("NaN", "NaN seconds"), ("x/y", "profile name 'x/y' is not valid"),
])
def test_seconds_or_profile_name_refuses_other_numbers_and_invalid_names(text, message):
    import argparse

    from drbalance.argtypes import seconds_or_profile_name

    with pytest.raises(argparse.ArgumentTypeError) as refused:
        seconds_or_profile_name(text)
    assert message in str(refused.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module, model, size, batch, message", [
    ("drbalance.runs.train", "alexnet", "32", "8", "alexnet trains on images of at least 63 pixels a side"),
    ("drbalance.runs.train", "densenet121", "28", "8", "densenet121 trains on images of at least 29 pixels a side"),
    ("drbalance.runs.train", "resnet50", "16", "1", "resnet50 trains a chunk of one sample on images of at "
                                                     "least 33 pixels a side"),
    ("drbalance.runs.train_ddp", "resnet50", "32", "8", "resnet50 trains a chunk of one sample on images of at "
                                                        "least 33 pixels a side"),
    ("drbalance.runs.train_ddp", "alexnet", "8", "8", "alexnet trains on images of at least 63 pixels a side"),
])
def test_an_image_size_too_small_for_the_model_is_a_usage_error_not_a_traceback_from_its_forward(
        ipc_env, module, model, size, batch, message):
    # '--model alexnet --image-size 32' passes the positive-integer check but would die in the first forward
    # ("Output size is too small"); resnet50 at 16 with one-sample chunks likewise
    code, _out, err = run(module, "--model", model, "--image-size", size, "--batch-size", batch, "--devices", "cpu",
                          "--epochs", "1", "--iterations", "1", "--solo-time", "10", "--no-progress",
                          env=_one_rank_env())
    assert code == 2 and "Traceback" not in err, err
    assert f"error: argument --image-size: {message}; got {size}" in err and "usage: " in err, err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_smallest_image_sizes_are_the_smallest_each_model_trains_on():
    """The table the training scripts check --image-size against, measured: each model trains a
    forward and backward at its smallest side and fails one pixel under it."""
    import torchvision

    from drbalance.runs.train import MIN_IMAGE_SIZE, MODELS

    assert set(MIN_IMAGE_SIZE) == set(MODELS)

    def trains(network: torch.nn.Module, side: int, samples: int) -> bool:
        try:
            network(torch.randn(samples, 3, side, side)).sum().backward()
        except (RuntimeError, ValueError):
            return False
        return True

    for model, (shared, alone) in MIN_IMAGE_SIZE.items():
        network = getattr(torchvision.models, model)(weights=None, num_classes=10)  # built once: the slow part
        for side, samples in ((shared, 2), (alone, 1)):
            assert trains(network, side, samples), (model, side, samples)
            assert side == 1 or not trains(network, side - 1, samples), (model, side - 1, samples)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module", ["drbalance.runs.train", "drbalance.runs.train_ddp"])
@pytest.mark.parametrize("option, message", [
    (("--seed", "99999999999999999999999"), "argument --seed: must be an integer within -2**63..2**63-1; "
                                            "got 99999999999999999999999"),
    (("--threads", "100000"), f"argument --threads: must be at most {os.cpu_count()} (this machine's CPUs); "
                              f"got 100000"),
])
def test_a_seed_or_thread_count_torch_cannot_take_is_a_usage_error_not_a_traceback(ipc_env, module, option, message):
    # not "ValueError: Overflow when unpacking long long" from torch.manual_seed nor
    # "MemoryError: Not enough memory" from torch.set_num_threads, both tracebacks
    code, _out, err = run(module, "--model", "alexnet", "--devices", "cpu", "--epochs", "1", "--iterations", "1",
                          "--solo-time", "10", "--no-progress", *option, env=_one_rank_env())
    assert code == 2 and "Traceback" not in err and f"error: {message}" in err, err


@pytest.mark.timeout(120)
def test_the_training_script_refuses_gpus_it_would_not_use_instead_of_ignoring_them(ipc_env):
    # '--devices cpu --gpus 0,1' must not train on the CPU without a word about --gpus
    code, _out, err = run("drbalance.runs.train", "--model", "alexnet", "--devices", "cpu", "--epochs", "1",
                          "--iterations", "1", "--solo-time", "10", "--no-progress", "--gpus", "0,1")
    assert code == 2 and "Traceback" not in err, err
    assert ("drbalance.runs.train: error: --gpus 0,1 chooses CUDA GPUs, but this job trains on the cpu; "
            "leave --gpus out or use --devices cuda") in err, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("gpus, message", [
    ("0,5", r"--gpus 0,5: device 5 does not exist \(2 CUDA GPUs: 0\.\.1\)"),
    ("-1", r"--gpus -1: device -1 does not exist \(2 CUDA GPUs: 0\.\.1\)"),
    ("", r"--gpus takes comma-separated integers, e.g. 0,1; got ''"),
])
def test_the_training_script_refuses_a_cuda_gpu_that_does_not_exist_before_moving_the_model(monkeypatch, gpus,
                                                                                            message):
    # checked before network.cuda(gpus[0]) runs (else an "invalid device ordinal" traceback), and
    # '--gpus ""' does not mean every GPU without a word
    from drbalance.runs import train

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = train.build_parser().parse_args(["--model", "alexnet", f"--gpus={gpus}"])
    with pytest.raises(ValueError, match=message):
        train.build_model(args, 10, "cuda", None)


def _no_start(*_args, **_kwargs):
    raise AssertionError("a process was started")


def _scenario_file(tmp_path, apps: list[dict]) -> str:
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps({"name": "checked", "gpus": 2, "apps": apps}))
    return str(path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("apps, image_size, message", [
    ([{"name": "a1", "model": "alexnet", "batch": 32, "epochs": 1, "iterations_per_epoch": 2}], "32",
     "argument --image-size: app 'a1' trains alexnet, on images of at least 63 pixels a side; got 32"),
    ([{"name": "r1", "model": "resnet50", "batch": 32, "epochs": 1, "iterations_per_epoch": 2, "ddp": True}], "16",
     "argument --image-size: app 'r1' trains resnet50 as a DDP job, whose ranks may hold one sample each, on "
     "images of at least 33 pixels a side; got 16"),
    ([{"name": "d1", "model": "dense", "batch": 32, "epochs": 1, "iterations_per_epoch": 2}], "64",
     "app 'd1': model 'dense' is not one the training scripts train (densenet121, resnet50, alexnet, "
     "resnext50_32x4d, shufflenet_v2_x1_0, mnasnet1_0); write 'densenet121' for 'dense'"),
])
def test_launch_refuses_a_model_or_image_size_its_jobs_would_refuse_before_anything_starts(
        tmp_path, monkeypatch, capsys, apps, image_size, message):
    # checked before the manager and any job start (else each job would exit 2 with one line in its .out
    # file); 'dense' (a short name the simulator takes) likewise
    from drbalance.runs import launch

    monkeypatch.setattr(launch.subprocess, "Popen", _no_start)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as stopped:
        cli.main(["launch", _scenario_file(tmp_path, apps), "--devices", "emulated", "--run-dir", str(run_dir),
                  "--image-size", image_size])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.startswith("usage: "), err
    assert err.strip().splitlines()[-1] == f"drbalance launch: error: {message}", err
    assert not run_dir.exists()


@pytest.mark.timeout(60)
def test_launch_takes_an_image_size_that_only_one_sample_chunks_could_not_train_on(tmp_path, monkeypatch):
    # a DataParallel job of --real-batch 4 has no chunk of one sample: resnet50 trains on 16 pixels there
    from drbalance.runs import launch

    checked = []
    monkeypatch.setattr(launch, "launch", lambda options: checked.append(options) or options.run_dir)
    monkeypatch.setattr("drbalance.report.command.summarise_runs", lambda _runs: "")
    apps = [{"name": "r1", "model": "resnet50", "batch": 32, "epochs": 1, "iterations_per_epoch": 2}]
    assert cli.main(["launch", _scenario_file(tmp_path, apps), "--devices", "emulated", "--run-dir",
                     str(tmp_path / "run"), "--image-size", "16"]) == 0
    assert [options.image_size for options in checked] == [16]


@pytest.mark.timeout(60)
def test_the_launch_function_refuses_an_image_size_before_anything_starts(tmp_path, monkeypatch):
    from drbalance.runs import launch

    monkeypatch.setattr(launch.subprocess, "Popen", _no_start)
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match=r"app 'alex1' trains alexnet, on images of at least 63 pixels a side; "
                                         r"got 32"):
        launch.launch(launch.LaunchOptions(load_scenario("e2e-a"), "fair", run_dir, "emulated", image_size=32))
    assert not run_dir.exists()


def test_ctrl_c_ends_a_command_with_one_line_and_130(monkeypatch, capsys):
    """It ended with exit status 130 and not a word (a launch then left a run folder that holds a
    partial run, with nothing said)."""
    import drbalance.sim.command

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(drbalance.sim.command, "run", interrupted)
    assert cli.main(["simulate", "e2e-a"]) == 130
    assert capsys.readouterr().err.strip() == "drbalance simulate: interrupted"


def test_a_run_directory_that_is_a_file_is_named_as_such(tmp_path, capsys):
    """It was "[Errno 20] Not a directory: '<file>/apps'"."""
    taken = tmp_path / "taken"
    taken.write_text("mine\n")
    assert cli.main(["launch", "e2e-a", "--run-dir", str(taken)]) == 1
    assert f"run directory {taken} exists and is not a folder" in capsys.readouterr().err
    assert taken.read_text() == "mine\n"


def test_a_slurm_jobs_app_name_is_its_job_name_and_id(monkeypatch):
    from drbalance import env

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert env.slurm_app_name() is None
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    monkeypatch.setenv("SLURM_JOB_NAME", "train resnet.sh")
    assert env.slurm_app_name() == "train_resnet.sh-4711"
    monkeypatch.setenv("SLURM_JOB_NAME", "-" + "x" * 80)  # too long, and a first character an app name refuses
    name = env.slurm_app_name()
    assert name.endswith("-4711") and len(name) == 48 and name[0] == "x"
    monkeypatch.setenv("SLURM_JOB_ID", "4711; rm -rf")  # not a job id: not a Slurm job
    assert env.slurm_app_name() is None
