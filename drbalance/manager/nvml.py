"""Every NVML call goes through ``Nvml.call``: lazy initialisation, and driver errors turned into
``NvmlUnavailable`` with a readable message (never a NaN or a half-initialised handle).

NVML comes from the ``nvidia-ml-py`` package (imported as ``pynvml``).
"""

from __future__ import annotations

import threading
from typing import Any


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

    def shutdown(self) -> None:
        with self._lock:
            if self._module is not None:
                try:
                    self._module.nvmlShutdown()
                except self._module.NVMLError:
                    pass
                self._module = None
