"""The files a report writes (``report.md``, the PNG plots) are never written through a symbolic
link planted where they go: the default report folder (``<first run>/../report``) may lie in a
folder others can write, such as /tmp."""

from __future__ import annotations

import os

import pytest

from drbalance import cli

pytestmark = pytest.mark.timeout(120)


def test_report_files_replace_a_planted_symbolic_link_and_leave_its_target_alone(tmp_path, capsys):
    assert cli.main(["simulate", "e2e-a", "--policy", "observe", "--out", str(tmp_path / "runs")]) == 0
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("precious\n")
    report = tmp_path / "runs" / "report"  # the default --out of 'drbalance report runs/observe'
    report.mkdir()
    (report / "report.md").symlink_to(victim / "notes.txt")
    (report / "summary.png").symlink_to(victim / "plot.png")  # a file the link would create
    capsys.readouterr()
    assert cli.main(["report", str(tmp_path / "runs" / "observe")]) == 0
    assert (victim / "notes.txt").read_text() == "precious\n"
    assert sorted(os.listdir(victim)) == ["notes.txt"]
    for name in ("report.md", "summary.png", "mean_sd.png"):
        assert not (report / name).is_symlink() and (report / name).stat().st_size > 0, name
    assert (report / "report.md").read_text().startswith("```\n")
    assert (report / "summary.png").read_bytes().startswith(b"\x89PNG")


def test_a_full_disk_while_the_report_is_written_names_the_file_and_leaves_no_temporary_file(tmp_path, capsys):
    """The error says which of the five files, in which folder, not a bare '[Errno 27] File too
    large' (or '[Errno 28] No space left on device')."""
    import resource

    assert cli.main(["simulate", "e2e-a", "--policy", "observe", "--out", str(tmp_path / "runs")]) == 0
    out = tmp_path / "out"
    capsys.readouterr()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # no file may grow past 4 KiB: a plot does (EFBIG)
    try:
        code = cli.main(["report", str(tmp_path / "runs" / "observe"), "--out", str(out)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    err = capsys.readouterr().err
    assert code == 1 and "File too large" in err and str(out / "sd_max_diff.png") in err, err
    assert os.listdir(out) == []  # no temporary file left behind
