"""Checks of what the integration jobs (lightning_job.py, accelerate_job.py) recorded, shared by their tests.

A job's model is ``nn.Linear(4, 2)`` with an MSE loss; a step's record holds the parameters
before the step (weight then bias, flattened), the gradient the step used, this rank's sample
ids and every rank's sample counts.
"""

from __future__ import annotations

import torch
from torch.nn import functional

from drbalance.client.sampler import rank_sizes
from drbalance.ratio import DataRatio


def global_mean_gradient(data: dict, params: list[float], ids: list[int]) -> torch.Tensor:
    """One process: the gradient of the mean MSE over the samples ``ids`` at ``params``."""
    weight = torch.tensor(params[:8], dtype=torch.float64).view(2, 4).requires_grad_()
    bias = torch.tensor(params[8:10], dtype=torch.float64).requires_grad_()
    x = torch.tensor(data["x"], dtype=torch.float64)[ids]
    y = torch.tensor(data["y"], dtype=torch.float64)[ids]
    functional.mse_loss(x @ weight.T + bias, y).backward()
    return torch.cat([weight.grad.reshape(-1), bias.grad])


def check_global_mean_gradients(steps_by_rank: list[list[dict]], data: dict) -> None:
    """Every rank's gradient at every step is the one-process gradient of the mean loss over the
    step's global batch (all ranks' samples), and every rank counted the same samples."""
    for index, steps in enumerate(zip(*steps_by_rank)):
        ids = [i for step in steps for i in step["ids"]]
        counts = [len(step["ids"]) for step in steps]
        expected = global_mean_gradient(data, steps[0]["params"], ids)
        for rank, step in enumerate(steps):
            assert step["counts"] == counts, (index, rank, step["counts"], counts)
            assert step["params"] == steps[0]["params"], (index, rank)  # the ranks stay in step
            error = (torch.tensor(step["grads"], dtype=torch.float64) - expected).abs().max().item()
            assert error < 1e-6, (index, rank, error)


def check_each_sample_once_per_epoch(steps_by_rank: list[list[dict]], samples: int) -> None:
    epochs = {step["epoch"] for steps in steps_by_rank for step in steps}
    for epoch in epochs:
        seen = sorted(i for steps in steps_by_rank for step in steps if step["epoch"] == epoch for i in step["ids"])
        assert seen == list(range(samples)), epoch


def expected_counts(initial: list[int], applied: list[tuple[int, list[int]]], steps: int,
                    batch: int) -> list[list[int]]:
    """Every rank's samples at each step (= global batch) under ``initial`` and then the DRs the SD
    log says were applied from their first global batch on."""
    counts = []
    for index in range(steps):
        ratio = initial
        for start, shares in applied:
            if start <= index:
                ratio = shares
        counts.append(list(rank_sizes(DataRatio(ratio), batch)))
    return counts
