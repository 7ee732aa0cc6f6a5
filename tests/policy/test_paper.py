"""The paper's policy on hand-written snapshots: every branch and every edge case of docs/policy.md."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drbalance import DataRatio
from drbalance.policy import POLICIES, AppView, PolicyConfig, Snapshot, make_policy
from drbalance.policy.paper import PaperPolicy, average_sd_per_gpu

PAPER = PaperPolicy()


def app(name, shares, sd, total=10):
    return AppView(name, DataRatio(shares, total), sd)


def snapshot(apps, util, **config):
    return Snapshot(tuple(apps), tuple(util), PolicyConfig(gpu_count=len(util), **config))


def crowd(*extra):
    """Five background apps on a 4-GPU server (so the exclusive mode is off)."""
    return [app("b1", [0, 10, 0, 0], 1.2), app("b2", [0, 0, 10, 0], 1.1), app("b3", [0, 0, 0, 10], 1.3),
            app("b4", [0, 10, 0, 0], 1.25), *extra]


def test_the_papers_worked_example_of_dr_update_util():
    # DR_i = [5, 5, 0, 0]; GPU2 is GPU_min; remaining utilisation of GPU0..2 = 10%, 20%, 80%.
    decision = PAPER.decide("i", "boundary", snapshot(crowd(app("i", [5, 5, 0, 0], 2.0)), [90, 80, 20, 50]))
    assert decision.branch == "util"
    assert decision.ratio == DataRatio([1, 2, 7, 0])
    assert decision.details["gpu_max"] == 0 and decision.details["gpu_min"] == 2


def test_exclusive_mode_gives_the_least_used_free_gpu_and_keeps_a_settled_app():
    apps = [app("a", [10, 0, 0, 0], None), app("b", [0, 10, 0, 0], None), app("new", [3, 3, 2, 2], None)]
    decision = PAPER.decide("new", "register", snapshot(apps, [95, 90, 40, 10]))
    assert (decision.branch, decision.ratio) == ("exclusive", DataRatio([0, 0, 0, 10]))
    # an app already alone on a GPU nobody else uses stays there (no ping-pong as utilisation moves)
    settled = PAPER.decide("a", "boundary", snapshot(apps[:2] + [app("new", [0, 0, 0, 10], 1.0)], [95, 90, 5, 99]))
    assert (settled.branch, settled.ratio) == ("exclusive-keep", DataRatio([10, 0, 0, 0]))


def test_exclusive_mode_releases_a_gpu_when_its_app_leaves():
    apps = [app(n, DataRatio.single(4, g).shares, 1.0) for n, g in (("a", 0), ("b", 1), ("c", 2), ("d", 3))]
    newcomer = app("e", [10, 0, 0, 0], None)
    # 5 apps on 4 GPUs: not exclusive
    assert PAPER.decide("e", "register", snapshot(apps + [newcomer], [50] * 4)).branch == "no-sd"
    # "c" finished: its GPU 2 is free again, and the newcomer (sharing GPU 0 with "a") moves there
    without_c = [a for a in apps if a.name != "c"] + [newcomer]
    decision = PAPER.decide("e", "boundary", snapshot(without_c, [90, 60, 0, 70]))
    assert (decision.branch, decision.ratio) == ("exclusive", DataRatio([0, 0, 10, 0]))


def test_exclusive_mode_when_every_gpu_is_taken_picks_the_least_shared_then_least_used():
    apps = [app("a", [5, 5, 0, 0], 1.0), app("b", [0, 5, 5, 0], 1.0), app("c", [0, 0, 0, 10], 1.0)]
    decision = PAPER.decide("c", "boundary", snapshot(apps, [30, 90, 20, 99]))
    # "c" is alone on GPU 3: keep
    assert decision.branch == "exclusive-keep"
    decision = PAPER.decide("a", "boundary", snapshot(apps, [30, 90, 20, 99]))
    # others occupy GPU1 (b), GPU2 (b), GPU3 (c): GPU 0 is free of others
    assert decision.ratio == DataRatio([10, 0, 0, 0])


@pytest.mark.parametrize(
    ("me", "branch"),
    [
        (app("i", [0, 0, 5, 5], 1.2), "not-max"),  # SD_i is not the maximum
        (app("i", [0, 0, 5, 5], 1.35), "below-threshold"),  # max, but the spread 0.25 < SD_th 0.3
        (app("i", [0, 0, 5, 5], None), "no-sd"),  # registered before its first window ended
    ],
)
def test_keep_branches(me, branch):
    decision = PAPER.decide("i", "boundary", snapshot(crowd(me), [50, 50, 50, 50], sd_threshold=0.3))
    assert decision.branch == branch and decision.ratio == me.ratio


def test_sd_branch_computes_r_from_e_mbr():
    # SD_i = 2.0 (max), SD_min = 1.1 -> midpoint 1.55. src = GPU0 (share 6). E_mbr = (2 - 1) / 6.
    # r = (2.0 - 1.55) / (1 / 6) = 2.7 -> 3 units move. dest = the GPU whose apps suffer least:
    # GPU2 (b2 alone, SD 1.1); utilisation gap 10 <= Util_th, so the SD branch runs.
    me = app("i", [6, 4, 0, 0], 2.0)
    decision = PAPER.decide("i", "boundary", snapshot(crowd(me), [60, 55, 50, 58]))
    assert decision.branch == "sd"
    assert decision.details["src"] == 0 and decision.details["dest"] == 2
    assert decision.details["e_mbr"] == pytest.approx(1 / 6)
    assert decision.details["r_exact"] == pytest.approx(2.7)
    assert decision.ratio == DataRatio([3, 4, 3, 0])


def test_sd_branch_prefers_an_idle_gpu_and_never_picks_the_source():
    apps = [app("b1", [0, 10, 0, 0], 1.2), app("b2", [0, 0, 10, 0], 1.1), app("b3", [0, 10, 0, 0], 1.3),
            app("b4", [0, 0, 10, 0], 1.25), app("i", [10, 0, 0, 0], 1.9)]
    decision = PAPER.decide("i", "boundary", snapshot(apps, [50, 55, 45, 40]))
    # GPU3 has no apps (average SD counts as 0): the best destination; GPU0 is the source
    assert decision.details["dest"] == 3 and decision.details["src"] == 0
    assert average_sd_per_gpu(snapshot(apps, [50, 55, 45, 40]))[3] == 0.0


def test_sd_branch_moving_everything_still_leaves_the_app_on_a_gpu():
    # DR of total 1 on GPU3 (rescaled to [0, 0, 0, 10]); SD_i 1.5, SD_min 0.1: midpoint 0.8,
    # E_mbr = 0.5 / 10 = 0.05, r = 0.7 / 0.05 = 14 -> clamped to the 10 units the source holds.
    apps = [app("b1", [0, 10, 0, 0], 0.1), app("b2", [0, 0, 10, 0], 0.2), app("b3", [0, 10, 0, 0], 0.15),
            app("b4", [10, 0, 0, 0], 0.12), app("i", [0, 0, 0, 1], 1.5, total=1)]
    decision = PAPER.decide("i", "boundary", snapshot(apps, [50, 55, 45, 40]))
    assert decision.branch == "sd" and decision.details["r_exact"] == pytest.approx(14)
    assert decision.details["r"] == 10
    assert decision.ratio.total == 10 and len(decision.ratio.used) == 1 and decision.ratio[3] == 0


@pytest.mark.parametrize(
    ("sd", "branch"), [(1.0, "sd-not-slowed"), (0.7, "sd-not-slowed")]
)
def test_e_mbr_not_positive_moves_nothing(sd, branch):
    apps = [app("b1", [0, 10, 0, 0], 0.3), app("b2", [0, 0, 10, 0], 0.2), app("b3", [0, 10, 0, 0], 0.25),
            app("b4", [0, 0, 10, 0], 0.4), app("i", [10, 0, 0, 0], sd)]
    decision = PAPER.decide("i", "boundary", snapshot(apps, [50, 50, 50, 50]))
    assert decision.branch == branch and decision.ratio == DataRatio([10, 0, 0, 0])


def test_a_tiny_move_rounds_to_zero_and_keeps():
    me = app("i", [10, 0, 0, 0], 1.32)  # E_mbr = 0.032; (1.32 - 1.21) / 0.032 = 3.4 -> moves 3
    assert PAPER.decide("i", "boundary", snapshot(crowd(me), [50] * 4)).details["r"] == 3
    me = app("i", [10, 0, 0, 0], 5.0)  # huge SD, but the spread to the midpoint is tiny relative to E_mbr
    apps = [app("b", [0, 10, 0, 0], 4.99), app("c", [0, 0, 10, 0], 4.9), app("d", [0, 0, 0, 10], 4.95),
            app("e", [0, 10, 0, 0], 4.97), me]
    decision = PAPER.decide("i", "boundary", snapshot(apps, [50] * 4, sd_threshold=0.05))
    assert decision.branch == "sd-zero-move" and decision.ratio == me.ratio


def test_ties_are_broken_deterministically():
    # two apps share the maximum SD: each is treated as the maximum
    apps = crowd(app("i", [5, 5, 0, 0], 2.0), app("j", [0, 0, 5, 5], 2.0))
    assert PAPER.decide("i", "boundary", snapshot(apps, [50] * 4)).branch == "sd"
    assert PAPER.decide("j", "boundary", snapshot(apps, [50] * 4)).branch == "sd"
    # equal shares on the source: the busier GPU is the source; equal everything: the lower index
    decision = PAPER.decide("i", "boundary", snapshot(apps, [50, 60, 50, 50]))
    assert decision.details["src"] == 1
    decision = PAPER.decide("i", "boundary", snapshot(apps, [50, 50, 50, 50]))
    assert decision.details["src"] == 0


def test_util_branch_rounding_sums_to_the_total_and_saturated_gpus_split_evenly():
    me = app("i", [4, 3, 3, 0], 2.0)
    decision = PAPER.decide("i", "boundary", snapshot(crowd(me), [67, 67, 67, 33]))
    # remaining 33/33/33/67 -> 10 * (0.1988, 0.1988, 0.1988, 0.4036): largest remainder sums to 10
    assert decision.branch == "util" and sum(decision.ratio) == 10
    assert decision.ratio == DataRatio([2, 2, 2, 4])
    decision = PAPER.decide("i", "boundary", snapshot(crowd(me), [100, 100, 100, 70]))
    assert decision.branch == "util" and decision.ratio == DataRatio([0, 0, 0, 10])


def test_no_move_while_some_app_has_not_measured_its_sd_yet():
    apps = crowd(app("i", [6, 4, 0, 0], 2.0), app("new", [0, 0, 5, 5], None))
    decision = PAPER.decide("i", "boundary", snapshot(apps, [90, 80, 20, 50]))
    assert decision.branch == "incomplete-sd" and decision.details["waiting_for"] == ["new"]
    assert decision.ratio == DataRatio([6, 4, 0, 0])


def test_missing_utilisation_falls_back_to_the_sd_branch_and_bad_drs_are_left_alone():
    me = app("i", [6, 4, 0, 0], 2.0)
    decision = PAPER.decide("i", "boundary", snapshot(crowd(me), [None, 10, 90, None]))
    assert decision.branch == "sd" and decision.details["util_gap"] is None
    odd = app("i", [5, 5], 2.0)  # a DR for 2 GPUs on a 4-GPU server
    decision = PAPER.decide("i", "boundary", snapshot(crowd(odd), [50] * 4))
    assert decision.branch == "bad-dr" and decision.ratio == odd.ratio


def test_a_single_gpu_server_has_nowhere_to_move():
    apps = [app("a", [10], 1.1), app("i", [10], 2.0)]
    decision = PAPER.decide("i", "boundary", snapshot(apps, [80]))
    assert decision.branch == "sd-no-destination"


def test_the_registry_is_read_only_and_names_are_checked():
    assert set(POLICIES) >= {"paper", "observe"}
    with pytest.raises(TypeError):
        POLICIES["mine"] = PaperPolicy  # type: ignore[index]
    with pytest.raises(ValueError, match="unknown policy 'nope'; known policies: fair, f-sched, paper, observe"):
        make_policy("nope")
    observe = make_policy("observe")
    decision = observe.decide("i", "boundary", snapshot(crowd(app("i", [5, 5, 0, 0], 9.0)), [0, 100, 0, 0]))
    assert decision.ratio == DataRatio([5, 5, 0, 0]) and decision.branch == "observe"


def test_bad_snapshots_raise():
    with pytest.raises(ValueError, match="3 utilisation readings for 4 GPUs"):
        Snapshot((), (1.0, 2.0, 3.0), PolicyConfig(4))
    with pytest.raises(ValueError, match="utilisation of GPU 1 is nan"):
        Snapshot((), (1.0, float("nan")), PolicyConfig(2))
    with pytest.raises(ValueError, match="slowdown must be finite"):
        app("x", [10], float("inf"))
    with pytest.raises(ValueError, match="util_threshold"):
        PolicyConfig(2, util_threshold=120)


@st.composite
def random_snapshots(draw):
    gpus = draw(st.integers(1, 6))
    count = draw(st.integers(1, 9))
    apps = []
    for index in range(count):
        weights = draw(st.lists(st.integers(0, 5), min_size=gpus, max_size=gpus).filter(any))
        sd = draw(st.one_of(st.none(), st.floats(0.0, 6.0)))
        apps.append(AppView(f"a{index}", DataRatio.from_weights(weights), sd))
    util = draw(st.lists(st.one_of(st.none(), st.floats(0, 100)), min_size=gpus, max_size=gpus))
    config = PolicyConfig(gpus, sd_threshold=draw(st.floats(0, 1)), util_threshold=draw(st.floats(0, 100)))
    return Snapshot(tuple(apps), tuple(util), config), draw(st.integers(0, count - 1))


@settings(max_examples=300)
@given(random_snapshots())
def test_every_decision_is_a_valid_dr_on_at_least_one_gpu(case):
    snap, index = case
    decision = PAPER.decide(f"a{index}", "boundary", snap)
    assert len(decision.ratio) == snap.config.gpu_count
    assert sum(decision.ratio) == snap.config.dr_total and decision.ratio.used
    assert decision.branch in {"exclusive", "exclusive-keep", "no-sd", "incomplete-sd", "not-max",
                               "below-threshold", "util",
                               "sd", "sd-no-destination", "sd-not-slowed", "sd-zero-move"}


def test_keep_branches_return_the_apps_own_dr_exactly_whatever_its_total():
    me = app("i", [1, 1, 1, 1], None, total=4)  # an exactly even split, not expressible in tenths
    for apps in (crowd(me), [me]):
        decision = PAPER.decide("i", "register", snapshot(apps, [50] * 4))
        assert decision.ratio == DataRatio([1, 1, 1, 1], 4) or decision.branch == "exclusive"
    assert PAPER.decide("i", "register", snapshot(crowd(me), [50] * 4)).ratio.total == 4


def test_a_gpu_whose_apps_have_no_sd_yet_is_not_mistaken_for_an_empty_one():
    apps = [app("b1", [10, 0, 0, 0], 1.2), app("b2", [0, 10, 0, 0], 1.1), app("b3", [0, 0, 10, 0], None),
            app("b4", [10, 0, 0, 0], 1.3), app("i", [0, 10, 0, 0], 2.0)]
    averages = average_sd_per_gpu(snapshot(apps, [50, 55, 45, 40]))
    assert averages[3] == 0.0  # nobody on GPU 3
    assert averages[2] == pytest.approx((1.2 + 1.1 + 1.3 + 2.0) / 4)  # b3 unmeasured: neutral, not 0
