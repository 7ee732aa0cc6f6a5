"""`drbalance report` reads a run's manager log together with its rotated predecessors."""

import json

import pytest

from drbalance.jsonlog import JsonLinesWriter
from drbalance.report.metrics import load_run


def _sd_log(path, start):
    records = [
        {"event": "start", "t": start, "app": "a", "solo_time": 10.0},
        {"event": "progress", "t": start + 5, "sd": 1.2, "epoch": 1},
        {"event": "end", "t": start + 10, "sd": 1.2},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.timeout(30)
def test_utilisation_samples_in_rotated_manager_logs_are_read_oldest_first(tmp_path):
    (tmp_path / "apps").mkdir()
    _sd_log(tmp_path / "apps" / "a.sd.jsonl", 100.0)
    writer = JsonLinesWriter(tmp_path / "manager.jsonl", max_bytes=300, keep=10)
    for second in range(40):
        writer.write({"event": "util", "t": 100.0 + second * 0.25, "util": [float(second), 0.0]})
    writer.close()
    assert (tmp_path / "manager.jsonl.1").exists()  # the log did rotate
    run = load_run(tmp_path)
    assert len(run.util_times) == 40  # nothing lost to rotation
    assert run.util_times == sorted(run.util_times)
    assert run.util_means[0] == 0.0 and run.util_means[-1] == 19.5
