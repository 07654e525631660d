"""Facts about the host machine that every backend shares: chip name, physical and free memory,
and whether the machine is paging."""

from __future__ import annotations

import platform as _pyplatform
import subprocess
import sys


def sysctl(name: str) -> str | None:
    """A macOS sysctl value, or None where there is none."""
    try:
        out = subprocess.run(
            ["sysctl", "-n", name], capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def chip_name() -> str:
    """Marketing name of the processor: 'Apple M3 Max' on a Mac, the CPU model elsewhere."""
    if sys.platform == "darwin":
        return sysctl("machdep.cpu.brand_string") or "Apple Silicon"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _pyplatform.processor() or _pyplatform.machine()


def physical_memory_bytes() -> int:
    if sys.platform == "darwin":
        raw = sysctl("hw.memsize")
        if raw:
            return int(raw)
    import psutil

    return int(psutil.virtual_memory().total)


def available_memory_bytes() -> int:
    """Memory that can still be allocated now (free + reclaimable)."""
    import psutil

    return int(psutil.virtual_memory().available)


# Below this share of memory free, with swap in use, the machine is taken to be paging.
PAGING_FREE_SHARE = 0.1


def memory_pressure() -> bool:
    """Whether the machine is short of memory now: little is free and swap is in use."""
    import psutil

    memory = psutil.virtual_memory()
    return memory.available < PAGING_FREE_SHARE * memory.total and psutil.swap_memory().used > 0
