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
import random
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, NamedTuple

from drbalance import defaults
from drbalance.manager.utilization import UtilizationWindow
from drbalance.policy import DEFAULT_POLICY, POLICIES, AppView, Policy, PolicyConfig, Snapshot, violations
from drbalance.ratio import DataRatio
from drbalance.sim.model import ContentionModel, Interference, Workload
from drbalance.slowdown import IterationPlan, SlotWindow, SlowdownTracker
from drbalance.workload.models import ModelCosts, model_costs
from drbalance.workload.scenarios import AppSpec, Scenario

ARRIVAL, REGISTER, HOST_END, GPU_DONE, SAMPLE, TICK, RESUME = range(7)


class ChunkTiming(NamedTuple):
    """What the client's ``last_replica_timings()`` reports for one chunk: slot, samples, seconds."""

    slot: int
    samples: int
    seconds: float


@dataclass(frozen=True)
class SimConfig:
    """How to simulate. Periods in seconds; thresholds as for the manager."""

    policy: str = DEFAULT_POLICY
    placement: str | None = None  # override the scenario's initial placement
    sd_threshold: float = defaults.SD_THRESHOLD
    util_threshold: float = defaults.UTIL_THRESHOLD
    decide_every: int | None = None  # None: decide at epoch ends only
    report_every: int = 5
    sample_period: float = defaults.SAMPLE_PERIOD
    window: int = defaults.UTIL_WINDOW
    util_log_period: float = defaults.UTIL_LOG_PERIOD
    contention: Interference = field(default_factory=ContentionModel)
    scheduler: str | None = None  # "themis": time-slicing finish-time fairness instead of a DR policy
    round_seconds: float = 60.0
    switch_seconds: float = 5.0
    record: bool = True
    max_time: float = 1e6  # seconds (11.6 days): simulating costs CPU and memory per simulated second
    jitter: float = 0.0  # relative spread of every host phase and chunk (a log-normal factor of mean 1); 0: none
    seed: int = 0  # of the jitter's random numbers (the same seed: the same run)
    change_cost: float = defaults.CHANGE_COST_ITERATIONS  # iterations' worth an app loses at each DR change

    def __post_init__(self) -> None:
        if not 0.0 <= self.jitter <= defaults.MAX_JITTER:  # also refuses NaN
            raise ValueError(f"jitter must be a relative spread within 0..{defaults.MAX_JITTER:g}; got {self.jitter!r}")
        if not 0.0 <= self.change_cost < math.inf:
            raise ValueError(f"change_cost must be a number of iterations >= 0; got {self.change_cost!r}")


class _Chunk:
    """One chunk of an app's iteration on one GPU: work left (seconds at rate 1) and its rate now."""

    __slots__ = ("app", "slot", "samples", "work", "remaining", "rate", "started")

    def __init__(self, app: _App, slot: int, samples: int, work: float, started: float) -> None:
        self.app = app
        self.slot = slot
        self.samples = samples
        self.work = work
        self.remaining = work
        self.rate = 0.0
        self.started = started


class _Gpu:
    __slots__ = ("index", "speed", "chunks", "last", "version", "busy", "busy_since", "served", "sampled_busy")

    def __init__(self, index: int, speed: float) -> None:
        self.index = index
        self.speed = speed
        self.chunks: list[_Chunk] = []
        self.last = 0.0
        self.version = 0
        self.busy = 0.0
        self.busy_since = 0.0
        self.served = 0.0
        self.sampled_busy = 0.0

    @property
    def active(self) -> int:
        return len(self.chunks)

    def busy_at(self, now: float) -> float:
        return self.busy + (now - self.busy_since if self.chunks else 0.0)


class _App:
    __slots__ = ("spec", "costs", "name", "index", "tracker", "ratio", "sizes", "chunks_left", "reported_sd",
                 "alive", "arrived", "running", "suspend", "records", "gpu", "workload", "host_end", "timings",
                 "slot_window", "published", "cadence", "boundary_due", "pushed", "constraints", "changed",
                 "changes")

    def __init__(self, spec: AppSpec, index: int, ratio: DataRatio) -> None:
        self.spec = spec
        self.costs: ModelCosts = model_costs(spec.model)
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
        self.workload: Workload = (spec.model, spec.batch)
        self.host_end = 0.0
        self.timings: list[ChunkTiming] = []  # this iteration's chunks finished so far
        self.slot_window = SlotWindow(len(ratio))
        self.published: AppView | None = None  # what the app's record holds, as the manager would read it
        self.cadence: float | None = None  # seconds between boundaries the policy asked for
        self.boundary_due: float | None = None
        self.pushed: DataRatio | None = None  # a DR pushed by the manager, applied after its current iteration
        self.constraints = ddp_constraints(spec, ratio)  # what a DDP job's record tells the manager
        self.changed = False  # its DR changed since its last iteration started: the next one pays the change
        self.changes = 0  # DR changes after its first iteration (churn)


def ddp_constraints(spec: AppSpec, ratio: DataRatio) -> dict[str, Any]:
    """The constraints the daemon reads from a DistributedDataParallel job's record (docs/ddp.md):
    its DR is over its ranks, one on each GPU of its initial DR (``allowed``, None when that is
    every GPU), and every rank keeps at least one unit of the DR (``min_share``). None for a
    DataParallel job, which may use any GPU and leave any empty."""
    if not spec.ddp:
        return {}
    ranks = tuple(gpu for gpu, share in enumerate(ratio.shares) if share)
    return {"allowed": None if len(ranks) == len(ratio) else ranks, "min_share": 1}


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
    changes: dict[str, int] = field(default_factory=dict)  # per app, its DR changes after its first iteration
    run_seconds: dict[str, float] = field(default_factory=dict)  # per app, from its arrival to its finish

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
        self._check_horizon()
        self.policy_config = PolicyConfig(self.scenario.gpus, self.scenario.dr_total, self.config.sd_threshold,
                                          self.config.util_threshold)
        self.gpus = [_Gpu(g, self.scenario.speed(g)) for g in range(self.scenario.gpus)]
        self.apps = [_App(spec, i, self.scenario.initial_ratio(i)) for i, spec in enumerate(self.scenario.apps)]
        self.window = UtilizationWindow(self.scenario.gpus, self.config.window)
        # the jitter's source; None without jitter, so a run without it draws nothing
        self._noise = random.Random(self.config.seed) if self.config.jitter > 0 else None
        self._noise_sigma = math.sqrt(math.log1p(self.config.jitter ** 2))  # of the factor's logarithm
        self.now = 0.0
        self.events: list[tuple[float, int, int, Any, Any]] = []
        self._seq = itertools.count()
        self.remaining = len(self.apps)
        self.decisions = 0
        self.processed = 0
        self.manager_records: list[dict[str, Any]] = []
        # the first record after one log period: the reading at t = 0 covers the period before the
        # run (nothing was running), which the report's mean utilisation would count as 0%
        self._next_util_log = self.config.util_log_period

    def _check_horizon(self) -> None:
        check_horizon(self.scenario, self.config.max_time)

    def _past_horizon(self) -> str:
        """Why the simulation stopped at ``max_time``: the unfinished apps and how far each got
        (none done: a policy that starves it; most done: a scenario too long for the horizon)."""
        unfinished = [app for app in self.apps if not app.tracker.finished]
        shown = ", ".join(f"{app.name} {app.tracker.done}/{app.tracker.plan.total} iterations"
                          for app in unfinished[:5])
        if len(unfinished) > 5:
            shown += f" and {len(unfinished) - 5} more"
        return (f"simulated time passed the horizon of {self.config.max_time:g} s with {len(unfinished)} app(s) "
                f"unfinished ({shown}): the scenario's shared runs are too long for the simulator, or the "
                f"policy starves an app")

    # --- the event loop ---------------------------------------------------------------------
    def push(self, time: float, kind: int, a: Any = None, b: Any = None) -> None:
        heapq.heappush(self.events, (time, next(self._seq), kind, a, b))

    def run(self) -> SimResult:
        self.start()
        self.advance()
        return self._result()

    def start(self) -> None:
        """Schedule the arrivals and the first utilisation sample (``run`` does it; call it once
        before ``advance`` when driving the run in steps)."""
        for app in self.apps:
            self.push(app.spec.arrival, ARRIVAL, app)
        self.push(0.0, SAMPLE)
        if self.config.scheduler == "themis":
            self.push(0.0, TICK)

    def advance(self, until: float = math.inf) -> None:
        """Process events up to simulated time ``until`` (seconds), or until every app has
        finished. Called repeatedly, it drives a run in steps (``interference.fit_pair`` does)."""
        handlers = {ARRIVAL: self._arrive, REGISTER: self._register, HOST_END: self._host_end, SAMPLE: self._sample,
                    TICK: self._tick, RESUME: self._resume}
        events = self.events
        while events and self.remaining and events[0][0] <= until:
            time, _, kind, a, b = heapq.heappop(events)
            if time > self.config.max_time:
                raise RuntimeError(self._past_horizon())
            self.now = time
            self.processed += 1
            if kind == GPU_DONE:
                if b == a.version:
                    self._gpu_done(a)
            else:
                handlers[kind](a)

    # --- GPUs: shared by their active chunks at the interference model's rates ----------------
    def _advance(self, gpu: _Gpu) -> None:
        """Serve every active chunk for the time since the GPU's last event."""
        elapsed = self.now - gpu.last
        if elapsed > 0:
            for chunk in gpu.chunks:
                chunk.remaining -= chunk.rate * elapsed
        gpu.last = self.now

    def _reschedule(self, gpu: _Gpu) -> None:
        """New rates for the chunks now active; the next completion as an event."""
        gpu.version += 1
        chunks = gpu.chunks
        if not chunks:
            return
        rates = self.config.contention.rates([chunk.app.workload for chunk in chunks])
        for chunk, rate in zip(chunks, rates):
            chunk.rate = rate * gpu.speed
        delay = min(max(0.0, chunk.remaining) / chunk.rate for chunk in chunks)
        self.push(self.now + delay, GPU_DONE, gpu, gpu.version)

    def _add_chunk(self, gpu: _Gpu, chunk: _Chunk) -> None:
        self._advance(gpu)
        if not gpu.chunks:
            gpu.busy_since = self.now
        gpu.chunks.append(chunk)
        self._reschedule(gpu)

    def _gpu_done(self, gpu: _Gpu) -> None:
        self._advance(gpu)
        done = [chunk for chunk in gpu.chunks if chunk.remaining <= 1e-9 * max(1.0, chunk.work)]
        if not done:  # rounding: the earliest chunk is due now
            done = [min(gpu.chunks, key=lambda chunk: chunk.remaining)]
        for chunk in done:
            gpu.chunks.remove(chunk)
            gpu.served += chunk.work
        if not gpu.chunks:
            gpu.busy += self.now - gpu.busy_since
        self._reschedule(gpu)
        for chunk in done:
            app = chunk.app
            app.timings.append(ChunkTiming(chunk.slot, chunk.samples, self.now - app.host_end))
            app.chunks_left -= 1
            if app.chunks_left == 0:
                self._iteration_done(app)

    # --- apps --------------------------------------------------------------------------------
    def _arrive(self, app: _App) -> None:
        """An app starts. It registers after every app arriving at the same instant has started,
        so apps launched together see each other (as jobs started together reach the manager)."""
        app.arrived = app.alive = True
        self._record(app, "start")
        self._publish(app)
        if self.config.scheduler is None:
            self.push(self.now, REGISTER, app)
        else:
            self.push(self.now, TICK)  # a newcomer: the scheduler may give it a free GPU now

    def _register(self, app: _App) -> None:
        self._decide(app, "register")
        self._start_iteration(app)

    def _start_iteration(self, app: _App) -> None:
        batch = app.spec.batch
        app.sizes = _split(app.ratio.shares, app.ratio.total, batch)
        replicas = sum(1 for size in app.sizes if size)
        app.chunks_left = replicas
        app.running = True
        host = app.costs.host_seconds(batch) + app.costs.overhead_seconds(replicas)
        if app.changed:  # the first step under a new DR: new chunk shapes, maybe a GPU used for the first time
            app.changed = False
            alone = max(app.costs.device_seconds(size) / self.gpus[g].speed for g, size in enumerate(app.sizes) if size)
            host += self.config.change_cost * (host + alone)
        self.push(self.now + host * self._jitter(), HOST_END, app)

    def _host_end(self, app: _App) -> None:
        device = app.costs.device_seconds
        app.host_end = self.now
        app.timings = []
        for gpu, size in zip(self.gpus, app.sizes):
            if size:
                self._add_chunk(gpu, _Chunk(app, gpu.index, size, device(size) * self._jitter(), self.now))

    def _jitter(self) -> float:
        """A phase's time factor: 1 without jitter, else log-normal with mean 1 and a relative
        spread of about ``jitter`` (a real machine's iterations are not all alike: emulated GPUs
        on a busy CPU, other users' work, data loading)."""
        if self._noise is None:
            return 1.0
        sigma = self._noise_sigma
        return math.exp(self._noise.gauss(-sigma * sigma / 2, sigma))

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
        if (done % tracker.plan.iterations_per_epoch == 0 or (decide_every and done % decide_every == 0)
                or (app.boundary_due is not None and self.now >= app.boundary_due)):
            app.boundary_due = None if app.cadence is None else self.now + app.cadence
            app.slot_window.add(app.timings)
            self._apply_push(app)
            self._publish(app)
            self._record(app, "boundary")
            if self.config.scheduler is None:
                self._decide(app, "boundary")
            tracker.new_window()
            app.slot_window.new_window()
        elif done % self.config.report_every == 0:
            app.slot_window.add(app.timings)
            self._apply_push(app)
            self._publish(app)
            self._record(app, "report")
        if app.suspend:
            app.running = app.suspend = False
            return
        self._apply_push(app)  # the client looks for a pushed DR after every iteration
        self._start_iteration(app)

    # --- the policy, called as the daemon calls it --------------------------------------------
    def _publish(self, app: _App) -> None:
        """What the client writes into its record at a report or boundary, as the manager reads it."""
        tracker = app.tracker
        app.reported_sd = tracker.slowdown(self.now)
        means = app.slot_window.means()
        app.published = AppView(
            app.name, app.ratio, app.reported_sd, epoch=tracker.epoch, iteration=tracker.done,
            iterations_total=tracker.plan.total,
            iteration_time=tracker.mean_iteration_time, solo_time=tracker.solo_time,
            chunk_seconds=tuple(mean[0] if mean else None for mean in means),
            chunk_samples=tuple(mean[1] if mean else 0.0 for mean in means), batch=_published_batch(app),
            **app.constraints,
        )

    def _apply_push(self, app: _App) -> None:
        """The client applies a pushed DR after its current iteration (at a report: before publishing)."""
        if app.pushed is not None:
            ratio, app.pushed = app.pushed, None
            self._change(app, ratio, "push")

    def _change(self, app: _App, ratio: DataRatio, branch: str) -> None:
        """The app takes ``ratio`` (if new: logged, its next iteration pays the change, and its
        measurement windows start anew, as the client's do)."""
        if ratio != app.ratio:
            old, app.ratio = app.ratio, ratio
            app.changed = app.tracker.done > app.tracker.first  # before its first step a job pays nothing
            app.changes += app.changed
            app.tracker.new_window()
            app.slot_window.new_window()
            self._record(app, "update", old_dr=old.to_list(), new_dr=ratio.to_list(), branch=branch)

    def _snapshot(self) -> Snapshot:
        """Every live app as its record last showed it, with the DR the manager last gave it."""
        views = []
        for app in self.apps:
            if app.alive:
                view = app.published
                ratio = app.pushed or app.ratio
                views.append(view if view.ratio == ratio else replace(view, ratio=ratio))
        return Snapshot(tuple(views), self.window.values(), self.policy_config)

    def _decide(self, app: _App, trigger: str) -> None:
        snapshot = self._snapshot()
        decision = self.policy.decide(app.name, trigger, snapshot)
        self.decisions += 1
        app.cadence = decision.next_boundary
        app.boundary_due = None if app.cadence is None else self.now + app.cadence
        ratio, branch, details = decision.ratio, decision.branch, dict(decision.details)
        refused = self._refusal(snapshot.app(app.name), ratio)
        if refused is not None:  # the daemon keeps the app's DR (a DR pushed to it included) and pushes nothing
            ratio, branch, details = app.pushed or app.ratio, "policy-error", {"error": refused}
        if self.config.record:
            self.manager_records.append({
                "t": self.now, "event": "decision", "app": app.name, "trigger": trigger, "branch": branch,
                "old_dr": app.ratio.to_list(), "new_dr": ratio.to_list(),
                "sd": {view.name: view.slowdown for view in snapshot.apps}, "util": list(snapshot.utilization),
                "iter_time": snapshot.app(app.name).iteration_time, "details": details,
            })
        # the answer replaces a DR pushed to the app before (Manager.decide writes it into the same
        # command record), even when it is the DR the app runs now
        app.pushed = None
        self._change(app, ratio, branch)
        if refused is not None:
            return
        by_name = {other.name: other for other in self.apps if other.alive}
        for name, pushed in decision.others.items():  # pushed now, applied after each one's current iteration
            other = by_name.get(name)
            if other is None or other is app:
                why = "a push to the deciding app itself" if other is app else f"app {name!r} is not live"
            else:
                why = self._refusal(snapshot.app(name), pushed)
            if why is not None:  # refused and logged, as the daemon's Manager._push does; the others go on
                if self.config.record:
                    self.manager_records.append({"t": self.now, "event": "push", "app": name, "branch": branch,
                                                 "refused": why})
                continue
            other.pushed = pushed

    def _refusal(self, view: AppView, ratio: object) -> str | None:
        """Why the daemon would not send ``ratio`` to the app of ``view`` (None: it would), as
        ``Manager._check_ratio`` checks every decision and push: keeping the DR is always fine;
        a new one must be a DataRatio for every GPU in the configured total, within the app's
        constraints."""
        if not isinstance(ratio, DataRatio):
            return f"policy returned {ratio!r}, not a DataRatio"
        if ratio == view.ratio:
            return None
        if len(ratio) != self.scenario.gpus or ratio.total != self.scenario.dr_total:
            return f"policy returned {ratio} for {self.scenario.gpus} GPUs of total {self.scenario.dr_total}"
        problems = violations(view, ratio, self.policy_config)
        if problems:
            return f"policy returned {ratio}, which breaks the app's constraints: {'; '.join(problems)}"
        return None

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
            if gpu.chunks:
                gpu.busy += self.now - gpu.busy_since
                gpu.chunks.clear()
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
            changes={a.name: a.changes for a in self.apps},
            run_seconds={a.name: finish[a.name] - a.spec.arrival for a in self.apps},
        )


def check_horizon(scenario: Scenario, max_time: float) -> None:
    """ValueError for an app that could not finish within ``max_time`` seconds alone on the
    slowest GPU (a huge arrival, batch or run length, a GPU speed near 0): said at once, not
    after minutes of simulating towards the horizon. Alone on a GPU of speed v an iteration takes
    ``host + device / v`` seconds: the host phase is not scaled."""
    slowest = min(scenario.speed(g) for g in range(scenario.gpus))
    for spec in scenario.apps:
        costs = model_costs(spec.model)
        alone = spec.iterations * (costs.host_seconds(spec.batch) + costs.device_seconds(spec.batch) / slowest)
        if not spec.arrival + alone <= max_time:
            where = "on the reference GPU" if slowest == 1.0 else f"on the slowest GPU (speed {slowest:g})"
            raise ValueError(f"app {spec.name!r}: arriving at {spec.arrival:g} s and running {alone:g} s alone "
                             f"{where}, it would not finish within the simulator's horizon of {max_time:g} s")


def _published_batch(app: _App) -> int | None:
    """The batch (samples) an app's record shows: the samples of its last forward, so None (the
    record's 0, unknown) until its first iteration in this run has finished, as the client's
    ``Session._last_batch`` reads it from the model."""
    return app.spec.batch if app.tracker.done > app.tracker.first else None


@lru_cache(maxsize=4096)
def _split(shares: tuple[int, ...], total: int, batch: int) -> tuple[int, ...]:
    return DataRatio(shares, total).split(batch)


def simulate(scenario: Scenario, config: SimConfig | None = None) -> SimResult:
    return Simulation(scenario, config).run()
