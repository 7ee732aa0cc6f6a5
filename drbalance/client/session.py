"""The training script's one object: SD tracking, reports, the epoch-end exchange, the SD log.

    model = BalancedDataParallel(net.cuda(0), device_ids=[0, 1, 2, 3])
    session = Session(model, app="resnet50-a", epochs=90, iterations_per_epoch=loader,
                      start_epoch=start_epoch)   # the plan from len(loader); resume at a later epoch
    for epoch in range(start_epoch, 90):
        for images, labels in loader:
            ...; optimizer.step()
            session.step()            # once per iteration, after the optimizer step
    session.close()                   # or use the session as a context manager

A session that runs past its plan never stops training: it extends the plan by one epoch at a
time and warns once. At the planned end it tells the manager it is done (so its GPUs are free
for others) and stays usable until closed.

Every ``report_every`` iterations the session writes its SD, DR and progress into its shared
record. At each decision boundary (the end of every epoch, every ``decide_every`` iterations if
set, and when the manager's last answer asked for the next decision) it also sends a notice to the
manager (waiting at most ``send_timeout`` for room) and waits at most ``exchange_timeout`` seconds for
a new DR, which the model uses from its next forward. Without a manager, or with a slow or dead
one, training goes on with its own DR (one warning); it re-attaches when a manager appears.
A DR the manager pushes outside an exchange (the other half of a swap) is applied after the
current iteration: every ``step()`` looks at the app's signal semaphore (one ``sem_trywait``).

A ``DistributedDataParallel`` job (``BalancedDistributedDataParallel``) creates the Session on
every rank with the same arguments. It is one app: rank 0 alone talks to the manager and writes
the record and SD log; the manager's DR reaches the other ranks through the job's own process
group, with the job's next control exchange (every K steps, ``drbalance.client.distributed.JobSync``),
and every rank uses it from the same global batch on. A job whose ranks are on several nodes is
one app per node: each node's leader (its lowest rank) talks to its node's manager as
``<app>@<node>`` about its node's local ranks (``NodeSync``). See docs/ddp.md.
"""

from __future__ import annotations

import atexit
import logging
import math
import numbers
import os
import signal
import threading
from collections.abc import Callable, Sized
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

import posix_ipc

from drbalance import env
from drbalance.client.distributed import JobSync
from drbalance.client.termination import SessionTerminated, Termination
from drbalance.clock import Clock, SystemClock
from drbalance.ipc import objects
from drbalance.ipc.layout import MAX_GPUS, AppCommand, AppState, AppStatus, Notice, NoticeKind, SlotStatus
from drbalance.ipc.link import (
    DEFAULT_EXCHANGE_TIMEOUT,
    DEFAULT_SEND_TIMEOUT,
    DetachedLink,
    ManagerLink,
)
from drbalance.ipc.names import IpcNames, check_app_name
from drbalance.ipc.private import UnsafePath
from drbalance.ipc.system_link import AutoLink
from drbalance.jsonlog import JsonLinesWriter
from drbalance.profiling.store import Measurement, SoloTime, resolve_solo_time
from drbalance.ratio import DataRatio
from drbalance.slowdown import IterationPlan, SlotWindow, SlowdownTracker
from drbalance.solo_estimate import ALONE, MANAGER, SHARED, AloneWindow, SlotSample, SoloEstimator, chosen_solo

logger = logging.getLogger("drbalance.client")

SD_LOG_FLUSH_SECONDS = 2.0
"""Report lines wait in the SD log's buffer (64 at most) until the first report this many seconds
or more after the last write: a reader tailing the log (a test, a person) lags a job that keeps
reporting by about this much, not by 64 of its iterations, and a job killed outright loses
the reports of about this long. A job that stops reporting (a long evaluation) keeps its last
lines buffered until its next report or its end."""

LOG_CHECK_SECONDS = 5.0
"""How often (seconds, at most) a session looks whether its SD log was removed or replaced under
it (an ``rm``, logrotate's rename): it then writes to a new file at the log's path, not to one
nobody can read or a rotated one."""


LATE_ANSWERS_BEFORE_SHORT_WAITS = 3
"""After this many notices in a row that the manager did not answer within ``exchange_timeout``
(it is alive, its heartbeat fresh, but slow: overloaded, or stopped with SIGSTOP for up to 5 s),
a session waits only ``SHORT_WAIT_SHARE`` of it at each boundary, until an answer comes within
that again. A late answer is applied when it arrives either way: only the time the job spends
waiting changes (with full waits, a slow manager that answers every notice late costs the job
``exchange_timeout``, 0.5 s, at every boundary)."""

SHORT_WAIT_SHARE = 0.1
"""The share of ``exchange_timeout`` a session waits while its manager is slow (see above)."""

UNKNOWN_SOLO_SECONDS = 1.0
"""The solo time (seconds) a session without one publishes before its first estimate (its first
report): the record needs a positive number, and its SD is unknown meanwhile (the record says so),
so the number enters no SD. The manager's own ``AppView`` default is the same."""


class RatioTarget(Protocol):
    """What a session steers: ``BalancedDataParallel`` (or anything with a DR to set)."""

    @property
    def ratio(self) -> DataRatio: ...

    def set_ratio(self, ratio: DataRatio) -> None: ...


class MeasurementComplete(SystemExit):
    """Raised by ``step()`` in solo-measurement mode once enough iterations are measured (exit status 0)."""

    def __init__(self) -> None:
        super().__init__(0)


def iterations_from(value: int | Sized) -> int:
    """Iterations per epoch from an integer or from anything with a length (a DataLoader)."""
    if isinstance(value, bool):
        raise ValueError(f"iterations_per_epoch must be a positive integer or a loader; got {value!r}")
    if isinstance(value, numbers.Integral):  # numpy's integers too
        return int(value)
    try:
        length = len(value)  # a DataLoader's length is its batches per epoch
    except TypeError:
        raise ValueError(
            f"iterations_per_epoch must be a positive integer or a loader with a length; got "
            f"{type(value).__name__}, which has none (e.g. a DataLoader over an IterableDataset): "
            f"give the number of iterations per epoch"
        ) from None
    if length < 1:
        raise ValueError(f"iterations_per_epoch: the loader given has {length} batches; it must have at least one")
    return length


def _whole(value: Any) -> Any:
    """An integer of any integral type (numpy's ``int64`` from a config or an array included) as
    an ``int``; anything else (``bool``: refused by the checks after) unchanged."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return value
    return int(value)


def _positive_int(value: Any, name: str, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    value = _whole(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer{' or None' if allow_none else ''}; got {value!r}")
    return value


def _slurm_app_name() -> str:
    """The app name of a Slurm job (``env.slurm_app_name``); ValueError outside one."""
    name = env.slurm_app_name()
    if name is None:
        raise ValueError("app=None names the app after its Slurm job (<SLURM_JOB_NAME>-<SLURM_JOB_ID>), but this "
                         "process is not in one (no SLURM_JOB_ID): give app='a-name'")
    return name


class Session:
    """Connects one training job to the drbalance manager. See the module docstring.

    Arguments: ``model`` (a BalancedDataParallel), ``app`` (unique name in the namespace; None in a
    Slurm job: ``<SLURM_JOB_NAME>-<SLURM_JOB_ID>``; kept as ``job_app``; a DDP job spanning nodes is
    ``<app>@<node>`` to each node's manager, ``session.app``),
    ``epochs`` x ``iterations_per_epoch`` (the iteration plan; ``iterations_per_epoch`` may be the
    loader itself: its length is used), ``solo_time`` (None, the default: estimated online from the
    job's own measurements, its SD marked as estimated (``drbalance.solo_estimate``); seconds for
    the whole plan; or the name of a stored profile, scaled to this plan), ``start_epoch``
    (resuming from a checkpoint: epochs already done, default 0), ``report_every`` (iterations
    between records, default 5), ``decide_every`` (iterations between decisions besides epoch
    ends; default None = at epoch ends and when the manager's answer asks for the next decision),
    ``namespace`` (default ``DRBALANCE_NAMESPACE``), ``sd_log`` (path of the JSON Lines SD log;
    None = ``DRBALANCE_LOG_DIR/<app>.sd.jsonl``, False = no log), ``exchange_timeout`` (seconds
    to wait for the manager's answer, default 0.5), ``send_timeout`` (seconds a notice may wait
    for room in a full inbox, default 0.25), ``handle_sigterm`` (clean up on SIGTERM when
    no other handler is installed, then die of SIGTERM as before, at the latest
    ``DRBALANCE_EXIT_GRACE`` seconds later; default True; see ``drbalance.client.termination``).
    """

    def __init__(
        self,
        model: RatioTarget,
        app: str | None,
        epochs: int,
        iterations_per_epoch: int | Sized,
        solo_time: float | str | None = None,
        *,
        start_epoch: int = 0,
        report_every: int = 5,
        decide_every: int | None = None,
        namespace: str | None = None,
        sd_log: str | Path | bool | None = None,
        exchange_timeout: float = DEFAULT_EXCHANGE_TIMEOUT,
        send_timeout: float = DEFAULT_SEND_TIMEOUT,
        handle_sigterm: bool = True,
        clock: Clock | None = None,
        link: ManagerLink | None = None,
    ) -> None:
        if not (hasattr(model, "set_ratio") and hasattr(model, "ratio")):
            raise TypeError(f"Session steers a BalancedDataParallel; got {type(model).__name__}")
        self.job = JobSync.of(model)  # None unless a DDP job: then only its leader(s) talk to a manager
        # a job spanning nodes: each node's leader publishes its node's part as the app <app>@<node>
        self.model = self.job.steered if self.job is not None else model
        self.job_app = check_app_name(app if app is not None else _slurm_app_name())  # the name given
        self.app = self.job.app_name(self.job_app) if self.job is not None else self.job_app
        epochs, start_epoch = _whole(epochs), _whole(start_epoch)
        self.plan = IterationPlan(epochs, iterations_from(iterations_per_epoch))
        if isinstance(start_epoch, bool) or not isinstance(start_epoch, int) or not 0 <= start_epoch < epochs:
            raise ValueError(f"start_epoch must be an integer in 0..{epochs - 1} (epochs already done); "
                             f"got {start_epoch!r}")
        self.start_epoch = start_epoch
        self._extended = False
        self.report_every = _positive_int(report_every, "report_every")
        self.decide_every = _positive_int(decide_every, "decide_every", allow_none=True)
        for what, value in (("exchange_timeout", exchange_timeout), ("send_timeout", send_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{what} must be a finite number of seconds >= 0 (every wait is bounded); "
                                 f"got {value!r}")
        if len(self.model.ratio) > MAX_GPUS:
            raise ValueError(f"the model's DR has {len(self.model.ratio)} entries; the protocol carries at most "
                             f"{MAX_GPUS}")
        self.exchange_timeout = float(exchange_timeout)
        self.send_timeout = float(send_timeout)
        self.exit_grace = env.exit_grace()  # read before any IPC object exists: a bad value leaves nothing behind
        self._no_manager = env.no_manager()  # likewise
        self.clock = clock or SystemClock()
        self.measurement_output = env.profile_output()
        self.own_ratio = self.model.ratio
        self.solo: SoloTime | None = None  # None: estimated online (self.estimator)
        if self.measurement_output is not None:
            self._start_solo_measurement()
            self.solo = SoloTime(1.0, "measuring")  # unknown yet: this run measures it
        elif solo_time is not None:
            self.solo = resolve_solo_time(solo_time, self.plan.total)  # a profile: scaled to this plan
        backend_kind = getattr(getattr(model, "backend", None), "kind", None)
        self.estimator = None if self.solo is not None else SoloEstimator(parallel=backend_kind != "cpu")
        self.alone_window = AloneWindow()  # which GPUs the job had alone throughout the window (the estimate's)
        self.manager_solo: float | None = None  # the manager's estimate of the solo iteration (s; AppCommand)
        self.solo_basis: str | None = None if self.estimator is None else SHARED  # of the SD's solo time
        self.tracker = SlowdownTracker(self.plan, None if self.solo is None else self.solo.seconds,
                                       start=self.clock.monotonic(),
                                       done=start_epoch * self.plan.iterations_per_epoch,
                                       uncounted=_uncounted_time_of(model))
        self.start_wall = self.clock.wall()
        self.pid = os.getpid()
        self.start_ticks = objects.process_start_ticks(self.pid) or 0
        self.slot_window = SlotWindow(len(self.model.ratio))
        self.device_uuids = _device_uuids(self.model)
        self._last_push: AppCommand | None = None  # the last pushed command taken (applied or refused)
        self._cadence: float | None = None  # seconds between boundaries the manager asked for
        self._boundary_due: float | None = None  # monotonic time of the next such boundary
        self.min_share = 0  # DDP jobs: every rank keeps at least this share (units of the DR total)
        if self.job is not None:
            self.min_share = self.job.model.min_share  # one unit: at least one sample per rank and step
        self.memory_per_sample: list[float | None] = [None] * len(self.model.ratio)  # bytes, per slot
        self.max_samples: list[int | None] = [None] * len(self.model.ratio)  # largest chunk that fitted after an OOM
        self.notice_seq = 0
        self.applied_generation = 0
        self._awaiting: int | None = None
        self._awaiting_sent = 0.0  # wall-clock time the awaited notice was sent
        self._late_answers = 0  # notices in a row not answered within the wait (LATE_ANSWERS_BEFORE_SHORT_WAITS)
        self._attached_pid = 0
        self._warned_absent = False
        self._warned_closed = False
        self._warned_log = False  # the SD log could not be written (warned once)
        self._log_checked = -math.inf  # monotonic time the SD log's path was last compared with the open file
        self._last_manager_look = self.clock.monotonic()
        self._closed = False
        self._closing = False
        self._state = AppState.STARTING
        self.names = IpcNames.current(namespace)
        follower = self.job is not None and not self.job.leader
        self._previous_sigterm: Any = None
        # the log first: a log path that cannot be used (a symbolic link, another user's file) is
        # refused before any IPC object or name claim exists
        self.log = self._open_log(False if follower else sd_log)
        try:
            self.link = link if link is not None else DetachedLink() if follower else self._default_link()
        except BaseException:
            self._close_log()
            raise
        try:
            if handle_sigterm:
                self._install_sigterm_handler()
            atexit.register(self.close)
            solo_source = self.solo.describe() if self.solo is not None else {"solo_time_source": "estimated"}
            self._write_log("start", self.clock.monotonic(), solo_time=self.tracker.solo_time, **solo_source,
                            epochs=self.plan.epochs, iterations_per_epoch=self.plan.iterations_per_epoch,
                            start_epoch=start_epoch, namespace=self.names.namespace,
                            measuring=self.measurement_output is not None)
            self._exchange(NoticeKind.REGISTER, self.clock.monotonic())
            self._synchronize(self.clock.monotonic())
        except BaseException:  # e.g. SIGTERM while registering: leave nothing behind (record, claim)
            self._abandon()
            raise

    # --- set-up -------------------------------------------------------------------------------
    def _default_link(self) -> ManagerLink:
        if self.measurement_output is not None or self._no_manager:
            return DetachedLink()
        try:
            return AutoLink(self.names, self.app, self.clock)
        except (OSError, posix_ipc.Error) as error:  # no /dev/shm, full, or refusing this user: train on alone
            logger.warning("drbalance: POSIX IPC unavailable (%s); training %r with its own DR %s",
                           error, self.app, self.own_ratio)
            return DetachedLink()

    def _open_log(self, sd_log: str | Path | bool | None) -> JsonLinesWriter | None:
        if sd_log is False:
            return None
        path = Path(sd_log) if isinstance(sd_log, (str, Path)) else env.log_dir() / f"{self.app}.sd.jsonl"
        try:
            writer = JsonLinesWriter(path, flush_every=64, flush_seconds=SD_LOG_FLUSH_SECONDS, open_later=True)
        except UnsafePath as error:  # another user could choose where it goes: refused, saying what to do
            raise UnsafePath(error.path, f"{error.reason}. The SD log {path} is not written there: give another "
                             f"path (Session(sd_log=...) or DRBALANCE_LOG_DIR), or sd_log=False") from None
        if writer.error is not None:  # e.g. a full disk: training goes on, the lines wait in memory
            self._warned_log = True
            logger.warning("drbalance: cannot open the SD log %s (%s); its lines are kept in memory and written "
                           "once it can be opened", path, writer.error)
        return writer

    def _start_solo_measurement(self) -> None:
        ratio = self.model.ratio
        if self.job is not None and self.job.model.world_size > 1:
            raise ValueError("drbalance profile measures one process on one GPU; profile a DistributedDataParallel "
                             "job's model with a single rank (torchrun --nproc_per_node 1 ...)")
        self.model.set_ratio(DataRatio.single(len(ratio), 0, ratio.total))
        self.measure_iterations = env.profile_iterations()
        self.measure_warmup = env.profile_warmup()
        self.measured_times: list[float] = []

    def _install_sigterm_handler(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        chained = getattr(previous, "_drbalance_session", False)
        if previous is not signal.SIG_DFL and not chained:
            return  # the user's own handler stays; cleanup then comes from atexit or the manager's GC

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            # No I/O here: raise, and let the script's normal flow (with/finally/atexit) close the session.
            if os.getpid() != self.pid:  # a forked child (a DataLoader worker): it dies of SIGTERM, as without us
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            if not self._closed:
                Termination.requested()
                raise SessionTerminated()
            if self._closing:
                Termination.requested()  # closing right now: let it finish; die of SIGTERM at exit
                return
            if callable(previous):  # this session is closed; an earlier session's handler decides
                previous(signum, frame)
            else:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

        on_sigterm._drbalance_session = True  # type: ignore[attr-defined]
        Termination.arm(self.exit_grace)
        signal.signal(signal.SIGTERM, on_sigterm)
        self._previous_sigterm = (on_sigterm, previous)

    # --- what the training loop calls --------------------------------------------------------
    def step(self) -> None:
        """Call once per iteration, after the optimizer step. Never raises for running past the plan.

        Raises ``SessionTerminated`` again after a SIGTERM whose exception did not end the script
        (raised while a ``__del__`` ran, Python prints "Exception ignored" and goes on).
        """
        if Termination.pending and not self._closed:
            raise SessionTerminated()
        if self._closed:
            if not self._warned_closed:
                self._warned_closed = True
                logger.warning("drbalance: session %r is closed; step() does nothing (training goes on with DR %s)",
                               self.app, self.model.ratio)
            return
        now = self.clock.monotonic()
        if self.tracker.finished:
            self._extend(now)
        duration = self.tracker.iteration_finished(now)
        self._state = AppState.RUNNING
        if self.measurement_output is not None:
            self._measure_step(duration)
        if self.tracker.finished:
            self._finish(now)
            return
        done = self.tracker.done
        if (done % self.plan.iterations_per_epoch == 0 or (self.decide_every and done % self.decide_every == 0)
                or (self._boundary_due is not None and now >= self._boundary_due)):
            self._boundary(now)
        elif done % self.report_every == 0:
            self._report(now)
        elif self.link.command_signalled():  # e.g. the other half of a swap: applied now, not at the next report
            self._take_command(now)
        else:
            return
        self._synchronize(now)

    @property
    def slowdown(self) -> float | None:
        """The current SD (Eq. 2), or None before an iteration time is known."""
        return self.tracker.slowdown(self.clock.monotonic())

    @property
    def attached(self) -> bool:
        """Whether the last exchange reached a manager."""
        return self._attached_pid != 0

    def close(self) -> None:
        """Leave: tell the manager (if the run is not finished), remove this app's IPC objects.

        In a process forked from the job (``os.fork``; its exit runs ``with`` blocks and atexit)
        the session is the job's, not the child's: the child only stops using its copy. It tells
        the manager nothing, removes nothing and writes no SD-log line (its copy of the log's
        buffer holds the job's lines, which the job writes itself).
        """
        if self._closed:
            return
        if os.getpid() != self.pid:
            self._closed = True
            self._restore_sigterm_handler()
            atexit.unregister(self.close)
            return
        self._closed = self._closing = True
        try:
            now = self.clock.monotonic()
            if self._state != AppState.FINISHED:
                self._state = AppState.FINISHED
                self._exchange(NoticeKind.FINISH, now)
            self.link.close()
            self._log_reverts(now)  # one survived since the last report would otherwise be lost
            self._write_log("closed", now)
            self._close_log()
        finally:
            self._closing = False
            self._restore_sigterm_handler()
            atexit.unregister(self.close)

    def _abandon(self) -> None:
        """Undo a set-up that failed part way: the link's IPC objects and name claim, the log,
        the SIGTERM handler (nothing is sent to the manager: the app never finished registering)."""
        self._closed = True
        try:
            self.link.close()
        finally:
            self._close_log()
            self._restore_sigterm_handler()
            atexit.unregister(self.close)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- reports and boundaries ---------------------------------------------------------------
    def _status(self, now: float) -> AppStatus:
        tracker = self.tracker
        return AppStatus(
            pid=self.pid, app=self.app, state=self._state, ratio=self._steered_ratio(),
            epoch=tracker.epoch, epochs=self.plan.epochs, iteration=tracker.done,
            iterations_total=self.plan.total, iterations_per_epoch=self.plan.iterations_per_epoch,
            notice_seq=self.notice_seq, slowdown=tracker.slowdown(now),
            iteration_time=tracker.mean_iteration_time, solo_time=tracker.solo_time or UNKNOWN_SOLO_SECONDS,
            start_wall=self.start_wall, updated_wall=self.clock.wall(), updated_mono=now,
            start_ticks=self.start_ticks, batch=self._last_batch(), min_share=self.min_share,
            slots=self._slot_statuses(), solo_estimated=self.estimator is not None,
            solo_basis=self._published_basis(),
        )

    def _steered_ratio(self) -> DataRatio:
        """The DR the manager should count as the job's: the model's; for a DDP job, the one it
        has proposed to its ranks if that is still on its way (the next control exchange carries
        it). Published as the model's in force instead, a manager that decides again before the
        exchange sees the old DR, keeps it, and its "keep" (sent as the job has it) withdrew the
        proposal: the job never took the manager's DR."""
        return self.job.ratio if self.job is not None else self.model.ratio

    @property
    def sd_bound(self) -> bool:
        """Whether the SD is a lower bound, not the SD: its solo time is the job's own online
        estimate, which can still only be too high (``drbalance.solo_estimate``); never while it
        uses the manager's estimate."""
        if self.estimator is None or self.solo_basis == MANAGER:
            return False
        estimate = self.estimator.estimate
        return estimate is None or estimate.upper_bound

    def _published_basis(self) -> str | None:
        """The record's ``solo_basis``: None for a solo time given, the ``manager``'s estimate, or
        the job's own: ``shared`` while it is a bound (``sd_bound``), else ``alone``."""
        if self.estimator is None:
            return None
        if self.solo_basis == MANAGER:
            return MANAGER
        return SHARED if self.sd_bound else ALONE

    def _last_batch(self) -> int:
        sizes = getattr(self.model, "last_chunk_sizes", None)
        return int(sum(sizes)) if sizes else 0

    def _slot_statuses(self) -> tuple[SlotStatus, ...]:
        means = self.slot_window.means()
        if len(means) != len(self.model.ratio):
            return ()
        return tuple(
            SlotStatus(uuid, mean[0] if mean else None, mean[1] if mean else 0.0, memory, largest)
            for uuid, mean, memory, largest in zip(self.device_uuids, means, self.memory_per_sample, self.max_samples)
        )

    def _sample_replicas(self) -> None:
        """Add the last forward's per-replica timings to the window (on CUDA this waits for it);
        refine the estimated solo time, if the session has no other."""
        timings = getattr(self.model, "last_replica_timings", None)
        if timings is not None:
            self.slot_window.add(timings())
        if self.estimator is not None:
            self._estimate_solo_time()

    def _estimate_solo_time(self) -> None:
        """The solo time from the window's iteration and chunk times (``drbalance.solo_estimate``)."""
        alone = self.alone_window.update(_slots_alone(self.model))
        slots = [None if mean is None else SlotSample(mean[0], mean[1], alone[slot])
                 for slot, mean in enumerate(self.slot_window.means())]
        self.estimator.observe(self.tracker.mean_iteration_time, self._last_batch(), slots)
        self._choose_solo()

    def _choose_solo(self) -> None:
        """The SD's solo time: the job's own estimate, or the manager's where the job had no GPU
        alone (``chosen_solo``)."""
        chosen = chosen_solo(self.estimator.estimate, self.manager_solo)
        if chosen is not None and chosen[0] > 0:
            self.tracker.set_solo_time(chosen[0] * self.plan.total)
            self.solo_basis = chosen[1]

    def _sample_memory(self, now: float) -> None:
        """Per slot: peak memory per sample (the last measured value stands), the out-of-memory
        limits, and a log line for every out-of-memory error the model survived."""
        measure = getattr(self.model, "memory_per_sample", None)
        if callable(measure):
            for slot, value in enumerate(measure()):
                if value is not None and slot < len(self.memory_per_sample):
                    self.memory_per_sample[slot] = float(value)
        limits = getattr(self.model, "max_samples", None)
        if limits is not None and len(limits) == len(self.max_samples):
            self.max_samples = list(limits)
        self._log_reverts(now)

    def _log_reverts(self, now: float) -> None:
        """An ``oom_revert`` line for every out-of-memory error the model survived since the last call."""
        take = getattr(self.model, "take_reverts", None)
        for revert in take() if callable(take) else ():
            self._write_log("oom_revert", now, failed_dr=revert.failed_ratio.to_list(), new_dr=revert.ratio.to_list(),
                            slot=revert.slot, phase=revert.phase, failed_sizes=list(revert.failed_sizes),
                            max_samples=list(revert.max_samples), error=revert.message[:300])

    def _report(self, now: float) -> None:
        self._sample_replicas()
        self._sample_memory(now)
        self._take_command(now)
        self.link.publish(self._status(now))
        self._write_log("report", now)
        if not self.attached and now - self._last_manager_look > 5.0:
            self._last_manager_look = now
            if self.link.manager() is not None:
                self._exchange(NoticeKind.REGISTER, now)

    def _take_command(self, now: float) -> None:
        """Apply a command that arrived outside an exchange: a late answer, or a DR the manager
        pushed as part of a decision about several apps (never waits)."""
        if self._awaiting is None and not self.attached:
            return
        command = self.link.poll_command(self.notice_seq if self._awaiting is None else self._awaiting)
        if command is not None and (command.pushed or self._awaiting is not None):
            if not command.pushed and command.written_wall - self._awaiting_sent <= self.exchange_timeout:
                self._answer_in_time(now)  # only a short wait missed it: the manager keeps up again
            self._accept(command, now, late=True)

    def _take_push(self, now: float) -> None:
        """Apply a DR the manager pushed since this app last looked (the other half of a swap that
        reached the record during this iteration) before the boundary's exchange: the exchange's
        answer overwrites the record's command, and the push would be lost while the manager and
        the simulator take it as applied. A late answer is not taken here: the boundary's notice
        replaces it (docs/protocol.md)."""
        if not self.attached:
            return
        command = self.link.poll_command(self.notice_seq)
        if command is not None and command.pushed:
            self._accept(command, now)

    def _accept(self, command: AppCommand, now: float, late: bool = False) -> None:
        """Apply a command read from the record. A pushed DR is applied once and leaves an awaited
        answer awaited: the manager stamps a push with the app's latest notice, so it can reach
        the app before the answer to that notice does. The record holds the manager's latest
        command only, so a push seen before is the one taken last: it is told by its content, not
        by comparing write times (the manager's wall clock may step back)."""
        if not command.pushed:
            self._apply(command, now, late=late)
        elif command != self._last_push:
            self._last_push = command
            self._apply(command, now)

    def _boundary(self, now: float) -> None:
        self._sample_replicas()
        self._sample_memory(now)
        self._take_push(now)
        self._boundary_due = None if self._cadence is None else now + self._cadence
        self._write_log("boundary", now)
        self._exchange(NoticeKind.BOUNDARY, now)
        self.tracker.new_window()
        self.slot_window.new_window()
        self.alone_window.new_window()

    def _finish(self, now: float) -> None:
        """The planned end: tell the manager (its GPUs are free for others); stay open until closed."""
        self._state = AppState.FINISHED
        self._write_log("finish", now)
        if self.measurement_output is not None:
            self._write_measurement()
        self._exchange(NoticeKind.FINISH, now)
        self._awaiting = None

    def _extend(self, now: float) -> None:
        """Training goes on past the plan: one more epoch, one warning, back in the manager's table."""
        plan = self.plan
        self.plan = IterationPlan(plan.epochs + 1, plan.iterations_per_epoch)
        self.tracker.extend(self.plan)
        if not self._extended:
            self._extended = True
            logger.warning(
                "drbalance: %r ran past its plan of %d epochs x %d iterations; the plan now grows by one epoch "
                "at a time (SD estimates assume each new end). Give the real plan, e.g. "
                "Session(..., iterations_per_epoch=loader).", self.app, plan.epochs, plan.iterations_per_epoch)
        self._write_log("extended", now, epochs=self.plan.epochs)
        self._state = AppState.RUNNING
        self._exchange(NoticeKind.REGISTER, now)

    def _exchange(self, kind: NoticeKind, now: float) -> None:
        """Publish, notify, and (except for FINISH) wait a bounded time for the new DR."""
        self._last_manager_look = now
        beat = self.link.manager()
        if beat is None:
            self._lost_manager(now, reason=getattr(self.link, "problem", "") or "none is running")
            self.link.publish(self._status(now))
            return
        self.notice_seq += 1
        self.link.publish(self._status(now))
        notice = Notice(kind, self.pid, self.notice_seq, self.app, self.clock.wall())
        if not self.link.notify(notice, self.send_timeout):
            self._lost_manager(now, reason="its inbox did not accept a notice in time")
            return
        if self._attached_pid != beat.pid:
            self._attached_pid, self._warned_absent, self._late_answers = beat.pid, False, 0
            logger.info("drbalance: %r attached to the manager (pid %d)", self.app, beat.pid)
            self._write_log("attached", now, manager_pid=beat.pid)
        if kind == NoticeKind.FINISH:
            return
        self._awaiting = self.notice_seq  # this notice's answer replaces any older one awaited
        self._awaiting_sent = notice.sent_wall
        wait = self._answer_wait()
        command = self.link.await_command(self.notice_seq, wait)
        if command is None:  # a late answer is applied when it arrives
            self._write_log("no_answer", now, generation=self.notice_seq, waited=wait)
            self._answer_late(now)
            return
        self._answer_in_time(now)
        self._accept(command, self.clock.monotonic())

    def _answer_wait(self) -> float:
        """Seconds to wait for the manager's answer: ``exchange_timeout``, or a share of it while
        the manager is slow (``LATE_ANSWERS_BEFORE_SHORT_WAITS``)."""
        if self._late_answers >= LATE_ANSWERS_BEFORE_SHORT_WAITS:
            return self.exchange_timeout * SHORT_WAIT_SHARE
        return self.exchange_timeout

    def _answer_late(self, now: float) -> None:
        if not self.exchange_timeout:
            return  # a job that never waits has nothing to shorten
        self._late_answers += 1
        if self._late_answers == LATE_ANSWERS_BEFORE_SHORT_WAITS:
            wait = self._answer_wait()
            logger.warning("drbalance: the manager answered none of the last %d notices of %r within %.2f s; it "
                           "waits at most %.3f s at a boundary until an answer comes in time again (late answers "
                           "are applied when they arrive)", self._late_answers, self.app, self.exchange_timeout, wait)
            self._write_log("slow_manager", now, late=self._late_answers, wait=wait)

    def _answer_in_time(self, now: float) -> None:
        if self._late_answers >= LATE_ANSWERS_BEFORE_SHORT_WAITS:
            logger.info("drbalance: the manager answers %r in time again", self.app)
            self._write_log("manager_in_time", now, late=self._late_answers)
        self._late_answers = 0

    def _apply(self, command: AppCommand, now: float, late: bool = False) -> None:
        self.applied_generation = command.generation
        if command.solo_iteration is not None and self.estimator is not None:
            self.manager_solo = command.solo_iteration
            self._choose_solo()
        if not command.pushed:  # an answer: nothing awaited now; a pushed DR leaves the cadence as it was
            self._awaiting = None
            self._cadence = command.next_boundary
            self._boundary_due = None if self._cadence is None else now + self._cadence
        target: RatioTarget = self.job if self.job is not None else self.model
        current = target.ratio
        if len(command.ratio) != len(current):
            logger.warning("drbalance: manager sent %r a DR of %d GPUs, the model has %d; ignored",
                           self.app, len(command.ratio), len(current))
            self._refuse(command, now)
            return
        if command.ratio != current:
            try:
                target.set_ratio(command.ratio)
            except ValueError as error:  # e.g. a DDP rank left below its minimum share
                logger.warning("drbalance: %r ignored the manager's DR %s: %s", self.app, command.ratio, error)
                self._refuse(command, now, error=str(error))
                return
            self._write_log("update", now, generation=command.generation, branch=command.branch,
                            old_dr=current.to_list(), new_dr=command.ratio.to_list(), late=late,
                            pushed=command.pushed)
            self.tracker.new_window()  # the iteration and chunk times measured from now on are the new DR's
            self.slot_window.new_window()
            self.alone_window.new_window()

    def _refuse(self, command: AppCommand, now: float, **extra: Any) -> None:
        """Log a DR the job did not take and publish at once: the manager counts the DR it sent as
        the app's until the app publishes a newer status, and would go on deciding for other apps
        with this one where it is not."""
        self._write_log("rejected", now, generation=command.generation, new_dr=command.ratio.to_list(), **extra)
        self.link.publish(self._status(now))

    def _synchronize(self, now: float) -> None:
        """DDP jobs: log the DRs every rank has taken from rank 0 since the last call (no-op otherwise)."""
        if self.job is None:
            return
        for ratio, start, extra in self.job.synchronize():
            self._write_log("applied", now, applied_dr=ratio.to_list(), from_batch=start, **extra)

    def _lost_manager(self, now: float, reason: str = "none is running") -> None:
        if self._attached_pid:
            self._write_log("detached", now, manager_pid=self._attached_pid)
        self._attached_pid = 0
        self._awaiting = None
        self._cadence = self._boundary_due = None
        if getattr(self.link, "objects_pending", False):
            return  # the link said why no manager can reach this job (e.g. /dev/shm full): one warning
        if not self._warned_absent and self.measurement_output is None and not isinstance(self.link, DetachedLink):
            self._warned_absent = True
            logger.warning("drbalance: no manager in namespace %r (%s); %r trains on with DR %s",
                           self.names.namespace, reason, self.app, self.model.ratio)

    # --- logs and solo-measurement mode ------------------------------------------------------------------
    def _write_log(self, event: str, now: float, **extra: Any) -> None:
        if self.log is None:
            return
        if now - self._log_checked >= LOG_CHECK_SECONDS:
            self._log_checked = now
            if self.log.reopen_if_replaced():
                logger.warning("drbalance: the SD log %s was removed or replaced while %r ran; its lines go to a "
                               "new file at that path", self.log.path, self.app)
        tracker = self.tracker
        ratio = self.model.ratio
        record = {
            "t": self.clock.wall(), "elapsed": now - tracker.start, "event": event, "app": self.app,
            "pid": self.pid, "epoch": tracker.epoch, "iteration": tracker.done,
            "iterations_total": self.plan.total, "sd": tracker.slowdown(now),
            "iter_time": tracker.mean_iteration_time, "dr": ratio.to_list(), "dr_total": ratio.total,
        }
        uncounted = tracker.uncounted_at(now)
        if uncounted > 0:  # emulated GPUs: this machine's time the SD leaves out
            record["uncounted"] = uncounted
        if self.estimator is not None:  # the SD's solo time is estimated: the job's own estimate or the manager's
            record.update(solo_estimated=True, solo_time=tracker.solo_time,
                          solo_basis=None if tracker.solo_time is None else self.solo_basis, sd_bound=self.sd_bound)
        record.update(extra)
        self.log.write(record)
        if event != "report":
            self.log.flush()
        if self.log.error is not None and not self._warned_log:
            self._warned_log = True
            logger.warning("drbalance: cannot write the SD log %s (%s); its lines wait in memory and are written "
                           "when it can be", self.log.path, self.log.error)

    def _close_log(self) -> None:
        """Close the SD log (one last write); warn if lines are lost (e.g. the disk is still full)."""
        if self.log is None:
            return
        error = self.log.error
        lost = self.log.close()
        if lost:
            logger.warning("drbalance: %d line(s) of the SD log %s could not be written and are lost (%s)",
                           lost, self.log.path, self.log.error or error or "no room")

    def _measure_step(self, duration: float) -> None:
        self.measured_times.append(duration)
        if len(self.measured_times) >= self.measure_iterations and not self.tracker.finished:
            self._write_measurement()
            self.close()
            raise MeasurementComplete()

    def _write_measurement(self) -> None:
        device = getattr(self.model, "backend", None)
        labels = getattr(self.model, "device_labels", None)  # a DDP job's, one per rank: its one rank here
        if device is not None:
            label = device.describe(self.model.device_ids, 0)
        else:
            label = labels[0] if labels else "unknown"
        Measurement(self.measured_times, self.measure_warmup, self.plan.total, label).write(self.measurement_output)

    def _restore_sigterm_handler(self) -> None:
        if not self._previous_sigterm or threading.current_thread() is not threading.main_thread():
            return
        mine, previous = self._previous_sigterm
        if signal.getsignal(signal.SIGTERM) is mine:
            signal.signal(signal.SIGTERM, previous)
        self._previous_sigterm = None


def _device_uuids(model: RatioTarget) -> tuple[str, ...]:
    """The GPU UUID of each DR slot, when the model can tell ("" where unknown)."""
    count = len(model.ratio)
    method = getattr(model, "device_uuids", None)
    uuids = tuple(method()) if callable(method) else ()
    if len(uuids) != count:
        return ("",) * count
    return tuple(str(uuid) for uuid in uuids)


def _slots_alone(model: RatioTarget) -> tuple[bool | None, ...]:
    """Per DR slot: whether the job has the slot's GPU alone (None: not known), as the model's backend tells."""
    count = len(model.ratio)
    method = getattr(getattr(model, "backend", None), "slots_alone", None)
    alone = tuple(method(model.device_ids)) if callable(method) else ()
    return alone if len(alone) == count else (None,) * count


def _uncounted_time_of(model: RatioTarget) -> Callable[[], float] | None:
    """The model's backend's ``uncounted_seconds`` (the time its SD leaves out), if it has one."""
    method = getattr(getattr(model, "backend", None), "uncounted_seconds", None)
    return method if callable(method) else None
