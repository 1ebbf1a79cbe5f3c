"""Which device work runs on and how much memory it has: `resolve_device` (None -> the current CUDA device, else the
CPU; names checked), `device_memory` (total, free and held bytes: `torch.cuda.mem_get_info` on CUDA; on the CPU the
OS's MemAvailable, capped by a container's cgroup limit), `devices` (every device this process can use).

Example:
    >>> info = device_memory("cpu")
    >>> 0 < info.free <= info.total
    True
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["MemoryInfo", "cpu_memory", "cpu_name", "device_memory", "devices", "process_rss", "resolve_device"]


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """`None` -> the current CUDA device when there is one (`torch.cuda.current_device()`: cuda:0 unless
    `torch.cuda.set_device` chose another, as each rank of a multi-GPU job does), else the CPU; strings are
    checked, and 'cuda' without an index is the current device too."""
    if device is None:
        # not cuda:0: a rank that called torch.cuda.set_device(local_rank) would put its data on GPU 0
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"expected a device such as 'cpu', 'cuda' or 'cuda:1'; found {device!r} ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but this torch build or machine has no CUDA; "
                             "use device='cpu'")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} asked for, but only {torch.cuda.device_count()} CUDA "
                             f"device(s) exist (cuda:0..cuda:{torch.cuda.device_count() - 1})")
    elif dev.type != "cpu":
        raise ValueError(f"memfit supports 'cpu' and 'cuda' devices; found {device!r}")
    return dev


@dataclass(frozen=True)
class MemoryInfo:
    """Memory of one device, in bytes. `held` is what this process holds there."""
    device: str
    name: str
    total: int
    free: int
    held: int


def _read_kv(path: str) -> dict[str, int]:
    out = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if parts[-1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _cgroup_room() -> int | None:
    """Bytes left under a cgroup v2 memory limit (containers), or None when there is no limit."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - current)


def process_rss() -> int:
    """Resident set size of this process in bytes (0 where the OS does not say)."""
    status = _read_kv("/proc/self/status")
    if "VmRSS" in status:
        return status["VmRSS"]
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak, the best we have
    except (ImportError, OSError):
        return 0


def cpu_memory() -> MemoryInfo:
    info = _read_kv("/proc/meminfo")
    total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    free = info.get("MemAvailable", info.get("MemFree", total))
    room = _cgroup_room()
    if room is not None:
        free = min(free, room)
    return MemoryInfo("cpu", cpu_name(), total, free, process_rss())


def cpu_name() -> str:
    """The processor's model name ('AMD EPYC', 'Apple M2', ...), or the architecture."""
    import platform
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_memory(device: str | torch.device | None = None) -> MemoryInfo:
    """Total, free and held bytes of one device (CUDA: `torch.cuda.mem_get_info`; CPU: the OS)."""
    dev = resolve_device(device)
    if dev.type == "cpu":
        return cpu_memory()
    free, total = torch.cuda.mem_get_info(dev)
    return MemoryInfo(str(dev), torch.cuda.get_device_name(dev), total, free,
                      torch.cuda.memory_reserved(dev))


def devices() -> list[MemoryInfo]:
    """The CPU and every CUDA device this process can use."""
    out = [cpu_memory()]
    if torch.cuda.is_available():
        out += [device_memory(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]
    return out
