"""What this machine has, asked without importing torch: the command line checks a request's memory before loading."""

from __future__ import annotations

import os

FALLBACK_RAM_BYTES = 4 * 2**30
"""Assumed available memory where the operating system does not say (``sysconf`` is POSIX only)."""


def available_ram_bytes() -> int:
    """Bytes of RAM available now (free pages), or `FALLBACK_RAM_BYTES` where the system does not say."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return FALLBACK_RAM_BYTES
