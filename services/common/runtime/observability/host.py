"""What a node's machine is doing: CPU, memory, and the first GPU where the machine can tell.

CPU and memory come from psutil, which needs no privileges on Linux or macOS. The GPU comes
from NVIDIA's management library (NVML, through nvidia-ml-py) where an NVIDIA driver is
installed. macOS gives GPU utilization only to root (`powermetrics`), so a Mac's GPU is named
unavailable, as is any GPU on a machine without NVML; its memory is the system's (unified).
Plain Python: GetNodeInfo and the router's dashboard turn it into their own shapes.
"""

from __future__ import annotations

import platform
import socket
import threading
import time
from typing import Any

import psutil

from disagg_mesh.server.common.types import HostUsage

# A measurement is reused for this long: every router's dashboard asks every node each tick.
FRESH_S = 1.0


class _Nvml:
    """The first NVIDIA GPU through NVML, or why there is none to read."""

    def __init__(self) -> None:
        self.handle: Any = None
        self.name = ""
        self.why = ""
        if platform.system() == "Darwin":
            self.why = "gpu: macOS gives GPU utilization to root only (powermetrics)"
            return
        try:
            import pynvml  # type: ignore[import-untyped]
        except ImportError:
            self.why = "gpu: nvidia-ml-py is not installed"
            return
        try:
            pynvml.nvmlInit()
            if pynvml.nvmlDeviceGetCount() == 0:
                self.why = "gpu: NVML sees no GPU"
                return
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            name = pynvml.nvmlDeviceGetName(self.handle)
            self.name = name.decode() if isinstance(name, bytes) else str(name)
        except pynvml.NVMLError as exc:
            self.why = f"gpu: no NVIDIA driver (NVML: {exc})"

    def read(self) -> tuple[float, int, int] | None:
        if self.handle is None:
            return None
        import pynvml

        try:
            rates = pynvml.nvmlDeviceGetUtilizationRates(self.handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(self.handle)
        except pynvml.NVMLError as exc:
            self.why = f"gpu: NVML stopped answering ({exc})"
            self.handle = None
            return None
        return float(rates.gpu), int(memory.used), int(memory.total)


class HostMeter:
    """Measures this machine on demand. CPU busy is over the time since the previous
    measurement (psutil's own interval), so the first one after start reads 0."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hostname = socket.gethostname()
        self._cores = psutil.cpu_count() or 1
        psutil.cpu_percent(None)  # starts the interval the next call measures
        self._gpu: _Nvml | None = None
        self._last: HostUsage | None = None
        self._at = 0.0

    def measure(self) -> HostUsage:
        with self._lock:
            now = time.monotonic()
            if self._last is not None and now - self._at < FRESH_S:
                return self._last
            if self._gpu is None:
                self._gpu = _Nvml()
            memory = psutil.virtual_memory()
            gpu = self._gpu.read()
            self._last = HostUsage(
                hostname=self._hostname,
                cpu_cores=self._cores,
                cpu_busy_percent=float(psutil.cpu_percent(None)),
                memory_used_bytes=int(memory.total - memory.available),
                memory_total_bytes=int(memory.total),
                gpu_name=self._gpu.name if gpu is not None else "",
                gpu_utilization_percent=gpu[0] if gpu is not None else 0.0,
                gpu_memory_used_bytes=gpu[1] if gpu is not None else 0,
                gpu_memory_total_bytes=gpu[2] if gpu is not None else 0,
                unavailable=() if gpu is not None else (self._gpu.why,),
            )
            self._at = now
            return self._last


_METER: HostMeter | None = None


def this_host() -> HostUsage:
    """This machine now (one meter a process)."""
    global _METER
    if _METER is None:
        _METER = HostMeter()
    return _METER.measure()
