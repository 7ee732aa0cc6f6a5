"""End to end on emulated GPUs: a real manager, real training processes, real IPC, twice.

``drbalance demo --policies observe,fair`` runs the scenario without balancing (observe) and
with drbalance's policy (fair). The scenario starts six jobs uncoordinated on a 4-GPU server (3 on
GPU 0, 2 on GPU 1, 1 on GPU 2, GPU 3 idle): a crowded start that balancing fixes by a wide margin,
so the comparison holds on a busy 2-core machine too. (From round-robin, where little is left to
fix, the difference between the two is within the noise of emulated runs: the demo shows it.)

Utilisation is checked where it is an outcome, not a measurement of the CPU's load: GPU 3 is idle
without balancing and must get work with it. The mean over all GPUs is not asserted: on emulated
GPUs a starved CPU (a loaded CI runner) caps how busy the device slots can be, and a run where
fair relieved the crowded GPUs measured the same mean as observe (36.2% both) while GPU 3 went
from 0% to 31%.
"""

import json
import statistics

import pytest

from drbalance.cli import main as drbalance
from drbalance.report.metrics import load_run, summarise


def _mean_utilisation_per_gpu(manager_log) -> list[float]:
    """Mean of the manager's utilisation samples per GPU, in percent (unknown readings skipped)."""
    samples = [json.loads(line) for line in manager_log.read_text().splitlines()]
    readings = [r["util"] for r in samples if r.get("event") == "util"]
    gpus = len(readings[0])
    return [statistics.fmean(x[g] for x in readings if isinstance(x[g], (int, float))) for g in range(gpus)]


@pytest.mark.slow
def test_balancing_lowers_the_final_spread_and_puts_the_idle_gpu_to_work(ipc_env, tmp_path, capsys):
    out = tmp_path / "demo"
    # every 2 iterations, not the demo's 4: from this crowded start fair must move jobs early
    # (in the simulator with 10% jitter its final spread is the lower one for 28 seeds in 30 at 2, 7 at 4)
    assert drbalance(["demo", "--scenario", "e2e-skewed", "--policies", "observe,fair", "--decide-every", "2",
                      "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "EMULATED" in printed and "SD_max^diff final" in printed
    without, with_ = (summarise(load_run(out / policy)) for policy in ("observe", "fair"))
    assert not without.unfinished and not with_.unfinished
    assert with_.final_sd_diff < without.final_sd_diff, (with_.final_sd_diff, without.final_sd_diff)
    idle_without, idle_with = (_mean_utilisation_per_gpu(out / p / "manager.jsonl")[3] for p in ("observe", "fair"))
    assert idle_with > idle_without + 5, (idle_with, idle_without)  # GPU 3 (idle at the start) got work
    records = [json.loads(line) for line in (out / "fair" / "manager.jsonl").read_text().splitlines()]
    decisions = [r for r in records if r["event"] == "decision"]
    branches = {d["branch"] for d in decisions}
    assert branches & {"move", "swap", "plan"}, branches  # fair moved jobs off the crowded GPUs
    assert "policy-error" not in branches, [d["details"] for d in decisions if d["branch"] == "policy-error"]
    assert all(d["next_boundary"] and d["next_boundary"] > 0 for d in decisions)  # fair sets the windows
    for name in ("sd_max_diff", "mean_sd", "mean_util", "summary"):
        assert (out / "report" / f"{name}.png").stat().st_size > 10_000
