"""What a Session steers, without torch, for tests of the session alone."""

from __future__ import annotations

from drbalance.ratio import DataRatio


class SteeredModel:
    """A DR ([5, 5] of 10 to begin with) and ``set_ratio``: all a Session needs of a model."""

    def __init__(self) -> None:
        self.ratio = DataRatio([5, 5], 10)

    def set_ratio(self, ratio: DataRatio) -> None:
        self.ratio = ratio
