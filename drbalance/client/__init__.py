"""The training-side client (needs torch): ``BalancedDataParallel``, its DDP sibling, and the manager session."""

from drbalance.client.backends import ChunkPlan, CpuBackend, CudaBackend, DeviceBackend
from drbalance.client.distributed import BalancedDistributedDataParallel
from drbalance.client.loader import BalancedDataLoader, balanced_loader
from drbalance.client.parallel import BalancedDataParallel
from drbalance.client.sampler import BalancedBatchSampler
from drbalance.client.session import MeasurementComplete, Session
from drbalance.client.timing import ReplicaTiming

__all__ = [
    "BalancedBatchSampler",
    "BalancedDataLoader",
    "BalancedDataParallel",
    "BalancedDistributedDataParallel",
    "ChunkPlan",
    "CpuBackend",
    "CudaBackend",
    "DeviceBackend",
    "MeasurementComplete",
    "ReplicaTiming",
    "Session",
    "balanced_loader",
]
