"""The training-side client (needs torch): ``BalancedDataParallel`` and the manager session."""

from drbalance.client.backends import ChunkPlan, CpuBackend, CudaBackend, DeviceBackend
from drbalance.client.parallel import BalancedDataParallel
from drbalance.client.session import ProfileComplete, Session
from drbalance.client.timing import ReplicaTiming

__all__ = [
    "BalancedDataParallel",
    "ChunkPlan",
    "CpuBackend",
    "CudaBackend",
    "DeviceBackend",
    "ProfileComplete",
    "ReplicaTiming",
    "Session",
]
