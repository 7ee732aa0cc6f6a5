"""The report's numbers cover the run, from its start (``run.json``'s ``started``) to the
makespan (found by a review, 2026-11-24)."""

from __future__ import annotations

import pytest

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
