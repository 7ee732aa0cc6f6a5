"""JsonLinesWriter's buffering: a line count and, where asked, an age bound."""


import pytest

from drbalance import jsonlog
from drbalance.jsonlog import JsonLinesWriter
from tests.helpers.clock import MonotonicClock


def _lines(path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("flush_seconds", [None, 2.0])
def test_buffered_lines_wait_for_the_count_or_for_flush_seconds(tmp_path, monkeypatch, flush_seconds):
    clock = MonotonicClock()
    monkeypatch.setattr(jsonlog, "time", clock)
    path = tmp_path / "job.sd.jsonl"
    writer = JsonLinesWriter(path, flush_every=64, flush_seconds=flush_seconds)
    writer.write({"event": "report", "iteration": 1})
    clock.now += 1.9
    writer.write({"event": "report", "iteration": 2})
    assert _lines(path) == 0  # younger than both bounds
    clock.now += 0.2  # 2.1 s since the writer opened
    writer.write({"event": "report", "iteration": 3})
    assert _lines(path) == (0 if flush_seconds is None else 3)
    clock.now += 1.0
    writer.write({"event": "report", "iteration": 4})
    assert _lines(path) == (0 if flush_seconds is None else 3)  # 1 s since that flush
    for iteration in range(5, 68):
        writer.write({"event": "report", "iteration": iteration})
    assert _lines(path) == (64 if flush_seconds is None else 3 + 64)  # the count bound holds either way
    writer.close()
    assert _lines(path) == 67


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_flush_seconds_must_be_finite_and_not_negative(tmp_path, bad):
    with pytest.raises(ValueError, match="flush_seconds"):
        JsonLinesWriter(tmp_path / "x.jsonl", flush_seconds=bad)
