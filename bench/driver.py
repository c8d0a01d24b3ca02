"""Starts the aggregator and the rank processes of one world, collects rank 0's results, and
cleans up; used by both the loopback and the cluster benchmark."""

from __future__ import annotations

import json
import logging
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from bench.common import RankSpec, is_colocated

logger = logging.getLogger(__name__)

__all__ = [
    "BenchError", "Placement", "run_world", "start_aggregators", "release_aggregators", "collect", "child_env",
    "log_tail", "stop_all", "launch_rank", "ROOT",
]

#: The repository root, put on the children's PYTHONPATH so ``bench`` imports anywhere.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_GRACE_S = 5.0


class BenchError(RuntimeError):
    """A benchmark process failed or the run went past its time limit."""


@dataclass
class Placement:
    """Where the processes of a world run.

    Args:
        aggregators: (listen endpoint, command prefix, e.g. ``ip netns exec NS``) of
            every aggregator process, one per shard.
        rank_prefixes: command prefix of every rank; its length is the world size.
        rank_env: extra environment of every rank (e.g. ``GLOO_SOCKET_IFNAME``).
        rank_listen: the endpoint every rank's own aggregator shard listens on, for
            "omnireduce-colocated" (an address the other ranks reach it by; port 0).
    """

    aggregators: list[tuple[str, list[str]]]
    rank_prefixes: list[list[str]] = field(default_factory=list)
    rank_env: list[dict[str, str]] = field(default_factory=list)
    rank_listen: list[str] = field(default_factory=list)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


def log_tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def stop_all(procs: Sequence[subprocess.Popen]) -> None:
    """Terminates the processes still running (killed after a grace period); closes their pipes."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + _GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for p in procs:
        if p.stdout is not None:
            p.stdout.close()


def _readline(stream: IO[str], deadline: float, what: str) -> str:
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    try:
        left = deadline - time.monotonic()
        if left <= 0 or not sel.select(left):
            raise BenchError(f"timed out waiting for {what}")
        return stream.readline()
    finally:
        sel.close()


def run_world(
    spec: RankSpec,
    placement: Placement,
    run_dir: str,
    deadline: float,
    on_event: Callable[[dict[str, Any]], None],
) -> None:
    """Runs one world: an aggregator process and ``spec.world_size`` rank processes.

    Args:
        spec: the ranks' specification; ``address`` and ``store`` are filled in here.
        placement: where each process runs.
        run_dir: folder for the spec, the rendezvous file and every process's log.
        deadline: ``time.monotonic()`` after which everything is killed and BenchError raised.
        on_event: called with every result event of rank 0.

    Raises:
        BenchError: a process failed or the deadline passed; the logs' tails are in the message.
    """
    if len(placement.rank_prefixes) != spec.world_size:
        raise ValueError("one rank prefix per rank is required")
    # Absolute: the rendezvous file goes into a file:// URL, where a relative path would
    # read as a host name.
    run_dir = os.path.abspath(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    w = spec.world_size
    procs: list[subprocess.Popen] = []
    logs: list[str] = []
    aggs: list[subprocess.Popen] = []
    try:
        # Co-located ranks serve their own shards: aggregator processes only for the others.
        dedicated = any(s.startswith("omnireduce") and not is_colocated(s) for s in spec.systems)
        aggs, addresses = start_aggregators(placement if dedicated else None, run_dir, f"w{w}", spec.op_timeout,
                                            deadline, procs, logs)
        # Several shards: the workers get them as one comma-separated address (worker.sharded).
        spec.address = ",".join(addresses)
        spec.colocated_listen = placement.rank_listen or ["tcp://127.0.0.1:0"] * w
        spec.store = os.path.join(run_dir, f"store-w{w}-{os.getpid()}-{time.monotonic_ns()}")
        spec_path = os.path.join(run_dir, f"spec-w{w}.json")
        with open(spec_path, "w") as f:
            f.write(spec.to_json())
        for r in range(w):
            log = os.path.join(run_dir, f"rank{r}-w{w}.log")
            logs.append(log)
            env = child_env(placement.rank_env[r] if placement.rank_env else None)
            # Every rank runs on this machine: they share its cores (the mask pass's threads).
            env.setdefault("LOCAL_WORLD_SIZE", str(w))
            procs.append(launch_rank(
                [*placement.rank_prefixes[r], sys.executable, "-m", "bench.procs", "rank", str(r), spec_path],
                env, log, r))
        collect(procs, logs, deadline, on_event, len(aggs))
        release_aggregators(aggs)
    finally:
        stop_all(procs)


def launch_rank(cmd: list[str], env: dict[str, str], log: str, rank: int) -> subprocess.Popen:
    """Starts a rank process; rank 0's stdout is a pipe (its events), everyone's stderr goes to ``log``."""
    with open(log, "w") as errf:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                                stderr=errf, text=True, env=env, cwd=ROOT)


def start_aggregators(
    placement: Placement | None, run_dir: str, tag: str, op_timeout: float, deadline: float,
    procs: list[subprocess.Popen], logs: list[str],
) -> tuple[list[subprocess.Popen], list[str]]:
    """Starts one aggregator process per shard of ``placement`` (none for None).

    Args:
        placement: where the aggregators run; None starts none.
        run_dir: folder of their logs.
        tag: part of the log names (e.g. the world size).
        op_timeout: seconds an operation may take at the aggregators.
        deadline: ``time.monotonic()`` by which each must have said its address.
        procs: the processes started are appended (the caller stops them all).
        logs: their log files are appended, in the order of ``procs``.

    Returns:
        The aggregator processes (close their stdin to stop them) and their addresses.

    Raises:
        BenchError: one exited or did not say its address in time.
    """
    aggs: list[subprocess.Popen] = []
    addresses: list[str] = []
    for k, (listen, prefix) in enumerate(placement.aggregators if placement is not None else []):
        agg_log = os.path.join(run_dir, f"aggregator{k}-{tag}.log")
        logs.append(agg_log)
        with open(agg_log, "w") as errf:
            agg = subprocess.Popen(
                [*prefix, sys.executable, "-m", "bench.procs", "aggregator", listen, str(op_timeout)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errf, text=True, env=child_env(), cwd=ROOT,
            )
        procs.append(agg)
        aggs.append(agg)
        assert agg.stdout is not None
        line = _readline(agg.stdout, min(deadline, time.monotonic() + 60), f"aggregator {k}'s address")
        if not line:
            raise BenchError(f"aggregator {k} exited with {agg.wait()}:\n{log_tail(agg_log)}")
        addresses.append(json.loads(line)["address"])
    return aggs, addresses


def release_aggregators(aggs: list[subprocess.Popen]) -> None:
    """Asks the aggregators to exit (their stdin closes) and waits a grace period for each."""
    for agg in aggs:
        assert agg.stdin is not None
        agg.stdin.close()
    for k, agg in enumerate(aggs):
        try:
            agg.wait(timeout=_GRACE_S)
        except subprocess.TimeoutExpired:
            logger.warning("aggregator %d did not exit when asked; it is stopped", k)


def collect(
    procs: list[subprocess.Popen], logs: list[str], deadline: float, on_event: Callable[[dict[str, Any]], None],
    n_aggs: int = 1, types: tuple[str, ...] = ("result",),
) -> None:
    """Passes rank 0's events of ``types`` to ``on_event`` until it exits; waits for every rank.

    Args:
        procs: the aggregators (the first ``n_aggs``), then the ranks in order; rank 0's
            stdout is a pipe of JSON lines.
        logs: every process's log file, in the order of ``procs``.
        deadline: ``time.monotonic()`` past which the run fails.
        on_event: called with each event.
        n_aggs: aggregator processes at the front of ``procs``.
        types: the events' ``type`` values to pass on.

    Raises:
        BenchError: a process failed or the deadline passed; the logs' tails are in the message.
    """
    ranks = procs[n_aggs:]
    out = ranks[0].stdout
    assert out is not None
    sel = selectors.DefaultSelector()
    sel.register(out, selectors.EVENT_READ)
    try:
        while True:
            failed = [(i, p) for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                i, p = failed[0]
                name = f"aggregator {i}" if i < n_aggs else f"rank {i - n_aggs}"
                raise BenchError(f"{name} exited with {p.returncode}:\n{log_tail(logs[i])}")
            if time.monotonic() > deadline:
                raise BenchError("the run went past its time limit; partial results were kept")
            if not sel.select(0.5):
                continue
            line = out.readline()
            if not line:
                break
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                logger.warning("rank 0 printed: %s", line.rstrip())
                continue
            if event.get("type") in types:
                on_event(event)
    finally:
        sel.close()
    for i, p in enumerate(ranks, start=n_aggs):
        left = deadline - time.monotonic()
        try:
            rc = p.wait(timeout=max(1.0, left))
        except subprocess.TimeoutExpired:
            raise BenchError(f"rank {i - n_aggs} did not exit before the time limit") from None
        if rc != 0:
            raise BenchError(f"rank {i - n_aggs} exited with {rc}:\n{log_tail(logs[i])}")


def add_args(p: Any) -> None:
    """The options both benchmarks take (an ``argparse.ArgumentParser``)."""
    from bench.common import DENSITIES, SYSTEMS

    p.add_argument("--sizes", nargs="+", default=["100MB"],
                   help="tensor sizes: elements, or bytes of float32 with KB/MB/GB (default 100MB = 26,214,400)")
    p.add_argument("--densities", nargs="+", type=float, default=list(DENSITIES),
                   help="fractions of nonzero 256-element blocks")
    p.add_argument("--workers", nargs="+", type=int, default=[2], help="world sizes to run (e.g. 2 4 8)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS[:3]))
    p.add_argument("--block-size", type=int, default=256, help="omnireduce's elements per block")
    p.add_argument("--pattern-block", type=int, default=256,
                   help="elements per block of the random nonzero patterns (and of gloo sparse's rows)")
    p.add_argument("--message-blocks", type=int, default=None, help="omnireduce's blocks per message")
    p.add_argument("--streams", type=int, default=None, help="omnireduce's streams per op")
    p.add_argument("--shards", type=int, default=1,
                   help="aggregator processes; every tensor is split over them (worker.sharded)")
    p.add_argument("--repeats", type=int, default=10, help="timed repetitions per case (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions per case before timing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skew", type=float, default=0.0,
                   help="0: every rank's nonzero blocks placed uniformly at random (OmniReduce's benchmark); "
                        "above 0: drawn with this Zipf exponent from a popularity order all ranks share, as an "
                        "embedding's rows (hot rows on every rank, the union below the sum)")
    p.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--op-timeout", type=float, default=300.0, help="seconds any one operation may take")
    p.add_argument("--time-limit", type=float, default=3600.0,
                   help="seconds for the whole run; past it everything is stopped and partial results kept")
    p.add_argument("--interleave", action="store_true",
                   help="time the systems round-robin per repetition (fairer on a noisy machine)")
    p.add_argument("--sparse-io", action="store_true",
                   help="time gloo sparse and the omnireduce-rows systems from the dense tensor to the dense sum "
                        "(the conversion to COO included; gloo's COO sum converted back, omnireduce's asked "
                        "dense: allreduce(coo, dense=True)); by default only the allreduce of a prebuilt COO "
                        "tensor is timed")
    p.add_argument("--new-output", action="store_true",
                   help="time omnireduce's allreduce into a new array; by default it sums in place into the "
                        "buffer gloo's all_reduce uses (refilled, untimed, before every call of either)")
    p.add_argument("--no-check", action="store_true", help="skip comparing results with gloo's dense sum")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _module_name() -> str:
    """``bench.allreduce`` for ``python -m bench.allreduce`` (sys.argv[0] is then the file's path)."""
    rel = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
    return os.path.splitext(rel)[0].replace(os.sep, ".")


def _machine() -> dict[str, Any]:
    import platform

    import numpy
    import zmq

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    commit = ""
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "cpu": model, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
        "numpy": numpy.__version__, "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(), "commit": commit,
        "load_before": os.getloadavg(),
    }


def run(
    args: Any, placement_for: Callable[[int], Placement], out_dir: str, title: str, extra_meta: dict[str, Any]
) -> list[dict[str, Any]]:
    """Runs every world size of ``args`` and writes the outputs; returns the result rows.

    Args:
        args: parsed options of :func:`add_args`.
        placement_for: the placement of a world of the given size.
        out_dir: where the outputs and logs go.
        title: the plot's title.
        extra_meta: stored with the parameters in the JSON.
    """
    from tqdm import tqdm

    from bench.common import format_table, parse_size, row_from_event, write_outputs

    sizes = [parse_size(s) for s in args.sizes]
    for name in ("repeats", "block_size", "pattern_block"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.shards < 1:
        raise SystemExit("--shards must be >= 1")
    if not 0 <= args.skew < 10:
        raise SystemExit("--skew must be within [0, 10)")
    if args.warmup < 0 or any(w < 1 for w in args.workers) or any(not 0 <= d <= 1 for d in args.densities):
        raise SystemExit("--warmup must be >= 0, --workers >= 1 and --densities within [0, 1]")
    rows: list[dict[str, Any]] = []
    meta: dict[str, Any] = {
        "title": title, "command": " ".join(["python", "-m", _module_name(), *sys.argv[1:]]),
        "args": vars(args), "machine": _machine(), **extra_meta,
    }
    deadline = time.monotonic() + args.time_limit
    total = len(args.workers) * len(sizes) * len(args.densities) * len(args.systems)
    bar = tqdm(total=total, disable=args.no_progress, unit="case", dynamic_ncols=True)

    def on_event(event: dict[str, Any]) -> None:
        row = row_from_event(event)
        rows.append(row)
        bar.set_postfix_str(f"w={row['workers']} d={row['density']} {row['system']} {row['median_s'] * 1e3:.1f} ms")
        bar.update(1)
        write_outputs(rows, out_dir, meta, plot=False)

    error: BaseException | None = None
    try:
        for w in args.workers:
            spec = RankSpec(
                world_size=w, sizes=sizes, densities=list(args.densities), systems=list(args.systems),
                repeats=args.repeats, warmup=args.warmup, block_size=args.block_size,
                message_blocks=args.message_blocks, streams=args.streams, seed=args.seed,
                op_timeout=args.op_timeout, torch_threads=args.torch_threads, check=not args.no_check,
                sparse_io=args.sparse_io, pattern_block=args.pattern_block, interleave=args.interleave,
                new_output=args.new_output, skew=args.skew,
            )
            run_world(spec, placement_for(w), os.path.join(out_dir, "logs"), deadline, on_event)
    except (BenchError, KeyboardInterrupt) as e:
        error = e
    finally:
        bar.close()
        meta["machine"]["load_after"] = os.getloadavg()
        if error is not None:
            meta["error"] = f"{type(error).__name__}: {error}"
        paths = write_outputs(rows, out_dir, meta, plot=not args.no_plot)
    print(format_table(rows))
    print("wrote " + ", ".join(paths))
    if error is not None:
        if isinstance(error, KeyboardInterrupt):
            raise error
        raise SystemExit(f"benchmark failed: {error}")
    return rows
