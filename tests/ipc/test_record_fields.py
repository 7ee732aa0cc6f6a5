"""What a record carries beyond SD and DR, and the constraints every decision respects."""

import json
import os
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from drbalance import DataRatio
from drbalance.client import BalancedDataParallel, Session
from drbalance.client.timing import ReplicaTiming
from drbalance.ipc import objects
from drbalance.ipc.records import AppRecord
from drbalance.manager.table import AppTable
from drbalance.policy import AppView, PolicyConfig, violations
from drbalance.slowdown import SlotWindow


def test_process_start_ticks_tells_processes_apart():
    mine = objects.process_start_ticks(os.getpid())
    assert mine is not None and mine > 0
    assert objects.process_start_ticks(os.getpid()) == mine  # stable for one process
    assert objects.process_start_ticks(1) != mine  # init started long before this test
    assert objects.process_start_ticks(-3) is None
    assert objects.process_start_ticks(2 ** 22 + 12345) is None  # beyond pid_max: no such process


def test_slot_window_averages_per_slot_and_keeps_the_last_window_until_replaced():
    window = SlotWindow(3)
    assert window.means() == [None, None, None]
    window.add([ReplicaTiming(0, "cpu", 4, 0.2), ReplicaTiming(2, "cpu", 12, 0.6)])
    window.add([ReplicaTiming(0, "cpu", 6, 0.4), ReplicaTiming(7, "cpu", 5, 1.0), ReplicaTiming(1, "cpu", 0, 0.1)])
    assert window.means()[0] == pytest.approx((0.3, 5.0))
    assert window.means()[1] is None  # an empty chunk is no measurement; slot 7 does not exist
    window.new_window()
    assert window.means()[2] == pytest.approx((0.6, 12.0))  # the last window's mean stands
    assert window.means()[0] == pytest.approx((0.3, 5.0))
    window.add([ReplicaTiming(2, "cpu", 10, 0.3)])
    assert window.means()[2] == pytest.approx((0.3, 10.0))
    assert window.means()[0] is None  # the new window (a new DR) has no chunk on slot 0


def test_a_session_publishes_start_time_batch_and_per_slot_timings(ipc_env):
    model = BalancedDataParallel(nn.Linear(8, 2), device_ids=[0, 1, 2, 3], ratio=[5, 3, 2, 0])
    session = Session(model, app="v2", epochs=2, iterations_per_epoch=20, solo_time=1.0, sd_log=False)
    try:
        record = AppRecord.open(ipc_env, "v2")
        for _ in range(10):
            model(torch.randn(20, 8)).sum().backward()
            session.step()
        status = record.read_status()
        assert status.start_ticks == objects.process_start_ticks(os.getpid())
        assert status.batch == 20
        assert [slot.chunk_samples for slot in status.slots] == [10.0, 6.0, 4.0, 0.0]
        assert all(slot.chunk_seconds is not None and slot.chunk_seconds >= 0 for slot in status.slots[:3])
        assert status.slots[3].chunk_seconds is None  # no replica there
        table = AppTable(ipc_env)
        view = table.admit("v2", 0.0).view(dr_total=20)
        assert view.batch == 20 and view.chunk_samples == (10.0, 6.0, 4.0, 0.0)
        table.remove("v2", unlink=False)
        record.close()
    finally:
        session.close()


def view(**fields):
    return AppView("a", fields.pop("ratio", DataRatio([5, 5, 0, 0])), 1.2, **fields)


def test_violations_name_every_broken_constraint():
    config = PolicyConfig(4)
    assert violations(view(), DataRatio([0, 0, 3, 7]), config) == []
    ddp = view(allowed=(0, 1), min_share=1)
    assert violations(ddp, DataRatio([9, 1, 0, 0]), config) == []
    assert "cannot use" in violations(ddp, DataRatio([5, 4, 1, 0]), config)[0]
    assert "below the app's minimum 1" in violations(ddp, DataRatio([10, 0, 0, 0]), config)[0]
    capped = view(max_share=(None, 4, None, 0))
    assert violations(capped, DataRatio([6, 4, 0, 0]), config) == []
    assert "exceeds its memory cap 4" in violations(capped, DataRatio([5, 5, 0, 0]), config)[0]
    assert "memory cap 0" in violations(capped, DataRatio([9, 0, 0, 1]), config)[0]
    assert "for a server of 4 GPUs" in violations(view(), DataRatio([10]), config)[0]


def test_a_view_rejects_measurements_of_the_wrong_length():
    with pytest.raises(ValueError, match="chunk_seconds has 2 entries for 4 GPUs"):
        view(chunk_seconds=(0.1, 0.2))
    with pytest.raises(ValueError, match="allowed GPUs"):
        view(allowed=(0, 4))


class GreedyPolicy:
    """A policy that ignores constraints: everything on the last GPU."""

    name = "greedy"

    def decide(self, app, trigger, snapshot):
        from drbalance.policy import Decision

        return Decision(app, DataRatio.single(snapshot.config.gpu_count, snapshot.config.gpu_count - 1), "greedy")


def test_the_daemon_never_sends_a_dr_that_breaks_the_apps_constraints(ipc_env, tmp_path):
    from drbalance.ipc.layout import Notice, NoticeKind
    from drbalance.manager.daemon import Manager, ManagerSettings
    from drbalance.manager.utilization import ScriptedSource

    script = tmp_path / "util.json"
    script.write_text('{"gpus": 4, "steps": [{"at": 0, "util": [50, 50, 50, 50]}]}')
    model = BalancedDataParallel(nn.Linear(4, 1), device_ids=[0, 1, 2, 3], ratio=[5, 5, 0, 0])
    manager = Manager(ManagerSettings(namespace=ipc_env.namespace, log_path=tmp_path / "m.jsonl"),
                      ScriptedSource(script), policy=GreedyPolicy())
    manager.start()
    session = Session(model, app="ddp", epochs=1, iterations_per_epoch=50, solo_time=1.0, sd_log=False,
                      exchange_timeout=0.0)
    try:
        session.min_share = 2  # as a DDP job publishes: every GPU keeps at least 2 of 10
        session.link.publish(session._status(session.clock.monotonic()))
        manager.handle(Notice(NoticeKind.BOUNDARY, os.getpid(), 7, "ddp", 0.0))
        command = session.link.poll_command(7)
        assert command is not None and command.branch == "policy-error"
        assert command.ratio == DataRatio([5, 5, 0, 0])  # kept, not the greedy [0, 0, 0, 10]
    finally:
        session.close()
        manager.stop()


class SwapPolicy:
    """Gives the deciding app GPU 3 and pushes GPU 0 to the other app."""

    name = "swap"

    def decide(self, app, trigger, snapshot):
        from types import MappingProxyType

        from drbalance.policy import Decision

        others = [view.name for view in snapshot.apps if view.name != app]
        if not others:
            return Decision(app, snapshot.app(app).ratio, "alone")
        pushed = MappingProxyType({others[0]: DataRatio([10, 0, 0, 0])})
        return Decision(app, DataRatio([0, 0, 0, 10]), "swap", others=pushed)


@contextmanager
def two_registered_apps(ipc_env, tmp_path, policy, model_class=BalancedDataParallel, **session_options):
    """A manager with ``policy`` and apps "a" then "b" (DR [0, 5, 5, 0], models of ``model_class``),
    both registered with it."""
    from drbalance.ipc.layout import Notice, NoticeKind
    from drbalance.manager.daemon import Manager, ManagerSettings
    from drbalance.manager.utilization import ScriptedSource

    script = tmp_path / "util.json"
    script.write_text('{"gpus": 4, "steps": [{"at": 0, "util": [50, 50, 50, 50]}]}')
    manager = Manager(ManagerSettings(namespace=ipc_env.namespace, log_path=tmp_path / "m.jsonl"),
                      ScriptedSource(script), policy=policy)
    manager.start()
    models = {name: model_class(nn.Linear(4, 1), device_ids=[0, 1, 2, 3], ratio=[0, 5, 5, 0])
              for name in ("a", "b")}
    sessions = {name: Session(model, app=name, epochs=1, iterations_per_epoch=100, solo_time=1.0, sd_log=False,
                              exchange_timeout=0.0, **session_options) for name, model in models.items()}
    try:
        for name in ("a", "b"):
            manager.handle(Notice(NoticeKind.REGISTER, os.getpid(), sessions[name].notice_seq, name, 0.0))
        yield manager, models, sessions
    finally:
        for session in sessions.values():
            session.close()
        manager.stop()


def train(model, session, iterations=1):
    for _ in range(iterations):
        model(torch.randn(4, 4)).sum().backward()
        session.step()


def test_a_joint_decision_pushes_the_other_apps_dr_which_it_applies_after_its_next_iteration(ipc_env, tmp_path):
    with two_registered_apps(ipc_env, tmp_path, SwapPolicy(), report_every=5) as (_, models, sessions):
        # a alone kept its DR; b's decision moved b and pushed a
        sessions["b"]._apply(sessions["b"].link.poll_command(sessions["b"].notice_seq), 0.0)
        assert models["b"].ratio == DataRatio([0, 0, 0, 10])
        # a sent no notice for this change; its signal tells its next step, which is not a report
        model_a, session_a = models["a"], sessions["a"]
        assert model_a.ratio == DataRatio([0, 5, 5, 0])
        train(model_a, session_a)
        assert session_a.tracker.done % session_a.report_every != 0
        assert model_a.ratio == DataRatio([10, 0, 0, 0])
        applied = session_a._last_push
        model_a.set_ratio(DataRatio([0, 5, 5, 0]))  # the command stays in the record: never applied twice
        train(model_a, session_a, session_a.report_every)
        assert model_a.ratio == DataRatio([0, 5, 5, 0]) and session_a._last_push == applied
    events = [line for line in (tmp_path / "m.jsonl").read_text().splitlines() if '"event":"push"' in line]
    assert len(events) == 1 and '"app":"a"' in events[0]


class PushThenAnswer:
    """b's boundary pushes [10, 0, 0, 0] to a; a's boundary gives a [0, 0, 0, 10] and a 7 s cadence."""

    name = "push-then-answer"

    def decide(self, app, trigger, snapshot):
        from types import MappingProxyType

        from drbalance.policy import Decision

        view = snapshot.app(app)
        if trigger != "boundary":
            return Decision(app, view.ratio, "keep")
        if app == "b":
            return Decision(app, view.ratio, "swap", others=MappingProxyType({"a": DataRatio([10, 0, 0, 0])}))
        return Decision(app, DataRatio([0, 0, 0, 10]), "mine", next_boundary=7.0)


def test_a_push_that_reaches_an_exchange_first_is_applied_once_and_the_answer_still_follows(ipc_env, tmp_path):
    from drbalance.ipc.layout import Notice, NoticeKind

    with two_registered_apps(ipc_env, tmp_path, PushThenAnswer(), report_every=50,
                             decide_every=10) as (manager, models, sessions):
        a, model_a = sessions["a"], models["a"]
        train(model_a, a)
        waiting = a.link.await_command

        def b_decides_first(generation, timeout):  # b's notice is handled after a published its own
            manager.handle(Notice(NoticeKind.BOUNDARY, os.getpid(), sessions["b"].notice_seq, "b", 0.0))
            return waiting(generation, timeout)

        a.link.await_command = b_decides_first
        train(model_a, a, 9)  # iteration 10: a's boundary exchange reads b's push, stamped with a's new notice
        a.link.await_command = waiting
        assert model_a.ratio == DataRatio([10, 0, 0, 0]) and a._awaiting == a.notice_seq
        model_a.set_ratio(DataRatio([0, 5, 5, 0]))  # e.g. an out-of-memory revert
        train(model_a, a)
        assert model_a.ratio == DataRatio([0, 5, 5, 0])  # the push is not applied a second time
        manager.handle(Notice(NoticeKind.BOUNDARY, os.getpid(), a.notice_seq, "a", 0.0))  # the answer, late
        train(model_a, a)  # not a report, not a boundary: the signal brings it
        assert model_a.ratio == DataRatio([0, 0, 0, 10]) and a._cadence == 7.0 and a._awaiting is None


class BadPushes:
    """b's decision pushes a list (not a DR) to a, and a DR to b itself: a buggy joint decision."""

    name = "bad-pushes"

    def decide(self, app, trigger, snapshot):
        from types import MappingProxyType

        from drbalance.policy import Decision

        if app != "b":
            return Decision(app, snapshot.app(app).ratio, "keep")
        pushed = MappingProxyType({"a": [10, 0, 0, 0], "b": DataRatio([10, 0, 0, 0])})
        return Decision(app, DataRatio([0, 0, 0, 10]), "swap", others=pushed)


def test_a_malformed_push_or_one_to_the_deciding_app_is_refused_and_logged_the_answer_stands(ipc_env, tmp_path):
    with two_registered_apps(ipc_env, tmp_path, BadPushes(), report_every=5) as (manager, models, sessions):
        session_b = sessions["b"]
        command = session_b.link.poll_command(session_b.notice_seq)
        assert command is not None and command.ratio == DataRatio([0, 0, 0, 10]) and not command.pushed
        assert manager.table.get("a").assigned == DataRatio([0, 5, 5, 0])  # its own answer; nothing pushed
    pushes = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines() if '"event":"push"' in line]
    assert {push["app"] for push in pushes} == {"a", "b"} and all("refused" in push for push in pushes), pushes
    assert "not a DataRatio" in next(p for p in pushes if p["app"] == "a")["refused"]
    assert "deciding app itself" in next(p for p in pushes if p["app"] == "b")["refused"]


class NoGpuZero(BalancedDataParallel):
    """A job that refuses any share of GPU 0, as a DDP rank refuses a DR below its minimum share."""

    def set_ratio(self, ratio):
        if DataRatio(ratio)[0] > 0:
            raise ValueError("GPU 0 is not this job's")
        super().set_ratio(ratio)


def test_a_refused_dr_is_published_at_once_so_the_manager_stops_taking_it_as_current(ipc_env, tmp_path):
    with two_registered_apps(ipc_env, tmp_path, SwapPolicy(), NoGpuZero,
                             report_every=50) as (manager, models, sessions):
        entry = manager.table.get("a")
        assert entry.effective_ratio() == DataRatio([10, 0, 0, 0])  # pushed with b's decision, taken as a's DR
        train(models["a"], sessions["a"])  # not a report: the signal brings the push, which a refuses
        assert models["a"].ratio == DataRatio([0, 5, 5, 0])
        manager._refresh_all(manager.clock.monotonic())
        # at once, not at a's next report 49 iterations later: until then decisions for other apps
        # would count a on GPU 0
        assert entry.effective_ratio() == DataRatio([0, 5, 5, 0])


class PushThenKeep:
    """b's boundary pushes [10, 0, 0, 0] to a; a's own decisions keep the DR a publishes."""

    name = "push-then-keep"

    def decide(self, app, trigger, snapshot):
        from types import MappingProxyType

        from drbalance.policy import Decision

        view = snapshot.app(app)
        if app == "b" and trigger == "boundary":
            return Decision(app, view.ratio, "swap", others=MappingProxyType({"a": DataRatio([10, 0, 0, 0])}))
        return Decision(app, view.ratio, "keep")


def test_a_push_that_arrives_during_the_boundary_iteration_is_applied_before_the_exchange(ipc_env, tmp_path):
    from drbalance.ipc.layout import Notice, NoticeKind

    with two_registered_apps(ipc_env, tmp_path, PushThenKeep(), report_every=50,
                             decide_every=10) as (manager, models, sessions):
        a, model_a = sessions["a"], models["a"]
        train(model_a, a, 9)
        manager.handle(Notice(NoticeKind.BOUNDARY, os.getpid(), sessions["b"].notice_seq, "b", 0.0))
        waiting = a.link.await_command

        def manager_answers(generation, timeout):  # the daemon handles a's boundary notice
            manager.handle(Notice(NoticeKind.BOUNDARY, os.getpid(), generation, "a", 0.0))
            return waiting(generation, timeout)

        a.link.await_command = manager_answers
        train(model_a, a)  # iteration 10: a boundary; the push reached the record during it
        a.link.await_command = waiting
        # the push wins over the answer ([0, 5, 5, 0]), which would leave b's swap half-done
        assert model_a.ratio == DataRatio([10, 0, 0, 0])
        assert manager.table.get("a").effective_ratio() == DataRatio([10, 0, 0, 0])


class KeepPolicy:
    """Keeps every app's DR."""

    name = "keep"

    def decide(self, app, trigger, snapshot):
        from drbalance.policy import Decision

        return Decision(app, snapshot.app(app).ratio, "keep")


class ToLastGpu:
    """Moves the deciding app whole onto the last GPU."""

    name = "to-last"

    def decide(self, app, trigger, snapshot):
        from drbalance.policy import Decision

        return Decision(app, DataRatio.single(snapshot.config.gpu_count, snapshot.config.gpu_count - 1), "to-last")


def test_a_restarted_manager_takes_the_dr_its_predecessor_sent_not_the_older_one_in_the_record(ipc_env, tmp_path):
    """A job publishes its DR at its next report, not when it applies an answer. A manager restarted
    in between adopts the job with the DR its predecessor sent, not the older one of its record:
    otherwise, until the job's next report (longer while it is quiet: an evaluation, a checkpoint),
    its status and every decision would place the job where it no longer is."""
    import json

    from drbalance.ipc.layout import Notice, NoticeKind
    from drbalance.manager.daemon import Manager, ManagerSettings
    from drbalance.manager.utilization import ScriptedSource

    script = tmp_path / "util.json"
    script.write_text('{"gpus": 4, "steps": [{"at": 0, "util": [50, 50, 50, 50]}]}')

    def manager(policy):
        made = Manager(ManagerSettings(namespace=ipc_env.namespace, log_path=tmp_path / "m.jsonl"),
                       ScriptedSource(script), policy=policy)
        made.start()
        return made

    first = manager(ToLastGpu())
    model = BalancedDataParallel(nn.Linear(4, 1), device_ids=[0, 1, 2, 3], ratio=[0, 5, 5, 0])
    session = Session(model, app="a", epochs=1, iterations_per_epoch=100, solo_time=1.0, sd_log=False,
                      exchange_timeout=0.0)
    second = None
    try:
        first.handle(Notice(NoticeKind.REGISTER, os.getpid(), session.notice_seq, "a", 0.0))
        session._accept(session.link.poll_command(session.notice_seq), session.clock.monotonic())
        assert model.ratio == DataRatio([0, 0, 0, 10])  # applied; published at the next report
        first.request_stop("restart")
        first.stop()
        second = manager(KeepPolicy())  # adopts the job at start-up
        entry = second.table.get("a")
        assert entry is not None and entry.effective_ratio() == DataRatio([0, 0, 0, 10])
        second._write_status(second.clock.monotonic())
        assert json.loads(ipc_env.manager_status().read_text())["apps"][0]["dr"] == [0, 0, 0, 10]
    finally:
        session.close()
        if second is not None:
            second.stop()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_job_takes_no_dr_at_another_total_and_the_manager_decides_at_its_own(ipc_env, tmp_path):
    """A job takes a command only at its manager's total (or one that keeps the DR it has), and
    the manager decides at its own total whatever a record says. A pushed [7, 0, 0, 0]/7, written
    into a job's record by another process of the user, must not be applied, or the manager would
    decide at total 7 for good, never returning to its --dr-total 10."""
    import dataclasses
    import signal
    import time

    from drbalance.ipc import discovery
    from drbalance.ipc.endpoint import AppChannel
    from drbalance.ipc.layout import AppCommand, Notice, NoticeKind
    from drbalance.jsonlog import read_json_lines
    from tests.conftest import wait_for
    from tests.helpers.processes import ManagerProcess, decisions_for, first_line, long_app, stop_all

    manager = ManagerProcess(tmp_path, ipc_env, (50, 50, 50, 50), "--policy", "observe")  # a DR is always kept
    job = long_app("victim")
    try:
        assert first_line(job)["attached"]
        wait_for(lambda: decisions_for(manager, "victim") >= 2)
        os.kill(job.pid, signal.SIGSTOP)  # what it reads next is what is written now
        try:
            time.sleep(0.5)  # an answer under way lands first
            channel = AppChannel(ipc_env, "victim")
            status = channel.read_status()
            forged = DataRatio([7, 0, 0, 0], total=7)
            channel.record.write_status(dataclasses.replace(status, ratio=forged, updated_wall=time.time(),
                                                            updated_mono=time.monotonic()))  # a record at total 7
            inbox = objects.open_queue(ipc_env.inbox(discovery.read_manager(ipc_env).inbox))
            inbox.send(Notice(NoticeKind.BOUNDARY, job.pid, status.notice_seq + 1000, "victim", time.time()).encode())
            inbox.close()
            forged_decision = wait_for(lambda: [e for e in manager.events("decision")
                                                if e["generation"] == status.notice_seq + 1000])[0]
            # then a push at total 7, as the job's next step reads it (after that decision's answer)
            channel.answer(AppCommand(discovery.read_manager(ipc_env).pid, status.notice_seq, forged, "forged",
                                      time.time(), pushed=True))
            channel.close()
        finally:
            os.kill(job.pid, signal.SIGCONT)
        served = decisions_for(manager, "victim")
        wait_for(lambda: decisions_for(manager, "victim") >= served + 3)  # the job's own boundaries go on
    finally:
        code, err = stop_all(manager, job)
    assert code == 0 and "Traceback" not in err, err
    assert forged_decision["dr_total"] == 10 and forged_decision["old_dr"] == [10, 0, 0, 0], forged_decision
    assert {e["dr_total"] for e in manager.events("decision")} == {10}
    sd_log = list(read_json_lines(tmp_path / "logs" / "victim.sd.jsonl"))
    assert {e["dr_total"] for e in sd_log} == {4}  # its own [1, 1, 1, 1]/4, kept by the observing manager
    assert not [e for e in sd_log if e["event"] == "update"]  # nothing applied
    assert "ignored a command for DR [7, 0, 0, 0]/7" in job.stderr.read()
