"""benchmarks.speed_drift: how far `fair`'s learned GPU speeds stray from the simulated GPUs' own."""

from __future__ import annotations

import pytest

from benchmarks.speed_drift import drift_of, main, run
from drbalance.workload.scenarios import Scenario, sized_app

pytestmark = pytest.mark.timeout(240)


def _two_alone(speeds: tuple[float, float] | None) -> Scenario:
    apps = (sized_app("r0", "resnet50", 32, 240.0, 2), sized_app("r1", "resnet50", 32, 240.0, 2))
    return Scenario("two-alone", 2, apps, "two ResNet-50s, one per GPU", gpu_speed=speeds)


def test_the_drift_is_measured_against_each_gpus_true_speed():
    # each app alone on its GPU: what its chunks show is the GPU's speed exactly
    same = drift_of(_two_alone(None), "calibrated", 0.05)
    assert same.decisions > 10 and same.largest < 0.02 and same.off == 0, same
    # a half-speed GPU 1 is taken to be of speed 1 (100% off) until r1's first window there
    # teaches it; then it is known as slow as it is (against 1.0 every decision would be 50% off)
    slow = drift_of(_two_alone((1.0, 0.5)), "calibrated", 0.05)
    assert slow.largest == pytest.approx(1.0), slow
    assert 0 < slow.off <= 0.05 * slow.decisions, slow


def test_a_mix_with_moves_counts_its_decisions_and_the_share_off_within_bounds():
    drift = run((174, "default", "calibrated", 0.05))  # 3 apps on 2 GPUs of one speed
    assert drift.seed == 174 and "3 apps on 2 GPUs" in drift.description
    assert drift.decisions > 50 and 0 <= drift.off <= drift.decisions
    assert 0.0 <= drift.share_off <= 1.0 and drift.largest >= 0.0


@pytest.mark.parametrize("argv", [["--seeds", "5:5"], ["--tolerance", "0"], ["--tolerance", "2"],
                                  ["--draw", "nope"], ["--workers", "0"]])
def test_bad_arguments_are_refused_with_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    assert "error" in capsys.readouterr().err


def test_main_prints_a_row_per_seed_and_the_median(capsys):
    assert main(["--seeds", "174:176", "--workers", "1"]) == 0
    printed = capsys.readouterr().out
    assert "| 174 |" in printed and "| 175 |" in printed
    assert "median share of decisions with a GPU off" in printed and "over 2 runs" in printed
