"""What this machine has, asked without importing torch: the command line checks a request's memory before loading."""

from __future__ import annotations

import os

FALLBACK_RAM_BYTES = 4 * 2**30
"""Assumed available memory where the operating system does not say (``sysconf`` is POSIX only)."""


def available_ram_bytes() -> int:
    """Bytes of RAM a new allocation can get now, or `FALLBACK_RAM_BYTES` where the system does not say.

    Linux's ``MemAvailable`` counts the page cache the kernel would give back; free pages alone (``sysconf``, the
    fallback elsewhere) do not, and on a machine with a warm cache would refuse requests that fit."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return FALLBACK_RAM_BYTES
