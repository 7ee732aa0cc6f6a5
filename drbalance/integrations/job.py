"""What the Lightning and Accelerate integrations share: the job's settings, its session, its emulated GPU.

A framework builds the DDP model and the loader; drbalance then needs, on every rank of the job,
a ``Session`` opened with the same plan (epochs x global batches per epoch). :func:`open_job_session`
opens rank 0's first (it alone talks to the manager and may find the app's name taken) and tells
the other ranks, through the framework's own broadcast, the name it got or why it failed: every
rank then opens its own or raises the same error, instead of waiting in the next collective for
a rank 0 that gave up. This module imports neither framework.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from drbalance import env
from drbalance.client.distributed import BalancedDistributedDataParallel
from drbalance.client.session import Session
from drbalance.ipc.discovery import AppNameInUse
from drbalance.ipc.names import check_app_name

logger = logging.getLogger("drbalance.integrations")

SESSION_OPTIONS = ("report_every", "decide_every", "namespace", "sd_log", "exchange_timeout", "send_timeout",
                   "handle_sigterm")
"""``Session`` keyword arguments an integration passes through (``session_options=``); see docs/client.md."""

MAX_APP_NAME = 48
"""The longest app name the manager takes (``drbalance.ipc.names.APP_NAME_PATTERN``)."""


def missing_extra(extra: str, framework: str, error: ImportError) -> ImportError:
    """The error an integration raises when its framework cannot be imported: it names the extra."""
    return ImportError(f"drbalance.integrations.{extra} needs {framework}, which could not be imported ({error}); "
                       f"install it with: pip install 'drbalance[{extra}]'")


def app_name_from(text: str) -> str:
    """``text`` (a logger's name, a script's) as an app name the manager takes: other characters
    become ``-``, a leading ``.`` or ``-`` is dropped, at most 48 characters ("job" if nothing is left)."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", text).lstrip(".-")[:MAX_APP_NAME]
    return name or "job"


def with_pid(name: str, pid: int) -> str:
    """``name-<pid>``, shortened so that it stays a valid app name."""
    suffix = f"-{pid}"
    return name[:MAX_APP_NAME - len(suffix)] + suffix


@dataclass(frozen=True)
class JobSettings:
    """What the user gave an integration for the job's session, checked when given.

    ``app``: the app's name (None: derived by the integration, with the pid appended when the
    derived name is taken); ``solo_time``: seconds alone or a stored profile's name (None:
    estimated online); ``options``: further ``Session`` keyword arguments (:data:`SESSION_OPTIONS`).
    """

    app: str | None = None
    solo_time: float | str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.app is not None:
            check_app_name(self.app)
        unknown = sorted(set(self.options) - set(SESSION_OPTIONS))
        if unknown:
            raise TypeError(f"session_options: unknown Session argument(s) {unknown}; known: {list(SESSION_OPTIONS)}")
        object.__setattr__(self, "options", dict(self.options))


@dataclass(frozen=True)
class JobPlan:
    """The iteration plan every rank opens its session with: global batches, not optimizer steps."""

    epochs: int
    iterations_per_epoch: int
    start_epoch: int = 0


Broadcast = Callable[[Any], Any]
"""Rank 0's value, returned on every rank of the job (a collective: every rank calls it)."""


def open_job_session(model: BalancedDistributedDataParallel, plan: JobPlan, settings: JobSettings,
                     default_app: str, broadcast: Broadcast) -> Session:
    """Open this rank's ``Session``: rank 0's first, then the others', all with the same app and plan.

    ``default_app`` is used when ``settings.app`` is None; if a live job already holds it, rank 0
    takes ``<default_app>-<pid>`` instead. A name given by the user that is taken, a profile that
    does not exist or a bad option is raised on rank 0 as it is and on the other ranks as a
    ``RuntimeError`` quoting it.
    """
    if model.rank == 0:
        session: Session | None = None
        failure: BaseException | None = None
        try:
            session = _open_leader(model, plan, settings, default_app)
        except Exception as error:  # told to the other ranks, then raised here
            failure = error
        # the name given (a job spanning nodes: without the "@<node>" of rank 0's own node)
        told = ("ok", session.job_app) if session is not None else ("failed", f"{type(failure).__name__}: {failure}")
        broadcast(told)
        if failure is not None:
            raise failure
        return session
    outcome, detail = broadcast(None)
    if outcome != "ok":
        raise RuntimeError(f"drbalance: rank 0 could not open the job's session, so this rank does not train "
                           f"either: {detail}")
    return _session(model, detail, plan, settings)


def _open_leader(model: BalancedDistributedDataParallel, plan: JobPlan, settings: JobSettings,
                 default_app: str) -> Session:
    if settings.app is not None:
        return _session(model, settings.app, plan, settings)
    try:
        return _session(model, default_app, plan, settings)
    except AppNameInUse:
        named = with_pid(default_app, os.getpid())
        logger.info("drbalance: app name %r is taken; this job is %r", default_app, named)
        return _session(model, named, plan, settings)


def _session(model: BalancedDistributedDataParallel, app: str, plan: JobPlan, settings: JobSettings) -> Session:
    return Session(model, app, plan.epochs, plan.iterations_per_epoch, settings.solo_time,
                   start_epoch=plan.start_epoch, **settings.options)


def emulated_rank_device(device: torch.device, local_rank: int) -> Any:
    """This rank's emulated GPU (``EmulatedRankDevice``, costs estimated from its first forward) when
    it trains on the CPU and ``DRBALANCE_EMULATED_GPUS`` is set; else None. Local rank i holds
    emulated device i of those the process sees (``drbalance.emu.view``: the machine's or the
    user's, as ``CUDA_VISIBLE_DEVICES`` shows them); ``ValueError`` when there are fewer than local
    ranks."""
    spec_text = env.emulated_gpus()
    if device.type != "cpu" or not spec_text:
        return None
    from drbalance.client.emulated_rank import EmulatedRankDevice
    from drbalance.emu.gpus import emulated_spec
    from drbalance.emu.view import emulated_view

    spec = emulated_spec()
    view = emulated_view(spec.count, spec.memory_bytes)
    if not 0 <= local_rank < view.count:
        raise ValueError(f"local rank {local_rank} has no emulated GPU: DRBALANCE_EMULATED_GPUS={spec_text} gives "
                         f"{view.describe()}; give at least one per rank of this node")
    return EmulatedRankDevice(local_rank, None, memory_bytes=spec.memory_bytes, count=spec.count)


def emulated_device_options(device: Any) -> dict[str, str]:
    """``BalancedDistributedDataParallel``'s ``device_label``/``device_uuid`` for an emulated GPU (none for None)."""
    return {} if device is None else {"device_label": device.label, "device_uuid": device.uuid}
