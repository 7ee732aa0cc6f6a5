"""The manager's estimate of a job's solo iteration: the predictor's (``Predictor.solo_estimate``),
what the job does with it (``chosen_solo``), and how the record and command carry it."""

from __future__ import annotations

import math

import pytest

from drbalance.ipc.layout import (
    FLAG_SD_BOUND,
    FLAG_SOLO_ESTIMATED,
    FLAG_SOLO_MANAGER,
    AppCommand,
    AppState,
    AppStatus,
    RecordError,
)
from drbalance.manager.status import sd_notes, sd_text
from drbalance.policy import AppView
from drbalance.policy.fair import FairPolicy
from drbalance.policy.predictor import Predictor
from drbalance.ratio import DataRatio
from drbalance.solo_estimate import ALONE, MANAGER, SHARED, SoloEstimate, chosen_solo

ITERATIONS = 10_000
KAPPA = 0.5  # every pair's true stretch per unit of the other's duty
HOST = {"a": 0.02, "d": 0.03, "c": 0.04, "e": 0.02}
WORK = {"a": 0.10, "d": 0.08, "c": 0.12, "e": 0.09}  # full-batch device seconds alone (phi: one chunk per GPU)
PAIRS = {0: ("a", "d"), 1: ("c", "e")}  # GPU -> the two apps alone together there


def truth() -> dict[str, tuple[float, float]]:
    """Per app (chunk seconds, iteration seconds) at the fixed point of the predictor's own model
    (c_i = w_i (1 + kappa d_j), d_j = c_j / T_j): what a window of each app measures."""
    chunk = dict(WORK)
    for _ in range(200):
        for first, second in PAIRS.values():
            for me, other in ((first, second), (second, first)):
                duty = chunk[other] / (HOST[other] + chunk[other])
                chunk[me] = WORK[me] * (1.0 + KAPPA * duty)
    return {name: (chunk[name], HOST[name] + chunk[name]) for name in WORK}


def views(iteration: int, basis: dict[str, str | None]) -> list[AppView]:
    found = truth()
    result = []
    for gpu, pair in PAIRS.items():
        for name in pair:
            chunk, seconds = found[name]
            ratio = DataRatio.single(2, gpu, 10)
            solo = (HOST[name] + WORK[name]) * ITERATIONS if basis.get(name) is None else seconds * ITERATIONS
            result.append(AppView(name, ratio, 1.5, iteration=iteration, iterations_total=ITERATIONS,
                                  iteration_time=seconds, solo_time=solo, batch=32,
                                  chunk_seconds=tuple(chunk if g == gpu else None for g in range(2)),
                                  chunk_samples=tuple(32.0 if g == gpu else 0.0 for g in range(2)),
                                  solo_basis=basis.get(name)))
    return result


def test_the_manager_takes_out_of_a_shared_jobs_time_what_it_learned_slows_others():
    """``c`` shares its GPU with ``e`` from the start and publishes its own estimate: an upper bound
    (its measured, stretched iteration). ``a``, ``d`` and ``e`` know their solo times, so their
    chunks teach the predictor the pairs' kappas; ``c``'s do not (its work is a guess). The
    manager's estimate of ``c`` takes ``e``'s duty times the kappa learned from the others out of
    ``c``'s chunk: its true solo iteration, where ``c``'s own bound is 20% off."""
    predictor = Predictor(2)
    shared = {"c": SHARED}
    for step in range(1, 60):
        predictor.observe(views(20 * step, shared))
    true_solo = HOST["c"] + WORK["c"]
    own_bound = truth()["c"][1]
    assert own_bound > 1.2 * true_solo  # the job's own bound misses by more than 20%
    assert predictor.solo_estimate("c") == pytest.approx(true_solo, rel=0.02)
    assert ("c", "e") not in predictor.kappa[False] and ("e", "c") in predictor.kappa[False]
    assert predictor.kappa[False][("a", "d")] == pytest.approx(KAPPA, rel=0.05)
    assert predictor.solo_estimate("a") == pytest.approx(HOST["a"] + WORK["a"], rel=0.02)
    assert predictor.solo_estimate("nobody") is None


def test_fair_answers_with_its_predictors_estimate_and_none_before_a_window():
    policy = FairPolicy()
    assert policy.solo_estimate("c") is None
    predictor = policy.predictor = Predictor(2)
    for step in range(1, 60):
        predictor.observe(views(20 * step, {"c": MANAGER}))  # an app that took the manager's estimate learns none
    assert ("c", "e") not in predictor.kappa[False]
    assert policy.solo_estimate("c") == pytest.approx(HOST["c"] + WORK["c"], rel=0.02)


@pytest.mark.parametrize(("own", "manager", "expected"), [
    (SoloEstimate(1.0, 0.2, 0.8, ALONE), 2.0, (1.0, ALONE)),  # its own, from a GPU it had alone: best
    (SoloEstimate(3.0, 0.2, 2.8, SHARED), 2.0, (2.0, MANAGER)),  # shared GPUs only: the manager's
    (SoloEstimate(3.0, 0.2, 2.8, SHARED), None, (3.0, SHARED)),  # no manager's yet: its own bound
    (None, 2.0, (2.0, MANAGER)),
    (None, None, None),
    (SoloEstimate(3.0, 0.2, 2.8, SHARED), 0.0, (3.0, SHARED)),
])
def test_a_job_takes_the_managers_estimate_only_where_it_had_no_gpu_alone(own, manager, expected):
    assert chosen_solo(own, manager) == expected


def status(**solo) -> AppStatus:
    return AppStatus(pid=1, app="a", state=AppState.RUNNING, ratio=DataRatio([10]), epoch=0, epochs=1,
                     iteration=3, iterations_total=10, iterations_per_epoch=10, notice_seq=1, slowdown=1.5,
                     iteration_time=0.2, solo_time=2.0, start_wall=1.0, updated_wall=2.0, updated_mono=3.0, **solo)


@pytest.mark.parametrize("basis", ["alone", "shared", "manager"])
def test_the_record_says_whose_estimate_the_sd_uses(basis):
    sent = status(solo_estimated=True, solo_basis=basis)
    got = AppStatus.decode(sent.encode(), "test")
    assert got == sent and got.sd_bound == (basis == "shared")  # the job's own bound: the SD is a lower bound
    assert AppStatus.decode(status().encode(), "test").solo_basis is None


def test_a_basis_without_an_estimate_or_two_bases_are_refused():
    with pytest.raises(ValueError, match="solo_basis"):
        status(solo_estimated=True)
    with pytest.raises(ValueError, match="solo_basis"):
        status(solo_basis="manager")
    good = bytearray(status(solo_estimated=True, solo_basis="alone").encode())
    flags_at = 4 + 48 + 1  # pid, name, state
    for flags in (FLAG_SD_BOUND, FLAG_SOLO_ESTIMATED | FLAG_SD_BOUND | FLAG_SOLO_MANAGER):
        good[flags_at] = flags
        with pytest.raises(RecordError, match="basis"):
            AppStatus.decode(bytes(good), "test")


def test_the_command_carries_the_managers_estimate():
    command = AppCommand(7, 3, DataRatio([10, 0]), "move", 1.0, 2.0, solo_iteration=0.25)
    assert AppCommand.decode(command.encode(), "test") == command
    none = AppCommand(7, 3, DataRatio([10, 0]), "move", 1.0)
    assert AppCommand.decode(none.encode(), "test").solo_iteration is None
    for bad in (-1.0, math.nan, math.inf):
        raw = AppCommand(7, 3, DataRatio([10, 0]), "move", 1.0, solo_iteration=bad).encode()
        with pytest.raises(RecordError, match="solo iteration"):
            AppCommand.decode(raw, "test")


def test_the_status_table_marks_the_managers_estimate_apart_from_the_jobs_own():
    apps = [{"sd": 1.5, "sd_estimated": True, "solo_basis": "manager"},
            {"sd": 1.25, "sd_estimated": True, "solo_basis": "shared"}, {"sd": 1.0, "sd_estimated": False}]
    assert [sd_text(app) for app in apps] == ["*1.50", "~1.25", "1.00"]
    notes = sd_notes(apps)
    assert len(notes) == 2 and notes[0].startswith("~") and notes[1].startswith("*")
    assert sd_notes(apps[2:]) == []
