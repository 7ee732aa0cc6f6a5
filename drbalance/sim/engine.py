"""Discrete-event simulation of apps sharing GPUs, driving the manager's own policy code.

Time is virtual (seconds). Each app runs its iteration plan: host phase, then one chunk per GPU
of its DR, processor-shared with the other chunks on that GPU (``drbalance.sim.model``). SD is
computed by ``drbalance.slowdown.SlowdownTracker`` (the client's code), published every
``report_every`` iterations and at boundaries like the client's record; utilisation is sampled
and smoothed by ``UtilizationWindow`` (the manager's code); at each boundary the policy from
``drbalance.policy.POLICIES`` (the manager's registry) decides, from a ``Snapshot`` built exactly
as the daemon builds it. With ``scheduler="themis"`` apps are instead time-sliced on whole GPUs
in rounds, by finish-time fairness (see ``timeslice``).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from drbalance.manager.utilization import UtilizationWindow
from drbalance.models import ModelProfile, model_profile
from drbalance.policy import POLICIES, AppView, Policy, PolicyConfig, Snapshot
from drbalance.ratio import DataRatio
from drbalance.scenarios import AppSpec, Scenario
from drbalance.sim.model import ContentionModel
from drbalance.slowdown import IterationPlan, SlowdownTracker

ARRIVAL, HOST_END, GPU_DONE, SAMPLE, TICK, RESUME = range(6)


@dataclass(frozen=True)
class SimConfig:
    """How to simulate. Periods in seconds; thresholds as for the manager."""

    policy: str = "paper"
    placement: str | None = None  # override the scenario's initial placement
    sd_threshold: float = 0.1
    util_threshold: float = 20.0
    decide_every: int | None = None  # None: decide at epoch ends only
    report_every: int = 5
    sample_period: float = 0.5
    window: int = 6
    util_log_period: float = 1.0
    contention: ContentionModel = field(default_factory=ContentionModel)
    scheduler: str | None = None  # "themis": time-slicing finish-time fairness instead of a DR policy
    round_seconds: float = 60.0
    switch_seconds: float = 5.0
    record: bool = True
    max_time: float = 1e7


class _Gpu:
    __slots__ = ("index", "active", "heap", "vclock", "last", "rate", "version", "busy", "busy_since", "served",
                 "sampled_busy")

    def __init__(self, index: int) -> None:
        self.index = index
        self.active = 0
        self.heap: list[tuple[float, int, _App, float]] = []
        self.vclock = 0.0
        self.last = 0.0
        self.rate = 0.0
        self.version = 0
        self.busy = 0.0
        self.busy_since = 0.0
        self.served = 0.0
        self.sampled_busy = 0.0

    def busy_at(self, now: float) -> float:
        return self.busy + (now - self.busy_since if self.active else 0.0)


class _App:
    __slots__ = ("spec", "profile", "name", "index", "tracker", "ratio", "sizes", "chunks_left", "reported_sd",
                 "alive", "arrived", "running", "suspend", "records", "gpu")

    def __init__(self, spec: AppSpec, index: int, ratio: DataRatio) -> None:
        self.spec = spec
        self.profile: ModelProfile = model_profile(spec.model)
        self.name = spec.name
        self.index = index
        self.tracker = SlowdownTracker(IterationPlan(spec.epochs, spec.iterations_per_epoch), spec.solo_time(),
                                       start=spec.arrival)
        self.ratio = ratio
        self.sizes: tuple[int, ...] = ()
        self.chunks_left = 0
        self.reported_sd: float | None = None
        self.alive = False
        self.arrived = False
        self.running = False
        self.suspend = False
        self.records: list[dict[str, Any]] = []
        self.gpu: int | None = None


@dataclass
class SimResult:
    scenario: str
    label: str
    final_sd: dict[str, float]
    finish: dict[str, float]
    makespan: float
    gpu_busy: list[float]
    gpu_served: list[float]
    decisions: int
    events: int
    app_records: dict[str, list[dict[str, Any]]]
    manager_records: list[dict[str, Any]]

    @property
    def max_sd(self) -> float:
        return max(self.final_sd.values())

    @property
    def sd_spread(self) -> float:
        return max(self.final_sd.values()) - min(self.final_sd.values())

    @property
    def mean_sd(self) -> float:
        return sum(self.final_sd.values()) / len(self.final_sd)


class Simulation:
    """One simulated run of a scenario under a policy (or the time-slicing scheduler)."""

    def __init__(self, scenario: Scenario, config: SimConfig | None = None, policy: Policy | None = None) -> None:
        self.config = config or SimConfig()
        self.scenario = scenario if self.config.placement is None else scenario.with_placement(self.config.placement)
        if self.config.scheduler not in (None, "themis"):
            raise ValueError(f"unknown scheduler {self.config.scheduler!r}; the only one is 'themis'")
        if policy is None:
            if self.config.policy not in POLICIES:
                raise ValueError(f"unknown policy {self.config.policy!r}; known: {', '.join(POLICIES)}")
            policy = POLICIES[self.config.policy]()
        self.policy = policy
        self.policy_config = PolicyConfig(self.scenario.gpus, self.scenario.dr_total, self.config.sd_threshold,
                                          self.config.util_threshold)
        self.gpus = [_Gpu(g) for g in range(self.scenario.gpus)]
        self.apps = [_App(spec, i, self.scenario.initial_ratio(i)) for i, spec in enumerate(self.scenario.apps)]
        self.window = UtilizationWindow(self.scenario.gpus, self.config.window)
        self.now = 0.0
        self.events: list[tuple[float, int, int, Any, Any]] = []
        self._seq = itertools.count()
        self.remaining = len(self.apps)
        self.decisions = 0
        self.processed = 0
        self.manager_records: list[dict[str, Any]] = []
        self._next_util_log = 0.0

    # --- the event loop ---------------------------------------------------------------------
    def push(self, time: float, kind: int, a: Any = None, b: Any = None) -> None:
        heapq.heappush(self.events, (time, next(self._seq), kind, a, b))

    def run(self) -> SimResult:
        for app in self.apps:
            self.push(app.spec.arrival, ARRIVAL, app)
        self.push(0.0, SAMPLE)
        if self.config.scheduler == "themis":
            self.push(0.0, TICK)
        handlers = {ARRIVAL: self._arrive, HOST_END: self._host_end, SAMPLE: self._sample, TICK: self._tick,
                    RESUME: self._resume}
        events = self.events
        while events and self.remaining:
            time, _, kind, a, b = heapq.heappop(events)
            if time > self.config.max_time:
                raise RuntimeError(f"simulation passed {self.config.max_time} s: a policy starves an app?")
            self.now = time
            self.processed += 1
            if kind == GPU_DONE:
                if b == a.version:
                    self._gpu_done(a)
            else:
                handlers[kind](a)
        return self._result()

    # --- GPUs: processor sharing with a virtual clock per GPU ---------------------------------
    def _advance(self, gpu: _Gpu) -> None:
        if gpu.active:
            gpu.vclock += gpu.rate * (self.now - gpu.last)
        gpu.last = self.now

    def _reschedule(self, gpu: _Gpu) -> None:
        gpu.rate = self.config.contention.rate(gpu.active)
        gpu.version += 1
        if gpu.heap:
            delay = max(0.0, (gpu.heap[0][0] - gpu.vclock) / gpu.rate)
            self.push(self.now + delay, GPU_DONE, gpu, gpu.version)

    def _add_chunk(self, gpu: _Gpu, app: _App, work: float) -> None:
        self._advance(gpu)
        if gpu.active == 0:
            gpu.busy_since = self.now
        heapq.heappush(gpu.heap, (gpu.vclock + work, next(self._seq), app, work))
        gpu.active += 1
        self._reschedule(gpu)

    def _gpu_done(self, gpu: _Gpu) -> None:
        self._advance(gpu)
        done = []
        limit = gpu.vclock + 1e-9 * max(1.0, gpu.vclock)
        while gpu.heap and gpu.heap[0][0] <= limit:
            _, _, app, work = heapq.heappop(gpu.heap)
            gpu.active -= 1
            gpu.served += work
            done.append(app)
        if gpu.active == 0:
            gpu.busy += self.now - gpu.busy_since
        self._reschedule(gpu)
        for app in done:
            app.chunks_left -= 1
            if app.chunks_left == 0:
                self._iteration_done(app)

    # --- apps --------------------------------------------------------------------------------
    def _arrive(self, app: _App) -> None:
        app.arrived = app.alive = True
        self._record(app, "start")
        if self.config.scheduler is None:
            self._decide(app, "register")
            self._start_iteration(app)
        else:
            self.push(self.now, TICK)  # a newcomer: the scheduler may give it a free GPU now

    def _start_iteration(self, app: _App) -> None:
        batch = app.spec.batch
        app.sizes = app.ratio.split(batch)
        replicas = sum(1 for size in app.sizes if size)
        app.chunks_left = replicas
        app.running = True
        host = app.profile.host_seconds(batch) + app.profile.overhead_seconds(replicas)
        self.push(self.now + host, HOST_END, app)

    def _host_end(self, app: _App) -> None:
        device = app.profile.device_seconds
        for gpu, size in zip(self.gpus, app.sizes):
            if size:
                self._add_chunk(gpu, app, device(size))

    def _iteration_done(self, app: _App) -> None:
        tracker = app.tracker
        tracker.iteration_finished(self.now)
        done = tracker.done
        if tracker.finished:
            app.reported_sd = tracker.slowdown(self.now)
            app.alive = app.running = False
            self.remaining -= 1
            self._record(app, "finish")
            if self.config.scheduler is not None:
                self.push(self.now, TICK)
            return
        decide_every = self.config.decide_every
        if done % tracker.plan.iterations_per_epoch == 0 or (decide_every and done % decide_every == 0):
            app.reported_sd = tracker.slowdown(self.now)
            self._record(app, "boundary")
            if self.config.scheduler is None:
                self._decide(app, "boundary")
            tracker.new_window()
        elif done % self.config.report_every == 0:
            app.reported_sd = tracker.slowdown(self.now)
            self._record(app, "report")
        if app.suspend:
            app.running = app.suspend = False
            return
        self._start_iteration(app)

    # --- the policy, called as the daemon calls it --------------------------------------------
    def _snapshot(self) -> Snapshot:
        views = tuple(
            AppView(a.name, a.ratio, a.reported_sd, iteration=a.tracker.done, iterations_total=a.tracker.plan.total,
                    iteration_time=a.tracker.mean_iteration_time, solo_time=a.tracker.solo_time)
            for a in self.apps if a.alive
        )
        return Snapshot(views, self.window.values(), self.policy_config)

    def _decide(self, app: _App, trigger: str) -> None:
        snapshot = self._snapshot()
        decision = self.policy.decide(app.name, trigger, snapshot)
        self.decisions += 1
        if self.config.record:
            self.manager_records.append({
                "t": self.now, "event": "decision", "app": app.name, "trigger": trigger, "branch": decision.branch,
                "old_dr": app.ratio.to_list(), "new_dr": decision.ratio.to_list(),
                "sd": {view.name: view.slowdown for view in snapshot.apps}, "util": list(snapshot.utilization),
            })
        if decision.ratio != app.ratio:
            if len(decision.ratio) != self.scenario.gpus:
                raise ValueError(f"policy {self.policy.name!r} returned {decision.ratio} for {self.scenario.gpus} GPUs")
            old, app.ratio = app.ratio, decision.ratio
            self._record(app, "update", old_dr=old.to_list(), new_dr=app.ratio.to_list(), branch=decision.branch)

    # --- utilisation sampling (as the manager samples NVML) ------------------------------------
    def _sample(self, _: Any) -> None:
        period = self.config.sample_period
        reading = []
        for gpu in self.gpus:
            busy = gpu.busy_at(self.now)
            reading.append(min(100.0, max(0.0, 100.0 * (busy - gpu.sampled_busy) / period)) if self.now > 0 else 0.0)
            gpu.sampled_busy = busy
        self.window.add(reading)
        if self.config.record and self.now >= self._next_util_log:
            self._next_util_log = self.now + self.config.util_log_period
            self.manager_records.append({"t": self.now, "event": "util", "util": reading,
                                         "smoothed": list(self.window.values())})
        if self.remaining:
            self.push(self.now + period, SAMPLE)

    # --- the time-slicing baseline --------------------------------------------------------------
    def _tick(self, _: Any) -> None:
        from drbalance.sim.timeslice import plan_round

        live = [a for a in self.apps if a.alive]
        if not live:
            return
        assignment = plan_round(live, self.now, len(self.gpus))
        for app in live:
            gpu = assignment.get(app.name)
            if gpu is None:
                if app.running:
                    app.suspend = True  # stops after its current iteration
                app.gpu = None
                continue
            app.suspend = False
            if app.gpu != gpu or not app.running:
                app.ratio = DataRatio.single(len(self.gpus), gpu, self.scenario.dr_total)
                if not app.running:
                    app.running = True
                    self.push(self.now + self.config.switch_seconds, RESUME, app)
            app.gpu = gpu
        self.decisions += 1
        if self.remaining and not any(e[2] == TICK and e[0] > self.now for e in self.events):
            self.push(self.now + self.config.round_seconds, TICK)

    def _resume(self, app: _App) -> None:
        if app.alive and not app.suspend:
            self._start_iteration(app)
        else:
            app.running = False

    # --- results -------------------------------------------------------------------------------
    def _record(self, app: _App, event: str, **extra: Any) -> None:
        if not self.config.record:
            return
        tracker = app.tracker
        app.records.append({"t": self.now, "event": event, "app": app.name, "iteration": tracker.done,
                            "epoch": tracker.epoch, "sd": app.reported_sd if event != "start" else None,
                            "dr": app.ratio.to_list(), **extra})

    def _result(self) -> SimResult:
        for gpu in self.gpus:
            if gpu.active:
                gpu.busy += self.now - gpu.busy_since
                gpu.active = 0
        finals = {a.name: a.tracker.slowdown(self.now) for a in self.apps}
        if any(v is None or not math.isfinite(v) for v in finals.values()):
            raise RuntimeError("simulation ended with apps that never ran")
        finish = {a.name: a.tracker.last_mark for a in self.apps}
        label = self.config.scheduler or self.config.policy
        return SimResult(
            scenario=self.scenario.name, label=label, final_sd=finals, finish=finish,
            makespan=max(finish.values()), gpu_busy=[g.busy for g in self.gpus],
            gpu_served=[g.served for g in self.gpus], decisions=self.decisions, events=self.processed,
            app_records={a.name: a.records for a in self.apps}, manager_records=self.manager_records,
        )


def simulate(scenario: Scenario, config: SimConfig | None = None) -> SimResult:
    return Simulation(scenario, config).run()
