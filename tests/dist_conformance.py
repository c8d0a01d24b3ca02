"""Runs torch's own generic distributed test suite against a torch.distributed backend.

torch runs ``torch.testing._internal.distributed.distributed_test``'s
``DistributedTest._DistTestBase`` cases for each of its backends
(``test/distributed/test_distributed_spawn.py``: BACKEND, WORLD_SIZE, TEMP_DIR in
the environment, one process per rank per test, a fresh process group per test).
This module runs the same bodies on "gloo" (the reference) or on "omnireduce"::

    python -m tests.dist_conformance --backend omnireduce test_all_reduce_sum test_barrier
    python -m tests.dist_conformance --backend gloo --all --json /tmp/gloo.json
    python -m tests.dist_conformance --list

The world size comes from ``WORLD_SIZE`` (default 2; torch's ``*_group`` tests, on
the subgroup of ranks [1, 2], run only from 8). It prints one line per test (PASS,
FAIL, SKIP, or ERROR with each failing rank's exception) and, with ``--json``,
writes every result (rewritten after each test, so a run cut short keeps what it
finished) for ``tests/test_torch_conformance.py``.

How the bodies are made to run on our backend:

* ``distributed_test`` reads ``BACKEND`` when it is imported and its decorators
  decide then which tests skip (``BACKEND != "gloo"``, ``backend_feature["ddp"]``,
  ...). It is always imported with ``BACKEND=gloo``, so both backends see gloo's
  CPU selection, and the list of tests to run is given explicitly.
* In each rank, the process group is made with the backend under test, and the
  module global ``distributed_test.BACKEND`` (read by the bodies at run time, e.g.
  ``test_get_backend`` compares it with ``dist.get_backend()``) is set to that
  backend's name, except for the tests in :data:`GLOO_CPU_PATH`, whose bodies
  choose between gloo's and nccl's code paths by the name: they keep "gloo".
* With "omnireduce", every test gets its own :class:`aggregator.Aggregator` in
  this process; the ranks get ``OMNIREDUCE_ADDRESS`` and ``OMNIREDUCE_TIMEOUT``
  (:data:`OP_TIMEOUT_S`), so a collective that cannot complete fails in seconds.
* The ranks are forked from a forkserver that has imported this module (torch,
  ``distributed_test``, the backend) once, instead of spawning fresh interpreters
  (about 4 s of imports per rank per test on two cores). Each rank gets the
  test's environment (TEMP_DIR, INIT_METHOD, the aggregator) through its
  arguments. ``--start-method spawn`` does it torch's way.
* Once a rank failed, the others get :data:`ERROR_GRACE_S` to fail too before they
  are killed (torch kills them at once), so every rank's own error is reported.
* A test skipped (by a decorator or in a rank) is reported as SKIP, never as a
  pass: ``SANDCASTLE``/``TW_JOB_USER``, which make torch's skips pass, are removed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback
import unittest
from datetime import timedelta
from typing import Any

# distributed_test and common_utils read these at import.
os.environ["BACKEND"] = "gloo"
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.pop("SANDCASTLE", None)
os.environ.pop("TW_JOB_USER", None)
os.environ["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"  # no "To execute this test, run ..." after each traceback
os.environ.pop("OMNIREDUCE_JOB", None)  # one job for every group would mix the subgroups' ops

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as tmp  # noqa: E402
from torch.testing._internal import common_distributed, common_utils  # noqa: E402
from torch.testing._internal.distributed import distributed_test as dt  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

assert not common_utils.IS_SANDCASTLE, "torch's sandcastle mode turns skips into passes"

OMNIREDUCE = "omnireduce"
BACKENDS = ("gloo", OMNIREDUCE)
# Seconds an omnireduce collective waits for the other ranks (worker and aggregator).
OP_TIMEOUT_S = 20
# Seconds a test may run before its ranks are killed (torch's default is 300).
DEFAULT_TEST_TIMEOUT_S = 120
# Seconds the other ranks get to fail too once one rank failed, before they are killed (torch
# kills them at once, so which rank's error is reported is a race).
ERROR_GRACE_S = 3.0

# Tests whose bodies pick gloo's or nccl's code path by the BACKEND name (e.g.
# ``if BACKEND == "gloo": ... else: <CUDA streams>``): on omnireduce they run
# gloo's CPU path, which is the one our backend implements.
GLOO_CPU_PATH: frozenset[str] = frozenset({
    # _test_accumulate_gradients_no_sync builds its CPU model only `if BACKEND == "mpi" or BACKEND == "gloo"`.
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_accumulate_gradients_no_sync_grad_is_view",
})

_ENV_KEYS = ("TEMP_DIR", "INIT_METHOD", "MASTER_ADDR", "WORLD_SIZE", "CONFORMANCE_BACKEND", "CONFORMANCE_TRACE_DIR",
             "OMNIREDUCE_ADDRESS", "OMNIREDUCE_TIMEOUT")
# The process group methods that --trace records (those that torch's c10d calls on a backend).
_TRACED = ("allreduce", "allreduce_coalesced", "broadcast", "allgather", "_allgather_base", "allgather_coalesced",
           "allgather_into_tensor_coalesced", "barrier", "reduce", "reduce_scatter", "_reduce_scatter_base",
           "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base", "gather", "scatter", "send", "recv",
           "recv_anysource", "monitored_barrier", "all_gather_single", "all_gather_single_coalesced",
           "reduce_scatter_single", "reduce_scatter_single_coalesced", "all_to_all_single")


def all_test_names() -> list[str]:
    """Every test of torch's ``DistributedTest._DistTestBase``, sorted."""
    return sorted(n for n in dir(DistributedTest._DistTestBase) if n.startswith("test_"))


def ensure_backend_registered() -> None:
    """Registers "omnireduce" with torch.distributed if its entry point did not."""
    if OMNIREDUCE.upper() in dist.Backend._plugins:
        return
    import worker.backend as backend  # registers on import (older versions) or through register()

    if OMNIREDUCE.upper() not in dist.Backend._plugins and hasattr(backend, "register"):
        backend.register()


def _describe_call(method: str, args: tuple, kwargs: dict) -> list[str]:
    """One line per tensor argument: method, dtype, layout, contiguity, reduce op."""
    tensors: list[torch.Tensor] = []
    op = ""

    def walk(x: Any) -> None:
        nonlocal op
        if isinstance(x, torch.Tensor):
            tensors.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif hasattr(x, "reduceOp"):
            op = str(getattr(x.reduceOp, "op", x.reduceOp)).split(".")[-1]

    walk(list(args) + list(kwargs.values()))
    if not tensors:
        return [method]
    lines = set()
    for t in tensors:
        layout = str(t.layout).split(".")[-1]
        shape = "0-dim" if t.dim() == 0 else ("empty" if t.numel() == 0 else "")
        contiguous = "" if t.layout != torch.strided or t.is_contiguous() else "non-contiguous"
        lines.add(" ".join(x for x in (method, str(t.dtype).split(".")[-1], layout, op, shape, contiguous) if x))
    return sorted(lines)


def _install_trace(pg_class: type, path: str) -> None:
    """Appends what every call of pg_class's collectives carries to path (one JSON line per call)."""
    for name in _TRACED:
        method = pg_class.__dict__.get(name)
        if method is None:
            continue

        def traced(self: Any, *args: Any, _name: str = name, _method: Any = method, **kwargs: Any) -> Any:
            with open(path, "a") as f:
                f.write(json.dumps(_describe_call(_name, args, kwargs)) + "\n")
            return _method(self, *args, **kwargs)

        setattr(pg_class, name, traced)


def _backend_under_test() -> str:
    backend = os.environ.get("CONFORMANCE_BACKEND", "gloo")
    if backend not in BACKENDS:
        raise ValueError(f"CONFORMANCE_BACKEND must be one of {BACKENDS}, not {backend!r}")
    return backend


class ConformanceTest(TestDistBackend, DistributedTest._DistTestBase):
    """torch's distributed test cases, one rank process per rank, on CONFORMANCE_BACKEND."""

    start_method = "forkserver"

    def setUp(self) -> None:
        super().setUp()  # temp directories (TEMP_DIR, INIT_METHOD in os.environ), the file barrier
        self._aggregator = None
        os.environ["CONFORMANCE_BACKEND"] = backend = _backend_under_test()
        if backend == OMNIREDUCE:
            from aggregator import Aggregator

            self._aggregator = Aggregator(listen="tcp://127.0.0.1:0", timeout=float(OP_TIMEOUT_S)).start()
            os.environ["OMNIREDUCE_ADDRESS"] = self._aggregator.address
            os.environ["OMNIREDUCE_TIMEOUT"] = str(OP_TIMEOUT_S)
        self._rank_env = {k: os.environ[k] for k in _ENV_KEYS if k in os.environ}
        try:
            self._start_processes(tmp.get_context(self.start_method).Process)
        except BaseException:
            self.tearDown()  # unittest does not call it when setUp raises
            raise

    def tearDown(self) -> None:
        try:
            super().tearDown()
        finally:
            if self._aggregator is not None:
                self._aggregator.close()
                self._aggregator = None
            for k in ("OMNIREDUCE_ADDRESS", "OMNIREDUCE_TIMEOUT"):
                os.environ.pop(k, None)

    def _start_processes(self, proc: Any) -> None:
        # MultiProcessTestCase._start_processes, with the test's environment passed to each rank.
        self.processes = []
        for rank in range(int(self.world_size)):
            parent_conn, child_conn = tmp.Pipe()
            process = proc(
                target=self.__class__._run,
                name=f"process {rank}",
                args=(rank, self._current_test_name(), self.file_name, child_conn),
                kwargs={"rank_env": self._rank_env},
            )
            process.start()
            self.pid_to_pipe[process.pid] = parent_conn
            self.processes.append(process)

    def _join_processes(self, fn: Any) -> None:
        # MultiProcessTestCase._join_processes, except that once a rank failed, the others get
        # ERROR_GRACE_S to fail as well, so that every rank's own error is reported.
        timeout = common_distributed.get_timeout(self.id())
        start = time.time()
        first_error = None
        try:
            while not all(p.exitcode is not None for p in self.processes):
                now = time.time()
                if first_error is None and any(p.exitcode == self.TEST_ERROR_EXIT_CODE for p in self.processes):
                    first_error = now
                if first_error is not None and now - first_error > ERROR_GRACE_S:
                    for p in self.processes:
                        p.terminate()
                    for p in self.processes:
                        p.join(10)
                    break
                if now - start > timeout:
                    self._get_timedout_process_traceback()
                    print(f"Timing out after {timeout} seconds and killing subprocesses.", flush=True)
                    for p in self.processes:
                        p.terminate()
                    break  # the ranks' exit codes stay unset: _check_return_codes reports the timeout
                time.sleep(0.05)
            self._check_return_codes(fn, time.time() - start)
        finally:
            for pipe in self.pid_to_pipe.values():
                pipe.close()

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, pipe: Any, rank_env: dict | None = None,
             **kwargs: Any) -> None:
        # TestDistBackend._run, with the process group on the backend under test.
        os.environ.update(rank_env or {})
        backend = _backend_under_test()
        if backend == OMNIREDUCE:
            ensure_backend_registered()
        trace_dir = os.environ.get("CONFORMANCE_TRACE_DIR")
        if trace_dir and backend == OMNIREDUCE:
            from worker.backend import OmniReduceProcessGroup

            _install_trace(OmniReduceProcessGroup, os.path.join(trace_dir, f"{test_name}.rank{rank}.jsonl"))
        dt.BACKEND = "gloo" if test_name in GLOO_CPU_PATH else backend
        dt.INIT_METHOD = os.environ["INIT_METHOD"]
        self = cls(test_name)
        self.rank = rank
        self.file_name = file_name
        timeout = timedelta(seconds=dt.CUSTOM_PG_TIMEOUT.get(test_name, dt.default_pg_timeout))
        dist.init_process_group(init_method=self.init_method, backend=backend, world_size=int(self.world_size),
                                rank=rank, timeout=timeout)
        if dist.get_backend() != backend:
            raise RuntimeError(f"the process group runs on {dist.get_backend()!r}, not {backend!r}")
        self._barrier()
        self.run_test(test_name, pipe)
        self._barrier()
        dist.destroy_process_group()
        sys.exit(0)


class _Result(unittest.TestResult):
    def __init__(self) -> None:
        super().__init__()
        self.outcome = "PASS"
        self.detail = ""

    def addFailure(self, test: Any, err: Any) -> None:  # noqa: N802 - unittest's name
        super().addFailure(test, err)
        self.outcome, self.detail = "FAIL", self._exc_info_to_string(err, test)

    def addError(self, test: Any, err: Any) -> None:  # noqa: N802
        super().addError(test, err)
        self.outcome, self.detail = "ERROR", self._exc_info_to_string(err, test)

    def addSkip(self, test: Any, reason: str) -> None:  # noqa: N802
        super().addSkip(test, reason)
        self.outcome, self.detail = "SKIP", reason

    def addExpectedFailure(self, test: Any, err: Any) -> None:  # noqa: N802
        super().addExpectedFailure(test, err)
        self.outcome, self.detail = "FAIL", "expected failure: " + self._exc_info_to_string(err, test)

    def addUnexpectedSuccess(self, test: Any) -> None:  # noqa: N802
        super().addUnexpectedSuccess(test)
        self.outcome, self.detail = "FAIL", "unexpected success"


_RANK_ERROR = re.compile(r"Process (\d+) exited with error code \d+ and exception:\n(.*?)(?=\nProcess \d+ exited|\Z)",
                         re.S)


def exception_text(tb: str, max_lines: int = 6) -> str:
    """The exception (type and message) at the end of a formatted traceback."""
    lines = tb.rstrip().splitlines()
    last_frame = max((i for i, ln in enumerate(lines) if ln.startswith("  File ")), default=-1)
    i = last_frame + 1
    while last_frame >= 0 and i < len(lines) and lines[i].startswith("    "):
        i += 1  # the frame's source line and its ^^^ markers
    exc = [ln for ln in lines[i:] if ln.strip()]
    return "\n".join(exc[:max_lines]) if exc else (lines[-1] if lines else "")


def summarize(detail: str) -> str:
    """Each failing rank's exception, or the test's own when no rank failed (e.g. a timeout)."""
    ranks = _RANK_ERROR.findall(detail)
    if ranks:
        return "\n".join(f"rank {rank}: {exception_text(tb)}" for rank, tb in ranks)
    return exception_text(detail)


def _read_trace(trace_dir: str, name: str) -> list[str]:
    calls: set[str] = set()
    for f in os.listdir(trace_dir):
        if f.startswith(name + ".rank"):
            with open(os.path.join(trace_dir, f)) as fh:
                for line in fh:
                    calls.update(json.loads(line))
    return sorted(calls)


def run_one(name: str, backend: str, timeout_s: float, trace_dir: str | None = None) -> dict[str, Any]:
    """Runs one test of ConformanceTest on backend; returns its outcome (PASS, FAIL, ERROR, SKIP)."""
    os.environ["CONFORMANCE_BACKEND"] = backend
    if trace_dir:
        os.environ["CONFORMANCE_TRACE_DIR"] = trace_dir
    common_distributed.get_timeout = lambda test_id: timeout_s
    start = time.monotonic()
    result = _Result()
    try:
        ConformanceTest(name).run(result)
    except Exception:  # noqa: BLE001 - reported as this test's error
        result.outcome, result.detail = "ERROR", traceback.format_exc()
    r = {"name": name, "backend": backend, "world_size": int(os.environ["WORLD_SIZE"]), "outcome": result.outcome,
         "summary": summarize(result.detail) if result.outcome != "SKIP" else result.detail,
         # Each rank that failed (exit code 10): its exception.
         "rank_errors": {rank: exception_text(tb) for rank, tb in _RANK_ERROR.findall(result.detail)},
         "detail": result.detail[-20000:], "seconds": round(time.monotonic() - start, 2)}
    if trace_dir:
        r["calls"] = _read_trace(trace_dir, name)
    return r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="test names (test_...)")
    p.add_argument("--backend", choices=BACKENDS, default=OMNIREDUCE)
    p.add_argument("--all", action="store_true", help="every test of DistributedTest._DistTestBase")
    p.add_argument("--list", action="store_true", help="print every test name and exit")
    p.add_argument("--json", help="write the results here (after each test)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TEST_TIMEOUT_S, help="seconds per test")
    p.add_argument("--start-method", choices=("forkserver", "spawn"), default="forkserver")
    p.add_argument("--trace", metavar="DIR", help="omnireduce: record in DIR (and in the results) what each test's "
                   "collectives carry (method, dtype, layout, reduce op)")
    args = p.parse_args(argv)
    known = all_test_names()
    if args.list:
        print("\n".join(known))
        return 0
    names = known if args.all else args.names
    unknown = [n for n in names if n not in known]
    if unknown:
        p.error(f"not tests of DistributedTest._DistTestBase: {unknown}")
    ConformanceTest.start_method = args.start_method
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    if args.start_method == "forkserver":
        tmp.get_context("forkserver").set_forkserver_preload([__name__, "worker.backend", "aggregator"])
    report: dict[str, Any] = {"backend": args.backend, "world_size": int(os.environ["WORLD_SIZE"]),
                              "torch": torch.__version__, "all_tests": known, "results": {}}
    start = time.monotonic()
    for i, name in enumerate(names, 1):
        r = run_one(name, args.backend, args.timeout, args.trace)
        report["results"][name] = r
        print(f"[{i}/{len(names)}] {r['outcome']:5} {name} ({r['seconds']:.1f}s) {r['summary'][:400]}", flush=True)
        if args.json:
            tmpfile = args.json + ".tmp"
            with open(tmpfile, "w") as f:
                json.dump(report, f, indent=1)
            os.replace(tmpfile, args.json)
    counts: dict[str, int] = {}
    for r in report["results"].values():
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    print(f"{args.backend}: {counts} in {time.monotonic() - start:.0f}s", flush=True)
    return 0 if set(counts) <= {"PASS"} else 1


if __name__ == "__main__":
    # Run through the importable module, whose ConformanceTest the ranks find by its name; and keep
    # multiprocessing from re-running this file as __mp_main__ in every rank (it would if __main__
    # had a module name or a path).
    __spec__ = None
    del __file__
    from tests.dist_conformance import main as _main

    sys.exit(_main())
