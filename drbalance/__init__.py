"""drbalance: fair sharing of a multi-GPU server by adaptive mini-batch redistribution.

The top-level package is framework-free (no torch import): the manager and the simulator use
it on machines without PyTorch. The torch client lives in :mod:`drbalance.client`.
"""

from drbalance.ratio import DEFAULT_TOTAL, DataRatio

__version__ = "0.1.0"

__all__ = ["DEFAULT_TOTAL", "DataRatio", "__version__"]
