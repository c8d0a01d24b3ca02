"""The real daemon, started with its console script, and worker processes over TCP."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def daemon() -> Iterator[str]:
    exe = shutil.which("omnireduce-aggregator", path=os.path.dirname(sys.executable)) or shutil.which(
        "omnireduce-aggregator"
    )
    assert exe, "the omnireduce-aggregator console script is not installed"
    proc = subprocess.Popen(
        [exe, "--listen", "tcp://127.0.0.1:0", "--timeout", "60", "--log-level", "info"],
        stderr=subprocess.PIPE, text=True,
    )
    assert proc.stderr is not None
    address = None
    for line in proc.stderr:
        m = re.search(r"listening on (tcp://127\.0\.0\.1:(\d+))", line)
        if m:
            address = m.group(1)
            assert int(m.group(2)) > 0
            break
    assert address, f"daemon exited with {proc.poll()} before listening"
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    try:
        yield address
        assert proc.poll() is None, "daemon died: " + "".join(log)
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


def _spawn(address: str, rank: int, world: int, job: str, elements: int, density: float, ops: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.proc_worker", "--address", address, "--rank", str(rank), "--world", str(world),
         "--job", job, "--elements", str(elements), "--density", str(density), "--ops", str(ops)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )


def _reports(procs: list[subprocess.Popen]) -> list[list[dict]]:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr
        out.append(json.loads(stdout))
    return out


def test_three_workers_two_jobs_at_once(daemon: str) -> None:
    procs = [_spawn(daemon, r, 3, "alpha", 200_000, 0.05, 4) for r in range(3)]
    procs += [_spawn(daemon, r, 2, "beta", 123_457, 0.3, 4) for r in range(2)]
    reports = _reports(procs)
    for rep in reports:
        assert len(rep) == 4
        assert all(op["exact"] for op in rep)
        assert [op["op"] for op in rep] == [0, 1, 2, 3]


def test_bytes_sent_at_one_percent_density(daemon: str) -> None:
    elements = 2_560_000  # 10,000 blocks, 10 MB of float32
    procs = [_spawn(daemon, r, 3, "bytes", elements, 0.01, 2) for r in range(3)]
    for rep in _reports(procs):
        for op in rep:
            assert op["exact"]
            # Exactly the nonzero blocks are sent: 1% of dense, plus headers and pointers.
            assert op["blocks_sent"] == op["nonzero_blocks"] == 100
            payload = op["nonzero_blocks"] * 256 * 4
            assert payload <= op["bytes_sent"] <= payload + 20_000
            assert op["bytes_sent"] / op["dense_bytes"] < 0.0115


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_daemon_stops_on_a_signal_with_its_summary(sig: signal.Signals) -> None:
    # The handler only notes the signal; the main thread shuts down (a handler that took a
    # lock, as threading.Event.set does, could deadlock against the main thread holding it).
    proc = subprocess.Popen(
        [sys.executable, "-m", "aggregator", "--listen", "tcp://127.0.0.1:0", "--log-level", "info"],
        stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "listening on" in line:
                break
        proc.send_signal(sig)
        _, rest = proc.communicate(timeout=10)
        assert proc.returncode == 0
        assert f"signal {int(sig)}: shutting down" in rest and "completed 0 ops, failed 0" in rest
    finally:
        proc.kill()
        proc.wait()


def test_the_demo_refuses_bad_arguments_and_stops_when_a_worker_dies() -> None:
    import multiprocessing as mp
    import time

    from worker.demo import _collect, main

    with pytest.raises(SystemExit):
        main(["--workers", "0"])  # it printed "OK" for no worker at all
    # A worker that raised (its traceback printed) ends the wait at once, not after 300 s.
    ctx = mp.get_context("spawn")
    dead = ctx.Process(target=sys.exit, args=(3,))
    dead.start()
    dead.join()
    started = time.monotonic()
    with pytest.raises(SystemExit, match=r"worker\(s\) \[0\] exited with an error"):
        _collect(ctx.Queue(), [dead])
    assert time.monotonic() - started < 10
