"""End to end on emulated GPUs: a real manager, real training processes, real IPC, twice.

``drbalance demo`` runs the scenario without balancing (observe) and with it (paper). The
scenario starts six jobs uncoordinated on a 4-GPU server (3 on GPU 0, 2 on GPU 1, 1 on GPU 2,
GPU 3 idle); balancing must end with a smaller SD spread and a higher mean GPU utilisation.
"""

from drbalance.cli import main as drbalance
from drbalance.report.metrics import load_run, summarise


def test_balancing_lowers_the_final_spread_and_raises_utilisation(ipc_env, tmp_path, capsys):
    out = tmp_path / "demo"
    assert drbalance(["demo", "--scenario", "e2e-skewed", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "EMULATED" in printed and "SD_max^diff final" in printed
    without, with_ = (summarise(load_run(out / policy)) for policy in ("observe", "paper"))
    assert not without.unfinished and not with_.unfinished
    assert with_.final_sd_diff < without.final_sd_diff, (with_.final_sd_diff, without.final_sd_diff)
    assert with_.mean_util > without.mean_util, (with_.mean_util, without.mean_util)
    decisions = (out / "paper" / "manager.jsonl").read_text()
    assert '"branch":"exclusive"' in decisions and '"event":"decision"' in decisions
    for name in ("sd_max_diff", "mean_sd", "mean_util", "summary"):
        assert (out / "report" / f"{name}.png").stat().st_size > 10_000
