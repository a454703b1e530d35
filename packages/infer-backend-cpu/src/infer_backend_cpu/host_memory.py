"""Host memory figures without psutil: /proc/meminfo on Linux, sysconf elsewhere."""

from __future__ import annotations

import os
from pathlib import Path

from infer_core.ports.backend import MemoryInfo

_MEMINFO = Path("/proc/meminfo")


def _meminfo_kib() -> dict[str, int]:
    values: dict[str, int] = {}
    for line in _MEMINFO.read_text().splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            values[key] = int(fields[0])
    return values


def host_memory_info() -> MemoryInfo:
    if _MEMINFO.is_file():
        kib = _meminfo_kib()
        if "MemTotal" in kib:
            # MemAvailable counts reclaimable page cache; MemFree alone would understate what we can use.
            free = kib.get("MemAvailable", kib.get("MemFree", 0))
            return MemoryInfo(free_bytes=free * 1024, total_bytes=kib["MemTotal"] * 1024)
    page = os.sysconf("SC_PAGE_SIZE")
    return MemoryInfo(free_bytes=page * os.sysconf("SC_AVPHYS_PAGES"), total_bytes=page * os.sysconf("SC_PHYS_PAGES"))
