"""glibc's malloc thresholds: fixed once per process, so an op's freed buffers are not faulted in again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Allocates 40 buffers of 1 MiB, touches and frees them, three times; prints whether the
# thresholds were fixed and the page faults of the third time.
_CYCLES = """
import ctypes, json, resource
from omnireduce import memory
applied = memory.tune_malloc()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def cycle():
    ps = [libc.malloc(1 << 20) for _ in range(40)]
    for p in ps:
        ctypes.memset(p, 1, 1 << 20)
    for p in ps:
        libc.free(p)
cycle(); cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
cycle()
print(json.dumps([applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before]))
"""


def _run(**env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "OMNIREDUCE_"))}
    return subprocess.run([sys.executable, "-c", _CYCLES], cwd=ROOT, env={**clean, **env}, capture_output=True,
                          text=True, timeout=60)


def _faults(**env: str) -> tuple[bool, int]:
    res = _run(**env)
    assert res.returncode == 0, res.stderr
    applied, faults = json.loads(res.stdout.strip().splitlines()[-1])
    return applied, faults


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tuned_heap_keeps_freed_buffers() -> None:
    applied, faults = _faults()
    assert applied
    # 40 MiB freed and allocated again: kept by the heap, no page faulted in again.
    assert faults < 1000, faults


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_untuned_heap_faults_again() -> None:
    """The control: glibc's own thresholds return the 40 MiB to the kernel each time."""
    applied, faults = _faults(OMNIREDUCE_MALLOC_TUNE="0")
    assert not applied
    assert faults > 5000, faults


def test_process_own_malloc_settings_win() -> None:
    applied, _ = _faults(MALLOC_TRIM_THRESHOLD_="1000000")
    assert not applied


def test_bad_value_is_a_clear_error() -> None:
    res = _run(OMNIREDUCE_MALLOC_TUNE="yes")
    assert res.returncode != 0
    assert "OMNIREDUCE_MALLOC_TUNE" in res.stderr and "ConfigError" in res.stderr
