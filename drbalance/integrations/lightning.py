"""drbalance as a PyTorch Lightning strategy: importing this module registers ``"drbalance"``.

    import drbalance.integrations.lightning  # noqa: F401  (registers the strategy)

    trainer = Trainer(strategy="drbalance", accelerator="cpu", devices=2, max_epochs=10)
    trainer.fit(model, train_loader)

or, with settings: ``Trainer(strategy=DrBalanceStrategy(app="resnet-a", solo_time=600, ratio=[3, 7]))``.
Against Lightning's ``"ddp"`` strategy (this is a subclass of it) it

- wraps the LightningModule in :class:`~drbalance.client.BalancedDistributedDataParallel` (the
  sample-weighted gradient: every rank ends with the gradient of the mean loss over the global batch);
- remakes the training loader Lightning prepared (with its ``DistributedSampler``) by
  :func:`~drbalance.client.balanced_loader`: each global batch (the loader's ``batch_size`` x the
  ranks) is split by the job's DR; validation, test and predict loaders are left as ``"ddp"`` has them;
- opens the job's :class:`~drbalance.client.Session` on every rank when training starts, with the
  Trainer's plan (``max_epochs``, or ``max_steps`` x ``accumulate_grad_batches`` in global batches;
  ``num_training_batches`` per epoch, which follows ``limit_train_batches``; ``current_epoch``
  when resuming), named by ``app=`` or after the logger (``<name>-<version>``, or ``lightning``);
  a manager's DR reaches every rank at the same global batch through the model's control exchange;
- counts one iteration per training batch (``session.step()`` when the next batch starts, and
  when training ends), and closes the session when ``fit`` ends or fails;
- with ``DRBALANCE_EMULATED_GPUS`` set and ranks on the CPU: local rank i holds emulated GPU i
  for its modelled time (costs estimated from its first forward).

Needs ``pip install 'drbalance[lightning]'`` (the ``lightning`` package); see docs/integrations.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch.utils.data import DataLoader

from drbalance.client.distributed import BalancedDistributedDataParallel
from drbalance.client.loader import balanced_loader
from drbalance.client.session import Session
from drbalance.integrations import job
from drbalance.ratio import DataRatio

try:
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
except ImportError as error:
    raise job.missing_extra("lightning", "PyTorch Lightning (the 'lightning' package)", error) from error

logger = job.logger

STRATEGY_NAME = "drbalance"

REFUSED_OPTIONS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")
"""DDPStrategy arguments that need DDP's one communication hook, which the sample weighting occupies."""


class DrBalanceStrategy(DDPStrategy):
    """Lightning's DDP strategy with drbalance's model, loader and session (see the module docstring).

    Keyword arguments, besides those of ``DDPStrategy`` (``timeout``, ``process_group_backend``,
    ``start_method``, and DDP's own such as ``find_unused_parameters``, passed through):

    - ``app``: the job's name for the manager (default: the logger's ``<name>-<version>``, or
      ``lightning``; with ``-<pid>`` appended when a live job already holds it);
    - ``solo_time``: seconds alone for the whole plan, or a stored profile's name (default:
      estimated online, docs/profiles.md);
    - ``ratio``, ``exchange_every``, ``loss_reduction``: ``BalancedDistributedDataParallel``'s;
    - ``session_options``: further ``Session`` arguments (``report_every``, ``decide_every``,
      ``namespace``, ``sd_log``, ``exchange_timeout``, ``send_timeout``, ``handle_sigterm``).

    ``ddp_comm_hook``, ``ddp_comm_state``, ``ddp_comm_wrapper`` and ``model_averaging_period``
    are refused (``ValueError``): the sample weighting is DDP's communication hook.
    """

    strategy_name = STRATEGY_NAME

    def __init__(self, *, app: str | None = None, solo_time: float | str | None = None,
                 ratio: DataRatio | Sequence[float] | None = None, exchange_every: int | None = None,
                 loss_reduction: str = "mean", session_options: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> None:
        refused = [name for name in REFUSED_OPTIONS if kwargs.get(name) is not None]
        if refused:
            raise ValueError(f"DrBalanceStrategy does not take {refused}: drbalance's sample weighting is the DDP "
                             f"communication hook (docs/integrations.md)")
        super().__init__(**kwargs)
        self._job = job.JobSettings(app, solo_time, session_options or {})
        self._balance_options = {"ratio": ratio, "exchange_every": exchange_every, "loss_reduction": loss_reduction}
        self._session: Session | None = None
        self._batch_open = False  # a training batch has started whose session.step() is still due
        self._emulated: Any = None  # this rank's EmulatedRankDevice, when on emulated GPUs
        self._emulated_hook: Any = None

    @property
    def session(self) -> Session | None:
        """The job's session while ``fit`` trains (None before and after, and when not fitting)."""
        return self._session

    @property
    def balanced_model(self) -> BalancedDistributedDataParallel | None:
        """The wrapped model while fitting (its ``ratio``, ``last_chunk_sizes``, ...), else None."""
        return self.model if isinstance(self.model, BalancedDistributedDataParallel) else None

    # --- the model and the loader --------------------------------------------------------------
    def _setup_model(self, model: torch.nn.Module) -> BalancedDistributedDataParallel:
        device_ids = self.determine_ddp_device_ids()
        self._emulated = job.emulated_rank_device(self.root_device, self.local_rank)
        if self._emulated is not None:
            self._emulated_hook = self._emulated.attach(model)
        options = {**self._balance_options, **job.emulated_device_options(self._emulated), **self._ddp_kwargs}
        stream = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()
        with stream:  # as DDPStrategy does: https://pytorch.org/docs/stable/notes/cuda.html#id5
            return BalancedDistributedDataParallel(module=model, device_ids=device_ids, **options)

    def process_dataloader(self, dataloader: object) -> object:
        """The training loader remade to follow the DR; any other loader as ``"ddp"`` has it."""
        dataloader = super().process_dataloader(dataloader)
        model = self.balanced_model
        trainer = self._trainer()
        if model is None or trainer is None or not trainer.training or not isinstance(dataloader, DataLoader):
            return dataloader
        return balanced_loader(dataloader, model)

    # --- the session -----------------------------------------------------------------------------
    def on_train_start(self) -> None:
        super().on_train_start()
        model, trainer = self.balanced_model, self._trainer()
        if model is None or trainer is None:
            return
        plan = trainer_plan(trainer)
        if plan is None:
            return
        self._session = job.open_job_session(model, plan, self._job, default_app_name(trainer), self.broadcast)
        self._batch_open = False

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._step_finished_batch()
        self._batch_open = self._session is not None

    def on_train_end(self) -> None:
        self._step_finished_batch()
        self._close_session()
        super().on_train_end()

    def on_exception(self, exception: BaseException) -> None:
        self._close_session()
        super().on_exception(exception)

    def teardown(self) -> None:
        self._close_session()
        if self._emulated_hook is not None:
            self._emulated_hook.remove()  # the module outlives the fit; its next forward is not emulated
            self._emulated_hook = None
        if self._emulated is not None:
            self._emulated.close()
            self._emulated = None
        super().teardown()

    def _step_finished_batch(self) -> None:
        if self._session is not None and self._batch_open:
            self._batch_open = False
            self._session.step()

    def _close_session(self) -> None:
        session, self._session = self._session, None
        self._batch_open = False
        if session is not None:
            session.close()

    def _trainer(self) -> Any:
        module = self.lightning_module
        return None if module is None else module._trainer


def trainer_plan(trainer: Any) -> job.JobPlan | None:
    """The session's plan from what the Trainer knows; None when nothing is left to train.

    Epochs: ``max_epochs``, or fewer when ``max_steps`` (optimizer steps, each of
    ``accumulate_grad_batches`` batches) ends training sooner; one epoch (extended as training
    goes on, with a warning) when neither is set. Iterations per epoch: ``num_training_batches``.
    """
    batches = trainer.num_training_batches
    if not isinstance(batches, int) or batches < 1:
        raise ValueError(f"drbalance needs a training loader of known length; this one has {batches} batches per "
                         f"epoch (an IterableDataset's samples cannot be dealt out by a DR)")
    epochs = planned_epochs(trainer.max_epochs, trainer.max_steps, trainer.accumulate_grad_batches, batches)
    if epochs is None:
        logger.warning("drbalance: the Trainer sets neither max_epochs nor max_steps; the job's plan is one epoch "
                       "at a time (its slowdown is then measured against one epoch alone)")
        epochs = trainer.current_epoch + 1
    if trainer.current_epoch >= epochs:
        return None
    return job.JobPlan(epochs, batches, trainer.current_epoch)


def planned_epochs(max_epochs: int | None, max_steps: int, accumulate: int, batches_per_epoch: int) -> int | None:
    """Epochs ``fit`` will run: ``max_epochs``, or the epochs ``max_steps`` optimizer steps of
    ``accumulate`` batches each take if fewer; None when neither bounds training (-1 / None)."""
    by_steps = None
    if max_steps is not None and max_steps > 0:
        by_steps = math.ceil(max_steps * accumulate / batches_per_epoch)
    if max_epochs is not None and max_epochs > 0:
        return max_epochs if by_steps is None else min(max_epochs, by_steps)
    return by_steps


def default_app_name(trainer: Any) -> str:
    """``<logger name>-<logger version>`` as a valid app name, or ``lightning`` without a logger."""
    found = trainer.logger
    if found is None or not getattr(found, "name", None):
        return "lightning"
    version = getattr(found, "version", None)
    return job.app_name_from(found.name if version is None else f"{found.name}-{version}")


if STRATEGY_NAME not in StrategyRegistry:
    StrategyRegistry.register(STRATEGY_NAME, DrBalanceStrategy,
                              description="DDP with drbalance: uneven, manager-steered per-rank shares of each batch")

__all__ = ["STRATEGY_NAME", "DrBalanceStrategy", "default_app_name", "planned_epochs", "trainer_plan"]
