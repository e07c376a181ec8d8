"""What this machine has, asked without importing torch: the command line checks a request's memory before loading."""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

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


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or ``None`` where the C library has none (macOS, musl, Windows)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def return_freed_heap_to_os() -> None:
    """Hand the pages of freed memory that glibc's heap still holds back to the operating system; a no-op where the
    C library is not glibc.

    glibc serves tensors up to its dynamic mmap threshold (which rises to the largest freed block, up to 32 MiB) from
    its heap and keeps the pages of freed blocks resident for reuse; since glibc 2.8 ``malloc_trim`` returns the
    whole free pages anywhere in the heap, not only at its top. The memory stays reserved (a later allocation faults
    its pages in again), so results are unchanged; only the resident set between the call and that reuse shrinks."""
    trim = _malloc_trim()
    if trim is None:
        return
    try:
        trim(0)
    except Exception:  # housekeeping must never fail a measurement
        pass
