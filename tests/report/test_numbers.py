"""The report's numbers cover the run, from its start (``run.json``'s ``started``) to the
makespan."""

from __future__ import annotations

import json

import pytest

from drbalance import cli
from drbalance.report.metrics import run_from_records, summarise

pytestmark = pytest.mark.timeout(30)


def test_mean_utilisation_leaves_out_the_samples_logged_while_the_apps_set_up():
    started = 1000.0  # 'drbalance launch' starts the manager, then the apps set up for 20 s
    apps = {"a": [{"t": started, "event": "start"}, {"t": started + 10, "event": "report", "sd": 1.5},
                  {"t": started + 20, "event": "finish", "sd": 1.5}]}
    setup = [{"t": started - 20 + s, "event": "util", "util": [0.0, 0.0]} for s in range(20)]  # idle GPUs
    running = [{"t": started + s, "event": "util", "util": [80.0, 60.0]} for s in range(21)]
    summary = summarise(run_from_records("r", apps, setup + running, {"started": started}))
    assert summary.makespan == pytest.approx(20.0)
    assert summary.mean_util == pytest.approx(70.0)


def _write_run(root, apps: dict[str, list], manager: list) -> None:
    """A run directory of JSON Lines logs; a line given as a str is written as it is."""
    (root / "apps").mkdir(parents=True)
    (root / "run.json").write_text(json.dumps({"started": 1000.0, "label": "r"}))
    for name, lines in {**{f"apps/{app}.sd.jsonl": lines for app, lines in apps.items()},
                        "manager.jsonl": manager}.items():
        (root / name).write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n"
                                         for line in lines))


def _app(sds: list[float], finish: float, bad: list | tuple = ()) -> list:
    """An app's SD log: its start, ``bad`` lines, one report a second from 1 s on, its finish."""
    return [{"t": 1000.0, "event": "start"}, *bad,
            *({"t": 1001.0 + index, "event": "report", "sd": sd} for index, sd in enumerate(sds)),
            {"t": 1000.0 + finish, "event": "finish", "sd": sds[-1]}]


def test_records_with_fields_of_the_wrong_kind_are_skipped_and_counted_never_a_traceback(tmp_path, capsys, caplog):
    """Skipped and counted: an event that is not text (else a TypeError traceback), a JSON line
    nested thousands deep (else a RecursionError aborts the whole report), a negative SD (else
    shown as an app's final SD), a huge SD or utilisation (else an OverflowError traceback)."""
    bad = [
        {"t": 1000.5, "event": ["report"], "sd": 1.0},  # not text
        {"t": 1000.6, "event": {"x": 1}},
        "[" * 100_000 + "]" * 100_000,  # valid JSON, too deep to decode
        {"t": 1000.7, "event": "report", "sd": -5.0},  # an SD is a ratio of times: never negative
    ]
    huge = 1e308  # finite, but two of them overflow a mean
    manager = [{"t": 1000.0 + s, "event": "util", "util": [80.0, 60.0]} for s in range(11)]
    manager += [{"t": 1002.0, "event": "util", "util": [huge, huge]},  # a percentage above 100
                {"t": 1003.0, "event": "util", "util": [-1.0, 50.0]},
                {"t": 1003.5, "event": "decision", "sd": {"a": 1.2}, "util": [50.0, 60.0]}]  # fine as it is
    apps = {"a": _app([1.0, huge, 1.2, 1.4], 10, bad), "b": _app([1.0, huge, 1.1, 1.3], 10)}
    _write_run(tmp_path / "run", apps, manager)
    assert cli.main(["report", str(tmp_path / "run"), "--no-plots", "--json"]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    (summary,) = json.loads(captured.out)
    assert summary["final_sd"] == {"a": pytest.approx(1.4), "b": pytest.approx(1.3)}
    assert summary["final_sd_diff"] == pytest.approx(0.1)
    assert summary["mean_sd"] == pytest.approx(huge / 10, rel=0.01)  # 1 s of the 10 with SDs at 1e308
    assert summary["mean_util"] == pytest.approx((70.0 * 11 + 50.0) / 12)  # only the valid samples
    log = tmp_path / "run" / "apps" / "a.sd.jsonl"
    assert f"{log}: skipped 2 record(s) without a numeric time 't' or a text 'event'" in caplog.text
    assert f"{log}: ignored 1 value(s) out of range ('sd' must be a number >= 0)" in caplog.text
    assert "manager.jsonl: ignored 3 value(s) out of range ('util' samples must be percentages" in caplog.text
    assert caplog.text.count("manager.jsonl: ignored") == 1  # a decision's 'sd' (every app's) is not an SD value


def test_an_app_of_the_run_without_sd_records_is_named_and_no_makespan_is_claimed(tmp_path, capsys, caplog):
    """A job that exited before its first SD line (a missing profile: 'drbalance launch' on CUDA
    GPUs; a full disk) has no SD log, or an empty one. It is named, not left out without a word,
    and no makespan or final spread is shown as if the run had only the other apps."""
    run_dir = tmp_path / "run"
    _write_run(run_dir, {"a": _app([1.2, 1.4], 10), "b": _app([1.1, 1.3], 12), "d": []}, [])
    info = {"started": 1000.0, "label": "r", "apps": {name: {"returncode": 0} for name in ("a", "b", "c", "d")}}
    info["apps"]["c"]["returncode"] = 2  # it never wrote its SD log
    (run_dir / "run.json").write_text(json.dumps(info))
    assert cli.main(["report", str(run_dir), "--no-plots", "--json"]) == 0
    (summary,) = json.loads(capsys.readouterr().out)
    assert summary["makespan"] is None and summary["no_records"] == ["c", "d"]
    assert summary["final_sd"] == {"a": pytest.approx(1.4), "b": pytest.approx(1.3), "c": None, "d": None}
    assert summary["final_sd_diff"] == pytest.approx(0.1)  # of the apps that have SDs
    assert "apps c, d of the run have no SD records" in caplog.text
    assert cli.main(["report", str(run_dir), "--no-plots"]) == 0
    table = capsys.readouterr().out
    assert "no SD records (in no number): r: c, d" in table and "final SD c" in table


def test_a_long_runs_logs_are_read_in_a_fraction_of_their_size_in_memory(tmp_path):
    """A run of days has up to 384 MiB of manager log (6 files of 64 MiB, most of it decisions) and
    tens of MB of SD log per app: the report kept every record whole, 4.8 GB of memory for 520 MB
    of logs of a 96-hour run. It keeps only what it uses: the utilisation samples of the manager's
    log and the time, event and SD of each SD log record."""
    import tracemalloc

    from drbalance.report.metrics import load_run

    decision = {"event": "decision", "app": "a1", "trigger": "boundary", "generation": 5, "branch": "sd",
                "old_dr": [3, 3, 2, 2], "new_dr": [3, 3, 3, 1], "dr_total": 10,
                "sd": {f"a{i}": 1.2345678 for i in range(6)}, "dr": {f"a{i}": [3, 3, 2, 2] for i in range(6)},
                "util": [55.1, 66.2, 77.3, 88.4], "details": {"gain": 0.01234, "partners": ["a1", "a2"]}}
    report = {"event": "report", "sd": 1.5, "app": "a", "pid": 1, "epoch": 1, "iteration": 5,
              "iterations_total": 100, "iter_time": 0.1, "dr": [3, 3, 2, 2], "dr_total": 10}
    _write_run(tmp_path, {"a": [{"t": 1000.0, "event": "start"},
                                *({"t": 1000.0 + s, "elapsed": float(s), **report} for s in range(1, 10_000))]},
               [line for s in range(10_000) for line in ({"t": 1000.0 + s, "event": "util", "util": [50.0, 70.0]},
                                                          {"t": 1000.0 + s, **decision})])
    size = sum(path.stat().st_size for path in tmp_path.rglob("*.jsonl"))
    tracemalloc.start()
    try:
        run = load_run(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(run.util_means) == 10_000 and len(run.apps["a"].sds) == 9_999
    assert peak < 1.5 * size, f"{peak / 1e6:.1f} MB of memory to read {size / 1e6:.1f} MB of logs"


def test_an_unfinished_apps_final_sd_is_the_one_its_closed_record_gives(tmp_path):
    # a job stopped before its finish (SIGTERM, --timeout) writes its SD once more in its 'closed' record,
    # its last word; the report takes that, not the report before it, as the final SD
    apps = {"a": [{"t": 1000.0, "event": "start"}, {"t": 1001.0, "event": "report", "sd": 1.2},
                  {"t": 1002.0, "event": "report", "sd": 1.3}, {"t": 1003.0, "event": "closed", "sd": 1.5}],
            "b": _app([1.0, 1.1], 3)}
    _write_run(tmp_path / "run", apps, [])
    from drbalance.report.metrics import load_run

    run = load_run(tmp_path / "run")
    summary = summarise(run)
    assert summary.final_sd == {"a": 1.5, "b": 1.1}
    assert summary.unfinished == ["a"] and summary.makespan is None
    assert run.apps["a"].end == pytest.approx(3.0) and run.apps["a"].sd_at(3.0) == 1.5


def test_a_wall_clock_step_back_leaves_an_apps_sd_times_in_the_order_the_session_measured_them(tmp_path):
    # records are timed by the wall clock ('t'); after it steps back (NTP, a hand-set clock), SD times taken
    # from it would be out of order and 'SD at t' (a bisection) would read the wrong records
    stepped = -100.0  # the wall clock jumps back 100 s between the second and third report
    lines = [(0.0, "start", None), (1.0, "report", 1.0), (2.0, "report", 2.0), (3.0, "report", 3.0),
             (4.0, "finish", 3.5), (4.5, "closed", 3.5)]
    records = [{"t": 1000.0 + elapsed + (stepped if elapsed > 2.5 else 0.0), "elapsed": elapsed, "event": event,
                "sd": sd} for elapsed, event, sd in lines]
    _write_run(tmp_path / "run", {"a": records, "b": _app([1.0, 1.0, 1.0, 1.0], 5)}, [])
    from drbalance.report.metrics import load_run

    run = load_run(tmp_path / "run")
    app = run.apps["a"]
    assert app.times == sorted(app.times) and app.times == pytest.approx([1.0, 2.0, 3.0, 4.0, 4.5])
    assert app.end == pytest.approx(4.0) and app.finished
    assert [app.sd_at(t) for t in (0.5, 1.5, 2.5, 3.5, 10.0)] == [None, 1.0, 2.0, 3.0, 3.5]
    summary = summarise(run)
    assert summary.makespan == pytest.approx(5.0) and summary.final_sd == {"a": 3.5, "b": 1.0}


def test_records_without_a_session_clock_are_ordered_by_time_and_the_last_one_gives_the_final_sd():
    # records that carry no 'elapsed' (the simulator's, hand-made ones) are sorted by 't'
    apps = {"a": [{"t": 1000.0, "event": "start"}, {"t": 1002.0, "event": "report", "sd": 2.0},
                  {"t": 1001.0, "event": "report", "sd": 1.0}, {"t": 1001.5, "event": "closed", "sd": 1.7}]}
    run = run_from_records("r", apps, [], {"started": 1000.0})
    app = run.apps["a"]
    assert app.times == pytest.approx([1.0, 1.5, 2.0]) and app.sds == [1.0, 1.7, 2.0]
    assert app.sd_at(1.2) == 1.0 and app.final_sd == 1.7 and app.end == pytest.approx(1.5)


def test_the_table_marks_a_final_sd_from_an_estimated_solo_time_and_says_whose(tmp_path):
    # a job given no solo time: its SD divides by its own estimate ("~") or, where it had no GPU
    # alone, by the manager's ("*"); the last record with an SD says which the final SD used
    from drbalance.report.command import format_table

    def records(basis):
        return [{"t": 1000.0, "event": "start"},
                {"t": 1001.0, "event": "report", "sd": 1.2, "solo_estimated": True, "solo_basis": "shared"},
                {"t": 1002.0, "event": "finish", "sd": 1.4, "solo_estimated": basis is not None,
                 "solo_basis": basis}]

    from drbalance.report.metrics import load_run

    _write_run(tmp_path / "run", {"own": records("alone"), "mgr": records("manager"), "given": records(None)}, [])
    summary = summarise(load_run(tmp_path / "run"))  # read from the run directory's logs, as the command does
    assert summary.solo_basis == {"mgr": "manager", "own": "alone"}
    table = format_table([summary])
    rows = {line.split()[2]: line.split()[-1] for line in table.splitlines() if line.startswith("final SD ")}
    assert rows == {"given": "1.400", "mgr": "*1.400", "own": "~1.400"}
    assert "* final SD from the manager's estimate" in table and "~ final SD from the job's own" in table
