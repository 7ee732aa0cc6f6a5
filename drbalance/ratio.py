"""The data ratio (DR): how an app's mini-batch is shared across the GPUs of a server.

A DR is one non-negative integer share per GPU; the shares sum to a fixed total (the paper's
default is 10, so ``[0, 7, 3, 0]`` puts 70% of every mini-batch on GPU 1 and 30% on GPU 2).
This module is framework-free: the torch client, the manager and the simulator all use it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property, lru_cache
from itertools import compress

DEFAULT_TOTAL = 10
"""The paper's granularity: shares are tenths of the mini-batch."""

MAX_TOTAL = 0xFFFF
"""The largest DR total the app's shared-memory record carries (an unsigned 16-bit field)."""


def apportion(weights: Sequence[Fraction | int], amount: int) -> tuple[int, ...]:
    """Split ``amount`` whole units in proportion to non-negative ``weights`` (largest remainder).

    Every entry gets the floor of its exact quota; the units left over go, one each, to the
    entries with the largest fractional remainder. Ties go to the larger weight, then the lower
    index, so the result is deterministic. The result always sums to ``amount`` exactly, and an
    entry with weight 0 always gets 0. Arithmetic is exact (integers or fractions), never float.
    """
    if amount < 0:
        raise ValueError(f"cannot apportion a negative amount ({amount})")
    if all(isinstance(w, int) for w in weights):
        return _apportion_integers(tuple(weights), amount)  # type: ignore[arg-type]
    fractions = [Fraction(w) for w in weights]
    common = math.lcm(*(value.denominator for value in fractions))
    return _apportion_integers(tuple(int(v * common) for v in fractions), amount)


@lru_cache(maxsize=4096)
def _apportion_integers(weights: tuple[int, ...], amount: int) -> tuple[int, ...]:
    weight_sum = sum(weights)
    if weight_sum <= 0 or min(weights) < 0:
        raise ValueError(f"cannot apportion by weights {list(weights)}: need >= 0, sum > 0")
    scaled = [w * amount for w in weights]
    floors = [s // weight_sum for s in scaled]
    leftover = amount - sum(floors)
    if leftover:
        # The remainder s % weight_sum orders entries by their exact fractional part.
        order = sorted(range(len(weights)), key=lambda i: (-(scaled[i] % weight_sum), -weights[i], i))
        for index in order[:leftover]:
            floors[index] += 1
    return tuple(floors)


def _as_share(value: object, position: int, shares: Sequence[object]) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"DR shares must be non-negative integers; entry {position} of {list(shares)} "
            f"is {value!r} ({type(value).__name__})"
        )
    if value < 0:
        raise ValueError(
            f"DR shares must be non-negative integers; entry {position} of {list(shares)} "
            f"is {value}"
        )
    return int(value)


@dataclass(frozen=True)
class DataRatio:
    """One integer share per GPU, summing to ``total`` (default 10).

    ``DataRatio([1, 2, 7, 0])`` gives GPU 0 10%, GPU 1 20%, GPU 2 70% of each batch and holds no
    replica on GPU 3. Construction validates: a ``ValueError`` names the bad value and the rule.
    """

    shares: tuple[int, ...]
    total: int = DEFAULT_TOTAL

    def __init__(self, shares: Sequence[int] | DataRatio, total: int | None = None) -> None:
        kind = type(shares)
        if (kind is tuple or kind is list) and (total is None or type(total) is int):
            # the common case (plain ints, as the policies build candidates) without the generic checks
            checked = tuple(shares)
            wanted = DEFAULT_TOTAL if total is None else total
            if checked and wanted >= 1 and set(map(type, checked)) == {int} and min(checked) >= 0 \
                    and sum(checked) == wanted:
                object.__setattr__(self, "shares", checked)
                object.__setattr__(self, "total", wanted)
                return
        if isinstance(shares, DataRatio):
            total = shares.total if total is None else total
            shares = shares.shares
        if total is None:
            total = DEFAULT_TOTAL
        if isinstance(shares, (str, bytes)) or not isinstance(shares, Sequence):
            raise ValueError(f"a DR is a sequence of integer shares, one per GPU; got {shares!r}")
        if isinstance(total, bool) or not isinstance(total, numbers.Integral) or total < 1:
            raise ValueError(f"the DR total must be a positive integer; got {total!r}")
        if len(shares) == 0:
            raise ValueError("a DR needs at least one GPU entry; got an empty sequence")
        if all(type(value) is int and value >= 0 for value in shares):
            checked = tuple(shares)  # the common case, without the slower generic checks
        else:
            checked = tuple(_as_share(value, i, shares) for i, value in enumerate(shares))
        if sum(checked) != total:
            raise ValueError(
                f"DR shares {list(checked)} sum to {sum(checked)}, but the DR total is {total} "
                f"(shares must sum to the total exactly)"
            )
        object.__setattr__(self, "shares", checked)
        object.__setattr__(self, "total", int(total))

    # --- constructors -----------------------------------------------------------------------
    @classmethod
    def even(cls, gpu_count: int, total: int = DEFAULT_TOTAL) -> DataRatio:
        """As even a split of ``total`` over ``gpu_count`` GPUs as integers allow."""
        _check_gpu_count(gpu_count)
        return cls(apportion([1] * gpu_count, total), total)

    @classmethod
    def single(cls, gpu_count: int, gpu: int, total: int = DEFAULT_TOTAL) -> DataRatio:
        """The whole mini-batch on one GPU (index ``gpu`` of ``gpu_count``)."""
        _check_gpu_count(gpu_count)
        if not 0 <= gpu < gpu_count:
            raise ValueError(f"GPU index {gpu} is outside 0..{gpu_count - 1}")
        shares = [0] * gpu_count
        shares[gpu] = total
        return cls(shares, total)

    @classmethod
    def from_weights(cls, weights: Sequence[float], total: int = DEFAULT_TOTAL) -> DataRatio:
        """Shares proportional to non-negative real ``weights`` (largest remainder, exact sum)."""
        return cls(apportion([Fraction(weight) for weight in _checked_weights(weights)], total), total)

    # --- queries ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.shares)

    def __iter__(self) -> Iterator[int]:
        return iter(self.shares)

    def __getitem__(self, index: int) -> int:
        return self.shares[index]

    @cached_property
    def used(self) -> tuple[int, ...]:
        """Indices of the GPUs with a non-zero share (the paper's GPU_used)."""
        return tuple(compress(range(len(self.shares)), self.shares))  # shares are >= 0: the non-zero ones

    def split(self, batch_size: int) -> tuple[int, ...]:
        """Chunk sizes (samples per GPU) for a batch of ``batch_size`` samples.

        Sizes sum to ``batch_size`` exactly, are proportional to the shares (largest remainder,
        deterministic ties) and are 0 wherever the share is 0. A batch smaller than the number
        of non-zero shares leaves some of those GPUs with 0 samples.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral):
            raise ValueError(f"batch size must be an integer; got {batch_size!r}")
        if batch_size < 0:
            raise ValueError(f"batch size must be >= 0; got {batch_size}")
        return apportion(self.shares, int(batch_size))

    def rescale(self, total: int) -> DataRatio:
        """The same proportions expressed with another total (largest remainder)."""
        if total == self.total:
            return self
        return DataRatio(apportion(self.shares, total), total)

    def to_list(self) -> list[int]:
        return list(self.shares)

    def __str__(self) -> str:
        return f"[{', '.join(str(s) for s in self.shares)}]/{self.total}"


def _check_gpu_count(gpu_count: int) -> None:
    if isinstance(gpu_count, bool) or not isinstance(gpu_count, numbers.Integral) or gpu_count < 1:
        raise ValueError(f"GPU count must be a positive integer; got {gpu_count!r}")


def as_ratio(value: DataRatio | Sequence[float], total: int | None = None) -> DataRatio:
    """A validated DataRatio from a user's value: a DataRatio, or one *weight* per GPU.

    A DataRatio is taken as it is (expressed in ``total`` when one is given). A sequence of
    non-negative numbers is a set of weights:

    - whole numbers keep their exact proportions, with their sum as the DR total (``[1, 2, 7, 0]``
      is ``[1, 2, 7, 0]/10``, ``[1, 1, 1, 1]`` is ``[1, 1, 1, 1]/4``, ``[3, 1]`` is ``[3, 1]/4``);
    - other numbers (``[0.7, 0.3]``), whole numbers whose sum is beyond ``MAX_TOTAL``, and any
      weights when ``total`` is given (unless they already sum to it) are apportioned to the DR
      total (``total``, default ``DEFAULT_TOTAL``) by largest remainder, as :meth:`DataRatio.split`
      splits a batch.

    ``ValueError`` names the entry and the rule for a negative, NaN, infinite or non-numeric
    weight, weights that are all zero, and an empty sequence.
    """
    if isinstance(value, DataRatio):
        return value if total is None or total == value.total else DataRatio(value.shares, total)
    weights = _checked_weights(value)
    if all(isinstance(weight, numbers.Integral) for weight in weights):
        whole = tuple(int(weight) for weight in weights)
        if total is None and sum(whole) <= MAX_TOTAL:
            return DataRatio(whole, sum(whole))
        if total is not None and sum(whole) == total:
            return DataRatio(whole, total)
    wanted = DEFAULT_TOTAL if total is None else total
    if isinstance(wanted, bool) or not isinstance(wanted, numbers.Integral) or wanted < 1:
        raise ValueError(f"the DR total must be a positive integer; got {wanted!r}")
    return DataRatio.from_weights(weights, int(wanted))



def _checked_weights(value: object) -> tuple[numbers.Real, ...]:
    """``value`` as a tuple of finite non-negative real numbers, not all zero; ValueError naming the entry."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"a DR is a sequence of shares (weights), one per GPU; got {value!r}")
    if len(value) == 0:
        raise ValueError("a DR needs at least one GPU entry; got an empty sequence")
    for position, weight in enumerate(value):
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
            raise ValueError(f"DR shares must be non-negative numbers (weights); entry {position} of {list(value)} "
                             f"is {weight!r} ({type(weight).__name__})")
        if not weight >= 0 or weight == math.inf:  # NaN fails every comparison
            raise ValueError(f"DR shares must be finite non-negative numbers (weights); entry {position} of "
                             f"{list(value)} is {weight}")
    if not any(value):
        raise ValueError(f"DR shares {list(value)} are all zero: give at least one GPU a share")
    return tuple(value)
