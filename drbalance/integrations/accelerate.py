"""drbalance in Hugging Face Accelerate: ``BalancedAccelerator(epochs=N)`` in place of ``Accelerator()``.

    from drbalance.integrations.accelerate import BalancedAccelerator

    accelerator = BalancedAccelerator(epochs=10)      # the only change: was Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in range(10):
        for images, labels in loader:
            loss = criterion(model(images), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

``prepare`` then builds what plain Accelerate builds, with drbalance's parts where DDP is:

- a model is wrapped in :class:`~drbalance.client.BalancedDistributedDataParallel` (with the
  ``DistributedDataParallelKwargs`` given), not ``DistributedDataParallel``; models are prepared
  before the other objects of the same ``prepare`` call, whatever their order;
- a *shuffled* loader (``shuffle=True``, a ``RandomSampler`` or a shuffling ``DistributedSampler``:
  a training loader) is remade by :func:`~drbalance.client.balanced_loader` on the job's model
  (the first prepared): each global batch (``batch_size`` x the processes, or ``batch_size`` with
  ``split_batches``) is split by the job's DR; it still places batches on the device, counts
  epochs (``set_epoch``) and tells ``accumulate()`` where the loader ends, as Accelerate's own
  loader does. An in-order loader (evaluation, whose outputs ``gather_for_metrics`` joins) is
  sharded evenly as plain Accelerate does; ``prepare_data_loader(loader, balanced=True/False)`` decides
  by hand;
- the job's :class:`~drbalance.client.Session` opens on every rank when the balanced loader is
  first iterated: the plan is ``epochs`` x ``len(loader)`` global batches, starting at the
  loader's epoch (``loader.set_epoch(k)`` when resuming); one iteration per batch (counted when
  the next batch is asked for, and when the loader ends); it closes at ``end_training()``, at the
  end of its plan (it then tells the manager it is done), or when the process exits;
- with ``DRBALANCE_EMULATED_GPUS`` set and processes on the CPU: local process i holds emulated
  GPU i for its modelled time (costs estimated from its first forward).

With one process it trains as ``Accelerator`` does (with a warning); a distributed type other
than DDP over CPUs or CUDA GPUs (FSDP, DeepSpeed, XLA, ...) is refused: use ``Accelerator`` there. Needs ``pip install
'drbalance[accelerate]'``; see docs/integrations.md.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from drbalance.client.distributed import BalancedDistributedDataParallel
from drbalance.client.loader import balanced_loader, carried_settings
from drbalance.client.session import Session
from drbalance.integrations import job
from drbalance.ratio import DataRatio

try:
    from accelerate import Accelerator
    from accelerate.data_loader import DataLoaderShard
    from accelerate.utils import DistributedType, DynamoBackend, broadcast_object_list
    from accelerate.utils.dataclasses import DDPCommunicationHookType
except ImportError as error:
    raise job.missing_extra("accelerate", "Hugging Face Accelerate", error) from error

logger = job.logger

BALANCED_TYPES = (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
"""Accelerate's distributed types where it builds DDP, so drbalance can build its own instead."""


class BalancedAccelerator(Accelerator):
    """An ``Accelerator`` whose ``prepare`` builds drbalance's DDP model, balanced loader and session.

    Keyword arguments, besides all of ``Accelerator``'s:

    - ``epochs``: the epochs the script trains (the session's plan; required);
    - ``app``: the job's name for the manager (default: the script's file name, with ``-<pid>``
      appended when a live job already holds it);
    - ``solo_time``: seconds alone for the whole plan, or a stored profile's name (default:
      estimated online, docs/profiles.md);
    - ``ratio``, ``exchange_every``, ``loss_reduction``: ``BalancedDistributedDataParallel``'s;
    - ``session_options``: further ``Session`` arguments (``report_every``, ``decide_every``,
      ``namespace``, ``sd_log``, ``exchange_timeout``, ``send_timeout``, ``handle_sigterm``).

    ``ValueError`` for a distributed type other than DDP (FSDP, DeepSpeed, ...), a
    ``DistributedDataParallelKwargs`` communication hook (the sample weighting is the hook) or a
    ``dynamo_backend`` (not supported yet). With one process it warns and trains as ``Accelerator``
    (``balancing`` is False: no wrapper, no balanced loader, no session).
    """

    def __init__(self, *args: Any, epochs: int, app: str | None = None, solo_time: float | str | None = None,
                 ratio: DataRatio | Sequence[float] | None = None, exchange_every: int | None = None,
                 loss_reduction: str = "mean", session_options: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> None:
        if isinstance(epochs, bool) or not isinstance(epochs, numbers.Integral) or epochs < 1:
            raise ValueError(f"epochs (the epochs this script trains: the session's plan) must be a positive "
                             f"integer; got {epochs!r}")
        settings = job.JobSettings(app, solo_time, session_options or {})
        super().__init__(*args, **kwargs)
        self.balancing = self._check_supported()
        self.epochs = int(epochs)
        self._job = settings
        self._balance_options = {"ratio": ratio, "exchange_every": exchange_every, "loss_reduction": loss_reduction}
        self._job_model: BalancedDistributedDataParallel | None = None
        self._session: Session | None = None
        self._session_loader: Any = None  # the balanced loader whose batches the session counts
        self._batch_open = False  # a batch of that loader was handed out and its session.step() is due
        self._emulated: Any = None

    def _check_supported(self) -> bool:
        """Whether this run is balanced (DDP over several processes); ``ValueError`` for what cannot be."""
        if self.distributed_type == DistributedType.NO:
            logger.warning("drbalance: one process has no ranks to balance; BalancedAccelerator trains as Accelerator "
                           "does. For N processes start it with 'torchrun --nproc_per_node N' or 'accelerate launch "
                           "--multi_gpu --num_processes N' (with Accelerator(cpu=True) on CPUs too); 'accelerate "
                           "launch --cpu --num_processes N' starts one process unless mpirun starts the others")
            return False
        if self.distributed_type not in BALANCED_TYPES:
            raise ValueError(f"BalancedAccelerator balances DDP jobs over CPUs or CUDA GPUs; this run is "
                             f"{self.distributed_type.value}: use Accelerator for it")
        if self.ddp_handler is not None and self.ddp_handler.comm_hook != DDPCommunicationHookType.NO:
            raise ValueError("BalancedAccelerator cannot take a DDP communication hook: drbalance's sample weighting "
                             "is the hook (docs/integrations.md)")
        if self.state.dynamo_plugin.backend != DynamoBackend.NO:
            raise ValueError("BalancedAccelerator does not support dynamo_backend yet; compile the model inside "
                             "the script, or leave it out")
        return True

    @property
    def session(self) -> Session | None:
        """The job's session once the balanced loader was first iterated, until it is closed."""
        return self._session

    @property
    def balanced_model(self) -> BalancedDistributedDataParallel | None:
        """The job's model (the first prepared): its DR splits the balanced loaders' batches."""
        return self._job_model

    # --- prepare -------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Accelerate's ``prepare``, models first: a balanced loader needs the job's model."""
        order = sorted(range(len(args)), key=lambda index: not isinstance(args[index], torch.nn.Module))
        placement = None if device_placement is None else [device_placement[index] for index in order]
        prepared = super().prepare(*[args[index] for index in order], device_placement=placement)
        prepared = prepared if len(args) > 1 else (prepared,)
        result: list[Any] = [None] * len(args)
        for position, index in enumerate(order):
            result[index] = prepared[position]
        return tuple(result) if len(args) > 1 else result[0]

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> Any:
        """Accelerate's preparation (device, mixed precision), then ``BalancedDistributedDataParallel``."""
        if not self.balancing or evaluation_mode or getattr(model, "_is_accelerate_prepared", False):
            return super().prepare_model(model, device_placement, evaluation_mode)
        placed = super().prepare_model(model, device_placement, evaluation_mode=True)
        if not any(parameter.requires_grad for parameter in placed.parameters()):
            return placed  # nothing to reduce: Accelerate does not wrap it either
        if self._emulated is None:
            self._emulated = job.emulated_rank_device(self.device, self.local_process_index)
            if self._emulated is not None:
                self._emulated.attach(placed)
        device_ids = [self.local_process_index] if self.device.type == "cuda" else None
        ddp_options = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
        options = {**self._balance_options, **job.emulated_device_options(self._emulated), **ddp_options}
        output_device = None if device_ids is None else device_ids[0]
        wrapped = BalancedDistributedDataParallel(placed, device_ids=device_ids, output_device=output_device, **options)
        self._models[self._models.index(placed)] = wrapped
        wrapped._is_accelerate_prepared = True
        if self._job_model is None:
            self._job_model = wrapped
        return wrapped

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None, *, balanced: bool | None = None) -> Any:
        """A shuffled loader remade to follow the job's DR (``balanced=None``); others as Accelerate makes them."""
        chosen = shuffles(data_loader) if balanced is None else balanced
        if not self.balancing or not chosen or getattr(data_loader, "_is_accelerate_prepared", False):
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        model = self._job_model
        if model is None:
            raise ValueError("prepare the model before its training loader (or in the same prepare call): the loader "
                             "splits each global batch by the model's DR")
        if device_placement is None:
            device_placement = self.device_placement
        seed = self.dataloader_config.data_seed
        remade = balanced_loader(data_loader, model, seed=seed,
                                 global_batch_size=data_loader.batch_size if self.split_batches else None)
        loader = BalancedLoaderShard(self, remade.dataset, device=self.device if device_placement else None,
                                     _non_blocking=self.non_blocking, batch_sampler=remade.batch_sampler,
                                     **carried_settings(remade))
        self._dataloaders.append(loader)
        return loader

    # --- the session -----------------------------------------------------------------------------
    def _loader_started(self, loader: BalancedLoaderShard) -> None:
        """A balanced loader starts an epoch: open the session on the first (every rank alike)."""
        if self._session is not None or self._session_loader is not None:
            return
        self._session_loader = loader
        start = loader.iteration
        if start >= self.epochs:
            logger.warning("drbalance: the loader starts epoch %d but the plan has %d epochs (epochs=): no session",
                           start, self.epochs)
            return
        model = self._job_model
        plan = job.JobPlan(self.epochs, len(loader), start)
        self._session = job.open_job_session(model, plan, self._job, default_app_name(), self._broadcast)

    def _batch_taken(self, loader: BalancedLoaderShard) -> None:
        """A batch of ``loader`` was handed out: the one before it has finished."""
        if loader is self._session_loader:
            self._step_finished_batch()
            self._batch_open = self._session is not None

    def _loader_ended(self, loader: BalancedLoaderShard) -> None:
        if loader is self._session_loader:
            self._step_finished_batch()

    def _step_finished_batch(self) -> None:
        if self._session is not None and self._batch_open:
            self._batch_open = False
            self._session.step()

    def _broadcast(self, value: Any) -> Any:
        return broadcast_object_list([value], from_process=0)[0]

    def close_session(self) -> None:
        """Count a batch still open, and close the job's session (tell the manager it leaves)."""
        self._step_finished_batch()
        session, self._session = self._session, None
        if session is not None:
            session.close()

    def end_training(self) -> None:
        """Close the job's session, release the emulated GPU, then Accelerate's own end of training."""
        self.close_session()
        if self._emulated is not None:
            self._emulated.close()
            self._emulated = None
        super().end_training()


class BalancedLoaderShard(DataLoaderShard):
    """Accelerate's per-process loader over a ``BalancedBatchSampler``, telling its accelerator
    when an epoch starts and when each batch is done (the next one is asked for, or the epoch ends)."""

    def __init__(self, accelerator: BalancedAccelerator, dataset: Any, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.accelerator = accelerator

    def __iter__(self) -> Iterator[Any]:
        self.accelerator._loader_started(self)
        for batch in super().__iter__():
            self.accelerator._batch_taken(self)
            yield batch
        self.accelerator._loader_ended(self)


def shuffles(loader: DataLoader) -> bool:
    """Whether ``loader`` shuffles its samples (a training loader): a ``RandomSampler`` or a
    shuffling ``DistributedSampler``, as its sampler or its batch sampler's."""
    sampler = loader.sampler if loader.batch_size is not None else getattr(loader.batch_sampler, "sampler", None)
    return isinstance(sampler, RandomSampler) or (isinstance(sampler, DistributedSampler) and sampler.shuffle)


def default_app_name() -> str:
    """The script's file name without its suffix (``train.py``: ``train``), as an app name."""
    import __main__

    path = getattr(__main__, "__file__", None) or "accelerate"
    return job.app_name_from(path.rsplit("/", 1)[-1].rsplit(".", 1)[0])


__all__ = ["BalancedAccelerator", "BalancedLoaderShard", "default_app_name", "shuffles"]
