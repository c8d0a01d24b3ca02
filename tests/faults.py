"""Fault injection for the reliability tests: a worker process driven line by line, and helpers.

Run as ``python -m tests.faults --address A --rank R --world W --job J [--generation G]``,
the process builds a :class:`worker.Worker`, prints ``{"ready": true}`` and then
executes one JSON command per stdin line, answering one JSON line each:

- ``{"cmd": "allreduce", "seed": S, "n": N}``: reduces :func:`tensor` (S, R, N) and
  answers ``{"ok": true, "exact": ...}`` (equal to the sum over all ranks) or
  ``{"ok": false, "error": class name, "message": ...}``.
- the same with ``"hang": true``: the op starts (START sent), then the worker's
  communication thread blocks on the op's first result, after answering
  ``{"hanging": true}``; the process is meant to be killed there (mid-op).
- ``{"cmd": "exit"}``.

The test process sends the signals (SIGKILL, SIGSTOP, SIGCONT) itself, to these
workers and to the daemon processes of :func:`start_daemon`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tests.helpers import ROOT, sparse


def tensor(seed: int, rank: int, n: int) -> np.ndarray:
    """A sparse float32 input with integer values (sums are exact), distinct per seed and rank."""
    return sparse(np.random.default_rng(seed * 1000 + rank), n, 0.3, low=-20, high=20)


def expected(seed: int, world: int, n: int) -> np.ndarray:
    return sum(tensor(seed, r, n) for r in range(world))


def start_daemon(listen: str, *args: str, prefix: Sequence[str] = ()) -> tuple[subprocess.Popen, str]:
    """``omnireduce-aggregator --listen LISTEN ARGS...`` as a process (behind ``prefix``, e.g.
    ``ip netns exec NS``); returns it and the address it listens on (port 0 resolved) once it
    says so."""
    exe = shutil.which("omnireduce-aggregator", path=os.path.dirname(sys.executable))
    assert exe, "the omnireduce-aggregator console script is not installed"
    proc = subprocess.Popen([*prefix, exe, "--listen", listen, *args], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        m = re.search(r"listening on (tcp://[\d.]+:\d+)", line)
        if m:
            threading.Thread(target=lambda: proc.stderr.read(), daemon=True).start()  # type: ignore[union-attr]
            return proc, m.group(1)
    raise AssertionError(f"daemon exited with {proc.wait()} before listening")


class Proc:
    """A worker process (see the module docstring) with a line-based command channel."""

    def __init__(self, address: str, rank: int, world: int, job: str, generation: int = 0, **env: str) -> None:
        self.rank = rank
        self.p = subprocess.Popen(
            [sys.executable, "-m", "tests.faults", "--address", address, "--rank", str(rank), "--world", str(world),
             "--job", job, "--generation", str(generation)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            env={**os.environ, **env},
        )
        self.lines: list[dict[str, Any]] = []
        self._cv = threading.Condition()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.p.stderr or []), daemon=True).start()
        self.wait_for(lambda m: m.get("ready"), 30)

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            with self._cv:
                self.lines.append(json.loads(line))
                self._cv.notify_all()

    def wait_for(self, pred: Callable[[dict[str, Any]], Any], timeout: float) -> dict[str, Any]:
        """The first line (oldest first) matching ``pred``, consumed."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for i, m in enumerate(self.lines):
                    if pred(m):
                        return self.lines.pop(i)
                left = deadline - time.monotonic()
                if left <= 0 or self.p.poll() is not None and not self.lines:
                    raise AssertionError(f"rank {self.rank}: no answer; stderr: {''.join(self.stderr)[-3000:]}")
                self._cv.wait(min(left, 0.2))

    def send(self, **cmd: Any) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def allreduce(self, seed: int, n: int, timeout: float = 30) -> dict[str, Any]:
        self.send(cmd="allreduce", seed=seed, n=n)
        return self.wait_for(lambda m: "ok" in m, timeout)

    def signal(self, sig: int) -> None:
        os.kill(self.p.pid, sig)

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                os.kill(self.p.pid, signal.SIGCONT)
                self.send(cmd="exit")
                self.p.wait(5)
            except (OSError, subprocess.TimeoutExpired, BrokenPipeError):
                self.p.kill()
                self.p.wait(5)


def _hang_in_op(ready: Callable[[], None]) -> None:
    """Makes the next op block its worker's communication thread on its first result."""
    from worker import op as op_module

    original = op_module.WorkerOp.on_result

    def on_result(self: Any, msg: Any, data: Any) -> Any:
        ready()
        threading.Event().wait()  # until the process is killed
        return original(self, msg, data)

    op_module.WorkerOp.on_result = on_result  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--generation", type=int, default=0)
    args = p.parse_args()
    from worker import Worker

    lock = threading.Lock()

    def say(**msg: Any) -> None:
        with lock:
            print(json.dumps(msg), flush=True)

    with Worker(args.address, rank=args.rank, world_size=args.world, job=args.job, generation=args.generation,
                timeout=60) as w:
        say(ready=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "exit":
                break
            if cmd.get("hang"):
                _hang_in_op(lambda: say(hanging=True))
            x = tensor(cmd["seed"], args.rank, cmd["n"])
            try:
                y = w.allreduce(x)
            except Exception as e:  # noqa: BLE001 - reported to the test
                say(ok=False, error=type(e).__name__, message=str(e))
                continue
            say(ok=True, exact=bool(np.array_equal(y, expected(cmd["seed"], args.world, cmd["n"]))))


if __name__ == "__main__":
    main()
