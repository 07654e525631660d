"""The Apple GPU's core count, which Metal does not expose: read from the IORegistry.

``ioreg -a -r -d 1 -c AGXAccelerator`` prints the GPU's registry entry as a plist; its
``gpu-core-count`` sets how many threadgroups split-KV decode aims for (csrc/common/device.h).
"""

from __future__ import annotations

import plistlib
import subprocess
import sys
from collections.abc import Callable
from xml.parsers.expat import ExpatError

IOREG = ("/usr/sbin/ioreg", "-a", "-r", "-d", "1", "-c", "AGXAccelerator")
# Apple GPUs have had 7 to 80 cores; anything outside this is a misread.
_PLAUSIBLE = range(1, 1025)


def parse_gpu_core_count(output: bytes) -> int | None:
    """The ``gpu-core-count`` of the first accelerator in ``ioreg -a`` output, or None."""
    try:
        entries = plistlib.loads(output)
    except (ValueError, ExpatError):
        return None
    if isinstance(entries, dict):
        entries = [entries]
    if not isinstance(entries, list):
        return None
    for entry in entries:
        cores = entry.get("gpu-core-count") if isinstance(entry, dict) else None
        if isinstance(cores, int) and not isinstance(cores, bool) and cores in _PLAUSIBLE:
            return cores
    return None


def read_gpu_core_count(
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
) -> int | None:
    """This Mac's GPU core count, or None (not macOS, no ioreg, no such entry)."""
    if sys.platform != "darwin":
        return None
    try:
        result = run(IOREG, capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    return parse_gpu_core_count(result.stdout)
