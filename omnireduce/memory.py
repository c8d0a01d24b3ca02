"""Keeps glibc's malloc from returning an op's buffers to the kernel just before the next op needs them.

An op allocates and frees megabytes of arrays (received payloads, union rows,
results). glibc's thresholds are dynamic: a freed buffer above the trim
threshold is handed back to the kernel (or was mmapped in the first place), so
the next op's buffer of the same size faults in every page again. On a 2-core
machine, 4 co-located ranks doing 1% rows ops of 100 MB measured in some
processes (not all: it depends on how allocations fall into arenas) about 2,000
page faults and 4.5 ms of system time per op, 70% more CPU for the whole op.

:func:`tune_malloc` fixes the thresholds once per process (``mallopt``): buffers
up to 32 MiB come from the heap and the heap keeps up to 256 MiB of free memory
instead of trimming it. The process may hold that much more memory than it
uses. Skipped where ``OMNIREDUCE_MALLOC_TUNE=0``, where the process set glibc's
own ``MALLOC_*`` variables or ``GLIBC_TUNABLES`` (its choice stands), and where
the C library has no ``mallopt`` (not glibc).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading

from omnireduce import config

logger = logging.getLogger(__name__)

__all__ = ["tune_malloc", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Allocations below this come from the heap, not mmap (glibc's largest allowed value on 64-bit).
MMAP_THRESHOLD = 32 << 20
#: Free memory at the heap's top kept instead of returned to the kernel.
TRIM_THRESHOLD = 256 << 20
_OWN_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")

_lock = threading.Lock()
_result: bool | None = None


def tune_malloc() -> bool:
    """Fixes glibc's malloc thresholds, once per process; returns whether they are fixed.

    Raises:
        ConfigError: ``OMNIREDUCE_MALLOC_TUNE`` is neither "0" nor "1".
    """
    global _result
    with _lock:
        if _result is not None:
            return _result
        _result = _apply()
        return _result


def _apply() -> bool:
    wanted = config.resolve(None, config.OMNIREDUCE_MALLOC_TUNE, "1", _flag)
    if wanted != "1":
        return False
    own = [v for v in _OWN_VARIABLES if v in os.environ]
    if own:
        logger.debug("malloc thresholds left to the process's own %s", ", ".join(own))
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if ok:
        logger.debug("malloc thresholds fixed: mmap above %d bytes, trim above %d", MMAP_THRESHOLD, TRIM_THRESHOLD)
    else:
        logger.info("mallopt refused the thresholds; malloc keeps its defaults")
    return ok


def _flag(text: str) -> str:
    if text not in ("0", "1"):
        raise ValueError('must be "0" or "1"')
    return text
