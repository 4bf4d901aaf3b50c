"""Host and device load, logged beside each tracking window's training metrics: a slow
window reads differently when the CPU was saturated or the GPU's memory full."""

from __future__ import annotations

import contextlib
import os
import time

import torch


class SystemSampler:
    """This process's CPU use since the last sample, its resident memory, the host's load
    and, on CUDA, the device's memory and utilisation (that needs pynvml; left out without)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._cpu_s, self._at = _cpu_seconds(), time.monotonic()

    def sample(self) -> dict[str, float]:
        cpu_s, now = _cpu_seconds(), time.monotonic()
        metrics = {
            "sys/cpu_percent": 100.0 * (cpu_s - self._cpu_s) / max(now - self._at, 1e-6),
            "sys/rss_mb": _rss_mb(),
            "sys/load_1m": os.getloadavg()[0],
        }
        self._cpu_s, self._at = cpu_s, now
        if self.device.type == "cuda":
            mib = float(1 << 20)
            metrics["sys/gpu_memory_mb"] = torch.cuda.memory_allocated(self.device) / mib
            metrics["sys/gpu_memory_reserved_mb"] = torch.cuda.memory_reserved(self.device) / mib
            with contextlib.suppress(Exception):  # pynvml missing, or no NVML on this host
                metrics["sys/gpu_utilization"] = float(torch.cuda.utilization(self.device))
        return metrics


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)
    except (OSError, ValueError):
        import resource  # not Linux: the high-water mark is the nearest measure

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
