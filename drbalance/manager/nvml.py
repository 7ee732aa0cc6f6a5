"""Every NVML call goes through ``Nvml.call``: lazy initialisation, and driver errors turned into
``NvmlUnavailable`` with a readable message (never a NaN or a half-initialised handle).

NVML comes from the ``nvidia-ml-py`` package (imported as ``pynvml``). Also here: the plain data
the manager keeps of a GPU's memory, and how GPU UUIDs are compared.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MemoryInfo:
    """Device memory in bytes, as ``nvmlDeviceGetMemoryInfo`` reports it."""

    total: int
    used: int
    free: int


def normalize_uuid(value: str | bytes | None) -> str:
    """A GPU UUID in one spelling for comparison: lower case, ``gpu-`` prefixed ("" = unknown).

    NVML says ``GPU-8f6c...``; ``torch.cuda.get_device_properties(i).uuid`` prints the bare
    ``8f6c...``; MIG devices are ``MIG-...`` and keep their prefix.
    """
    if value is None:
        return ""
    text = (value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)).strip().lower()
    if text and not text.startswith(("gpu-", "mig-")):
        text = "gpu-" + text
    return text


class NvmlUnavailable(RuntimeError):
    """NVML cannot answer: no package, no driver, no such device, or a driver error."""


class Nvml:
    """A lazily initialised NVML session. One per owner; ``shutdown()`` when done."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._module: Any = None

    def _ensure(self) -> Any:
        if self._module is not None:
            return self._module
        try:
            import pynvml
        except ImportError as error:
            raise NvmlUnavailable(f"NVML unavailable: the nvidia-ml-py package is not installed ({error})") from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as error:
            raise NvmlUnavailable(
                f"NVML unavailable: {error} (is an NVIDIA driver installed and a GPU visible?)"
            ) from None
        self._module = pynvml
        return pynvml

    def call(self, function: str, *args: Any) -> Any:
        """``pynvml.<function>(*args)``; NvmlUnavailable on any NVML error."""
        with self._lock:
            module = self._ensure()
            try:
                return getattr(module, function)(*args)
            except module.NVMLError as error:
                raise NvmlUnavailable(f"NVML {function} failed: {error}") from None

    def uuid(self, handle: Any) -> str | None:
        """The device's UUID (``GPU-...``), or None if NVML cannot tell."""
        try:
            value = self.call("nvmlDeviceGetUUID", handle)
        except NvmlUnavailable:
            return None
        return value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)

    def memory(self, handle: Any) -> MemoryInfo | None:
        """The device's memory (bytes), or None if NVML cannot tell."""
        try:
            info = self.call("nvmlDeviceGetMemoryInfo", handle)
        except NvmlUnavailable:
            return None
        return MemoryInfo(int(info.total), int(info.used), int(info.free))

    def shutdown(self) -> None:
        with self._lock:
            if self._module is not None:
                try:
                    self._module.nvmlShutdown()
                except self._module.NVMLError:
                    pass
                self._module = None
