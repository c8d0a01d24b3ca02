"""Trains real sparse models across ranks with every system, side by side: step time, bytes, loss.

Each world runs one process per rank, launched as torchrun launches them (``RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), plus an
aggregator process. With ``--rate loopback`` they all run on this host's loopback; with
a tc rate (``1gbit``, ``10gbit``) every rank and the aggregator get their own network
namespace and shaped link, as :mod:`bench.cluster` places them (needs root, addresses in
198.18.0.0/15). Within a world every system trains its own replica of the model on the
same batches, taking turns each step (see :mod:`bench.train_rank`), so the comparison is
interleaved and the replicas' parameters stay equal up to float rounding.

Outputs in ``--out``: ``steps.csv`` (every system's every step), ``results.json`` (the
summary and every step), and ``loss-<model>-<rate>-w<workers>.png`` (loss against wall
time, every system on one figure).

Example::

    python -m bench.train --models ctr lm --workers 2 4 --rate 1gbit --steps 60 --out bench/out-train-1g
    python -m bench.train --rate loopback --models ctr --scale 0.01 --steps 5   # a quick check
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.common import free_port
from bench.driver import (
    BenchError,
    Placement,
    child_env,
    collect,
    launch_rank,
    release_aggregators,
    start_aggregators,
    stop_all,
)
from bench.train_models import MODELS
from bench.train_rank import COLOCATED_SYSTEMS, PHASES, REFERENCE, SYSTEMS

logger = logging.getLogger(__name__)

__all__ = ["main", "parse_args", "run_world", "summarise", "smoothed", "LOOPBACK"]

LOOPBACK = "loopback"
_MASTER_PORT = 29400
#: A step's per-phase figures: (step event key, summary key, CSV column prefix). "phases": the
#: slowest rank's seconds; "cpu": the ranks' mean CPU seconds (every thread of the process).
_PHASED = (("phases", "phases_ms", ""), ("cpu", "cpu_ms", "cpu_"))
_AGG_PORT = 5555


def run_world(
    cfg: dict[str, Any], placement: Placement, master: tuple[str, int], run_dir: str, deadline: float,
    on_event: Callable[[dict[str, Any]], None],
) -> None:
    """Runs one world of :mod:`bench.train_rank` processes and its aggregator.

    Args:
        cfg: the ranks' settings (see :func:`bench.train_rank.run`); ``address``,
            ``colocated_listen`` and ``job`` are filled in here.
        placement: where the aggregator and every rank run; its length of
            ``rank_prefixes`` is the world size.
        master: the address and port of rank 0's rendezvous store (``MASTER_ADDR``/``PORT``).
        run_dir: folder for the settings file and every process's log.
        deadline: ``time.monotonic()`` past which everything is stopped and BenchError raised.
        on_event: called with each of rank 0's ``step`` and ``params`` events.

    Raises:
        BenchError: a process failed or the deadline passed.
    """
    w = len(placement.rank_prefixes)
    run_dir = os.path.abspath(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    tag = f"{cfg['model']}-w{w}"
    procs: list[subprocess.Popen] = []
    logs: list[str] = []
    try:
        dedicated = any(s.startswith("omnireduce") and s not in COLOCATED_SYSTEMS for s in cfg["systems"])
        aggs, addresses = start_aggregators(placement if dedicated else None, run_dir, tag, cfg["op_timeout"],
                                            deadline, procs, logs)
        cfg = dict(cfg, address=",".join(addresses) or None, job=f"train-{tag}-{os.getpid()}-{time.time_ns()}",
                   colocated_listen=placement.rank_listen or ["tcp://127.0.0.1:0"] * w)
        cfg_path = os.path.join(run_dir, f"config-{tag}.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        for r in range(w):
            log = os.path.join(run_dir, f"rank{r}-{tag}.log")
            logs.append(log)
            env = child_env(placement.rank_env[r] if placement.rank_env else None)
            env.update(RANK=str(r), WORLD_SIZE=str(w), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(w),
                       MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
            procs.append(launch_rank([*placement.rank_prefixes[r], sys.executable, "-m", "bench.train_rank", cfg_path],
                                     env, log, r))
        collect(procs, logs, deadline, on_event, len(aggs), types=("step", "params"))
        release_aggregators(aggs)
    finally:
        stop_all(procs)


def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (fewer at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


World = dict[str, list[dict[str, Any]]]


def _worlds(steps: list[dict[str, Any]]) -> dict[tuple[str, str, int], World]:
    """Step events by world (model, rate, workers) and system, each system's in step order."""
    worlds: dict[tuple[str, str, int], World] = {}
    for e in steps:
        worlds.setdefault((e["model"], e["rate"], e["workers"]), {}).setdefault(e["system"], []).append(e)
    for systems in worlds.values():
        for events in systems.values():
            events.sort(key=lambda e: e["step"])
    return worlds


def _window(n: int) -> int:
    """The trailing-mean window of a curve of ``n`` steps."""
    return max(1, min(10, n // 5))


def _clock(events: list[dict[str, Any]], warmup: int) -> tuple[float, list[float]]:
    """The median step time after ``warmup`` steps, and the training time at the end of each step.

    Warm-up steps (imports, JIT compiles, first connections) count at the median.
    """
    med = statistics.median(e["seconds"] for e in events[min(warmup, len(events) - 1):])
    clock, t = 0.0, []
    for i, e in enumerate(events):
        clock += e["seconds"] if i >= warmup else med
        t.append(clock)
    return med, t


def summarise(steps: list[dict[str, Any]], params: list[dict[str, Any]], warmup: int = 2,
              target_at: float = 0.8) -> list[dict[str, Any]]:
    """One row per (model, rate, workers, system): step time, throughput, bytes, loss and speedups.

    The target loss of a world is its reference system's (gloo dense, else the first)
    smoothed loss at ``target_at`` of its steps; every system's time to it is the sum of
    its step times up to the first step its smoothed loss is at or below it, the warm-up
    steps counted at the system's median step time.

    Args:
        steps: ``step`` events, each with ``model``, ``rate`` and ``workers`` added.
        params: ``params`` events, likewise.
        warmup: first steps left out of the step-time statistics.
        target_at: where on the reference's curve the target loss lies (0-1).
    """
    gaps = {(p["model"], p["rate"], p["workers"], p["system"]): p for p in params}
    rows: list[dict[str, Any]] = []
    for (model, rate, workers), systems in _worlds(steps).items():
        n = min(len(v) for v in systems.values())
        window = _window(n)
        systems = {s: v[:n] for s, v in systems.items()}
        curves = {s: smoothed([e["loss"] for e in v], window) for s, v in systems.items()}
        clocks = {s: _clock(v, warmup) for s, v in systems.items()}
        ref = REFERENCE if REFERENCE in systems else next(iter(systems))
        target = curves[ref][min(n - 1, int(target_at * (n - 1)))]
        for system, events in systems.items():
            timed = events[min(warmup, n - 1):]
            med, clock = clocks[system]
            reached = next((i for i, v in enumerate(curves[system]) if v <= target), None)
            link = [e["bytes_sent"] + e["bytes_received"] for e in timed if e.get("bytes_sent") is not None]
            gap = gaps.get((model, rate, workers, system), {})
            row: dict[str, Any] = {
                "model": model, "rate": rate, "workers": workers, "system": system, "steps": n,
                "step_s_median": med, "step_s_mean": statistics.fmean(e["seconds"] for e in timed),
                "samples_per_s": events[-1]["samples"] / med if med > 0 else None,
                "link_bytes_per_step": statistics.median(link) if link else None,
                "final_loss": curves[system][-1], "final_metric": statistics.fmean(
                    e["metric"] for e in events[-window:]),
                "target_loss": target, "steps_to_target": None if reached is None else reached + 1,
                "seconds_to_target": None if reached is None else clock[reached],
                "max_abs_param_diff": gap.get("max_abs_diff"), "max_abs_param": gap.get("max_abs_param"),
            }
            for rival in ("gloo-dense", "gloo-sparse"):
                if rival in clocks and med > 0:
                    row[f"x_{rival}"] = clocks[rival][0] / med
            for key, summary_key, _ in _PHASED:
                phased = [e[key] for e in timed if e.get(key)]
                if phased:
                    # Medians of each phase on its own (they need not add up to the step's median).
                    row[summary_key] = {k: 1e3 * statistics.median(p[k] for p in phased) for k in phased[0]}
            if events[-1].get("paths"):
                row["paths"] = events[-1]["paths"]
            rows.append(row)
    return rows


def _plot(steps: list[dict[str, Any]], out: str, warmup: int) -> list[str]:
    """Loss (smoothed) against training time, one figure per world; warm-up steps at the median, as in the summary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for (model, rate, workers), systems in _worlds(steps).items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for system, events in systems.items():
            _, t = _clock(events, warmup)
            ax.plot(t, smoothed([e["loss"] for e in events], _window(len(events))), label=system,
                    linestyle="--" if system.startswith("gloo") else "-")
        ax.set_xlabel("training time (s, sum of step times; warm-up steps at the median)")
        ax.set_ylabel("loss (trailing mean)")
        ax.set_title(f"{model}: {workers} workers, {rate}")
        ax.grid(alpha=0.3)
        ax.legend()
        path = os.path.join(out, f"loss-{model}-{rate}-w{workers}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _write(out: str, args: argparse.Namespace, steps: list[dict[str, Any]], params: list[dict[str, Any]],
           extra: dict[str, Any]) -> list[dict[str, Any]]:
    rows = summarise(steps, params, warmup=args.warmup)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"args": vars(args), **extra, "summary": rows, "params": params, "steps": steps}, f, indent=1)
    fields = ["model", "rate", "workers", "system", "step", "seconds", "loss", "metric", "samples", "bytes_sent",
              "bytes_received", "protocol_bytes_sent", "dense_bytes", "slowest_rank",
              *(f"{prefix}{phase}_s" for _, _, prefix in _PHASED for phase in PHASES)]
    with open(os.path.join(out, "steps.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        # Each phase's figures as columns of their own.
        writer.writerows(
            {**e, **{f"{prefix}{k}_s": v for key, _, prefix in _PHASED for k, v in (e.get(key) or {}).items()}}
            for e in steps
        )
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'model':6} {'rate':8} {'w':>2} {'system':22} {'step ms':>9} {'x dense':>8} {'x sparse':>9} "
            f"{'MB/step':>8} {'loss':>7} {'to target s':>11} {'param diff':>10} {'fwd/bwd/tail/opt ms':>21} "
            f"{'CPU ms':>17}")
    lines = [head, "-" * len(head)]
    for r in rows:
        mb = "" if r["link_bytes_per_step"] is None else f"{r['link_bytes_per_step'] / 1e6:.1f}"
        tt = "" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.2f}"
        gap = "" if r["max_abs_param_diff"] is None else f"{r['max_abs_param_diff']:.1e}"
        phases, cpu = ("/".join(f"{v:.0f}" for v in (r.get(key) or {}).values()) for _, key, _ in _PHASED)
        lines.append(
            f"{r['model']:6} {r['rate']:8} {r['workers']:>2} {r['system']:22} {1e3 * r['step_s_median']:9.1f} "
            f"{r.get('x_gloo-dense', float('nan')):8.2f} {r.get('x_gloo-sparse', float('nan')):9.2f} {mb:>8} "
            f"{r['final_loss']:7.4f} {tt:>11} {gap:>10} {phases:>21} {cpu:>17}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["ctr"])
    p.add_argument("--workers", nargs="+", type=int, default=[2], help="world sizes to run")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--rate", default=LOOPBACK, help="'loopback', or the tc rate of every link (1gbit, 10gbit)")
    p.add_argument("--delay-us", type=int, default=0, help="one-way delay per link direction (emulated network)")
    p.add_argument("--subnet", default="198.18.0.0/24", help="node addresses; must lie in 198.18.0.0/15")
    p.add_argument("--steps", type=int, default=40, help="training steps of every system")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the step-time statistics")
    p.add_argument("--batch", type=int, default=None, help="samples per rank and step (default: the model's)")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies the embedding tables' rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--optimizer", choices=["model", "sgd"], default="model",
                   help="the model's own optimiser (Adagrad), or plain SGD (replicas equal to the rounding of sums)")
    p.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--bucket-view", action="store_true",
                   help="DDP(gradient_as_bucket_view=True) for every system: gradients are DDP's buckets, "
                        "not copied in and out of them")
    p.add_argument("--op-timeout", type=float, default=300.0, help="seconds any one operation may take")
    p.add_argument("--time-limit", type=float, default=3600.0, help="seconds for the whole run")
    p.add_argument("--retries", type=int, default=1,
                   help="times a failed world is run again (a rank of torch's gloo sparse allreduce can abort "
                   "with heap corruption: bench/RESULTS.md); a failure is recorded either way")
    p.add_argument("--out", default="bench/out-train", help="output folder")
    args = p.parse_args(argv)
    if min(args.workers) < 1 or args.steps < 1:
        p.error("--workers and --steps must be positive")
    if args.retries < 0:
        p.error("--retries must be non-negative")
    if args.rate != LOOPBACK and args.delay_us < 0:
        p.error("--delay-us must be non-negative")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    deadline = time.monotonic() + args.time_limit
    steps: list[dict[str, Any]] = []
    params: list[dict[str, Any]] = []
    extra: dict[str, Any] = {"load_average_start": os.getloadavg()}
    base = {"scale": args.scale, "seed": args.seed, "steps": args.steps, "batch": args.batch,
            "systems": args.systems, "op_timeout": args.op_timeout, "optimizer": args.optimizer,
            "torch_threads": args.torch_threads, "bucket_view": args.bucket_view}

    def world(model: str, w: int, placement: Placement, master: tuple[str, int], iface: str | None) -> None:
        for attempt in range(args.retries + 1):
            # A world's events count only from the attempt that is kept: the last one.
            events: list[dict[str, Any]] = []

            def on_event(e: dict[str, Any], events: list[dict[str, Any]] = events) -> None:
                e.update(model=model, rate=args.rate, workers=w)
                events.append(e)
                if e["type"] == "step" and e["system"] == args.systems[-1] and (e["step"] + 1) % 10 == 0:
                    print(f"  {model} w={w} step {e['step'] + 1}/{args.steps}", flush=True)

            print(f"{model}: {w} workers on {args.rate}" + (f" (attempt {attempt + 1})" if attempt else ""),
                  flush=True)
            try:
                run_world(dict(base, model=model, iface=iface), placement, master, os.path.join(args.out, "logs"),
                          deadline, on_event)
            except BenchError as e:
                # The other worlds still run; the failure is reported and kept with the results.
                last = attempt == args.retries or time.monotonic() > deadline
                print(f"bench.train: {model} with {w} workers failed{'' if last else ', running it again'}: {e}",
                      file=sys.stderr, flush=True)
                failures.append({"model": model, "workers": w, "attempt": attempt + 1, "error": str(e)[:4000],
                                 "retried": not last})
                if time.monotonic() > deadline:
                    raise
                if not last:
                    continue
            for e in events:
                (steps if e["type"] == "step" else params).append(e)
            return

    failures: list[dict[str, Any]] = []
    extra["failures"] = failures
    try:
        if args.rate == LOOPBACK:
            for model in args.models:
                for w in args.workers:
                    placement = Placement(aggregators=[("tcp://127.0.0.1:0", [])], rank_prefixes=[[]] * w)
                    world(model, w, placement, ("127.0.0.1", free_port()), None)
        else:
            _emulated(args, world, extra)
    except BenchError as e:
        print(f"bench.train: {e}", file=sys.stderr)
        if steps:
            _write(args.out, args, steps, params, extra)
        return 1
    extra["load_average_end"] = os.getloadavg()
    rows = _write(args.out, args, steps, params, extra)
    plots = _plot(steps, args.out, args.warmup)
    print(_table(rows))
    print(f"wrote {args.out}/results.json, {args.out}/steps.csv, " + ", ".join(plots))
    # A world that succeeded on a later attempt is not a failure of the run (its failures are kept).
    return 1 if any(not f["retried"] for f in failures) else 0


def _emulated(args: argparse.Namespace, world: Callable[..., None], extra: dict[str, Any]) -> None:
    from bench import cluster

    why = cluster.preflight()
    if why:
        raise BenchError(f"an emulated network {why}")
    stale = cluster.cleanup_stale()
    if stale:
        logger.warning("removed leftovers of an earlier run: %s", " ".join(stale))
    with cluster.signals_raise():
        topo = cluster.Topology(max(args.workers), rate=args.rate, subnet=args.subnet, delay_us=args.delay_us)
        try:
            topo.up()
            link = cluster.measure_link(topo)
            print(f"link check: one TCP stream worker -> aggregator at {link / 1e9:.2f} Gbit/s (rate {args.rate})")
            extra["network"] = {"rate": args.rate, "delay_us": args.delay_us, "subnet": args.subnet,
                                "measured_stream_bps": link, "topology": "star: one namespace per node on a bridge"}
            for model in args.models:
                for w in args.workers:
                    nodes = topo.workers[:w]
                    agg_ns, agg_ip = topo.aggregators[0]
                    placement = Placement(
                        aggregators=[(f"tcp://{agg_ip}:{_AGG_PORT}", ["ip", "netns", "exec", agg_ns])],
                        rank_prefixes=[["ip", "netns", "exec", ns] for ns, _ in nodes],
                        rank_env=[{"GLOO_SOCKET_IFNAME": "eth0"} for _ in nodes],
                        rank_listen=[f"tcp://{ip}:0" for _, ip in nodes],
                    )
                    world(model, w, placement, (nodes[0][1], _MASTER_PORT), "eth0")
        finally:
            topo.down()


if __name__ == "__main__":
    raise SystemExit(main())
