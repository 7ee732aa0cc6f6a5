"""SD by Eq. 2, against values computed by hand."""

import pytest
import torch
from torch import nn

from drbalance.client import BalancedDataParallel
from drbalance.client.session import Session
from drbalance.ipc.link import DetachedLink
from drbalance.slowdown import IterationPlan, SlowdownTracker
from tests.helpers.clock import ManualClock


def test_eq2_by_hand():
    # 2 epochs x 4 iterations, solo-run time 8 s, started at t = 100 s.
    tracker = SlowdownTracker(IterationPlan(2, 4), solo_time=8.0, start=100.0)
    assert tracker.slowdown(100.0) is None  # no iteration time known yet
    tracker.iteration_finished(103.0)  # warm-up: 3 s, not averaged
    assert tracker.mean_iteration_time is None
    tracker.iteration_finished(104.0)  # 1 s
    tracker.iteration_finished(106.0)  # 2 s
    # mean of the window = 1.5 s; at t = 106: elapsed 6 s, 5 iterations left -> (6 + 7.5) / 8
    assert tracker.slowdown(106.0) == pytest.approx((6 + 5 * 1.5) / 8)
    # between iterations the elapsed time keeps growing with the same prediction
    assert tracker.slowdown(106.5) == pytest.approx((6.5 + 5 * 1.5) / 8)
    tracker.iteration_finished(107.0)  # 1 s -> mean (1 + 2 + 1) / 3
    assert tracker.epoch == 1 and tracker.iterations_left == 4
    assert tracker.slowdown(107.0) == pytest.approx((7 + 4 * 4 / 3) / 8)


def test_time_left_uncounted_counts_in_neither_iteration_times_nor_the_sd():
    """Emulated GPUs leave a job's waits for a CPU core out of its SD: the tracker's run time is
    the clock's less what its ``uncounted`` source added since the start."""
    uncounted = [5.0]  # seconds already uncounted before the run: not the run's
    tracker = SlowdownTracker(IterationPlan(1, 4), solo_time=4.0, start=100.0, uncounted=lambda: uncounted[0])
    tracker.iteration_finished(101.0)  # warm-up
    uncounted[0] = 5.5  # half a second of this iteration waited for a core
    assert tracker.iteration_finished(103.0) == pytest.approx(1.5)
    assert tracker.uncounted_seconds == pytest.approx(0.5)
    assert tracker.run_time(103.0) == pytest.approx(102.5)
    # elapsed 2.5 s of run time, 2 iterations left at 1.5 s -> (2.5 + 3) / 4
    assert tracker.slowdown(103.0) == pytest.approx((2.5 + 2 * 1.5) / 4)
    tracker.iteration_finished(104.0)
    uncounted[0] = 6.0
    tracker.iteration_finished(106.0)  # 2 s, of which 0.5 s uncounted
    assert tracker.finished and tracker.slowdown(200.0) == pytest.approx((106.0 - 1.0 - 100.0) / 4)
    plain = SlowdownTracker(IterationPlan(1, 4), solo_time=4.0, start=100.0)
    assert plain.uncounted_seconds == 0.0 and plain.run_time(103.0) == 103.0


def test_what_is_said_about_a_step_uses_the_time_left_out_up_to_that_step():
    """A session reports and logs about the moment its step began (``now``), some time later (after
    waiting for the manager's answer, which an emulated job leaves out as it goes). Read then, the
    seconds left out meanwhile made that moment's run time too short: SDs at boundaries dipped
    (0.58 where the job read 1.01 before and after). The reading taken when the step ended stands
    for that moment; a later moment reads afresh."""
    uncounted = [0.0]
    tracker = SlowdownTracker(IterationPlan(1, 10), solo_time=10.0, start=0.0, uncounted=lambda: uncounted[0])
    tracker.iteration_finished(1.0)
    tracker.iteration_finished(2.0)  # 1 s
    uncounted[0] = 0.5  # left out while the session waited for its manager, after the step at 2.0
    assert tracker.run_time(2.0) == 2.0 and tracker.uncounted_at(2.0) == 0.0
    assert tracker.slowdown(2.0) == pytest.approx((2.0 + 8 * 1.0) / 10)
    assert tracker.run_time(2.6) == pytest.approx(2.1)  # a later moment: what is left out by then


def test_a_new_window_after_a_boundary_uses_the_last_mean_until_it_has_its_own():
    tracker = SlowdownTracker(IterationPlan(2, 3), solo_time=6.0, start=0.0)
    for now in (1.0, 3.0, 5.0):  # warm-up 1 s, then 2 s, 2 s
        tracker.iteration_finished(now)
    sd_at_boundary = tracker.slowdown(5.0)
    assert sd_at_boundary == pytest.approx((5 + 3 * 2.0) / 6)
    tracker.new_window()  # a DR change at the boundary: the old DR's times no longer count
    assert tracker.slowdown(5.0) == pytest.approx(sd_at_boundary)
    tracker.iteration_finished(5.5)  # the new DR: 0.5 s per iteration
    assert tracker.mean_iteration_time == pytest.approx(0.5)
    assert tracker.slowdown(5.5) == pytest.approx((5.5 + 2 * 0.5) / 6)


def test_finished_run_reports_actual_time_over_solo_time():
    tracker = SlowdownTracker(IterationPlan(1, 2), solo_time=4.0, start=10.0)
    tracker.iteration_finished(12.0)
    tracker.iteration_finished(16.0)
    assert tracker.finished
    assert tracker.slowdown(99.0) == pytest.approx(6.0 / 4.0)
    with pytest.raises(RuntimeError, match="all are done"):
        tracker.iteration_finished(17.0)


@pytest.mark.parametrize(
    ("plan", "solo", "message"),
    [((0, 5), 1.0, "epochs must be a positive integer"), ((2, 5), 0.0, "solo-run time"),
     ((2, 5), float("nan"), "solo-run time"), ((2, 5), float("inf"), "solo-run time")],
)
def test_bad_plans_and_solo_times(plan, solo, message):
    with pytest.raises(ValueError, match=message):
        SlowdownTracker(IterationPlan(*plan), solo, start=0.0)


def test_session_sd_across_a_dr_change_at_an_epoch_boundary(ipc_env):
    """The session computes Eq. 2 with a manual clock; the window restarts at the boundary."""

    class ScriptedLink(DetachedLink):
        """A link whose manager answers the first boundary with a new DR (no IPC: SD maths only)."""

        def __init__(self):
            self.published = []

        def manager(self):
            from drbalance.ipc.layout import ManagerBeat
            return ManagerBeat(1, 4, 10, 0.0, 0.0)

        def notify(self, notice, timeout):
            self.last = notice
            return True

        def publish(self, status):
            self.published.append(status)

        def await_command(self, generation, timeout):
            from drbalance import DataRatio
            from drbalance.ipc.layout import AppCommand, NoticeKind
            if self.last.kind == NoticeKind.BOUNDARY:
                return AppCommand(1, generation, DataRatio([0, 0, 0, 10]), "test", 0.0)
            return None

    clock = ManualClock(start=50.0)
    model = BalancedDataParallel(nn.Linear(2, 2), device_ids=[0, 1, 2, 3])
    link = ScriptedLink()
    session = Session(model, "sdapp", epochs=2, iterations_per_epoch=3, solo_time=10.0, clock=clock,
                      link=link, sd_log=False, handle_sigterm=False)
    for seconds in (4.0, 2.0, 2.0):  # epoch 1: warm-up 4 s, then 2 s and 2 s
        clock.advance(seconds)
        model(torch.ones(4, 2))
        session.step()
    boundary_status = [s for s in link.published if s.iteration == 3][0]
    assert boundary_status.slowdown == pytest.approx((8 + 3 * 2.0) / 10)
    assert model.ratio.shares == (0, 0, 0, 10)  # the manager's DR, used from the next forward
    clock.advance(1.0)  # epoch 2 under the new DR: 1 s per iteration
    session.step()
    assert session.slowdown == pytest.approx((9 + 2 * 1.0) / 10)
    session.close()
