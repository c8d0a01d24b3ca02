"""Replicas of unequal speed: speed-proportional batches and samples-weighted gradients.

    python examples/hetero_train.py --workers 3 --slow 2 --epochs 4

Starts an aggregator and one process per replica. Replica 0 is ``--slow`` times
slower than the others: each step it "computes" ``--ms-per-sample`` x its batch x
its slowdown (a sleep, on top of the real forward and backward). Each replica holds
its own shard of the data (the data set sorted by class and cut in contiguous
pieces, as data often arrives), so what a replica sees is not what the others see.

Three runs of the same model, data and steps:

- ``equal``: every replica takes global_batch / workers samples per step; the fast
  ones wait for the slow one at every allreduce.
- ``balanced``: each step's global batch is split in proportion to the replicas'
  speeds, which the aggregator measures and recommends (``worker.balance``), and
  each replica's gradient is weighted by its share of the samples
  (``allreduce(g, weight=n)``): the update is exactly the gradient of the mean
  loss over the global batch.
- ``unweighted``: the same balanced batches, but the gradients averaged plainly,
  so the slow replica's few samples count as much as a fast one's many: the bias
  the weighting removes.

For each run it prints the time per epoch, the final loss and accuracy over the
whole data set, and how far the parameters are from a single-process reference
trained on the same global batches (zero up to float rounding when weighted).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn as nn

CLASSES = 4
FEATURES = 16


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian classes, sorted by class: contiguous shards differ in their labels."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(CLASSES, FEATURES, generator=g) * 1.5
    y = torch.arange(n) * CLASSES // n
    x = centers[y] + torch.randn(n, FEATURES, generator=g) * 2.0
    return x, y


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))


def shard_bounds(n: int, world: int) -> list[tuple[int, int]]:
    return [(r * n // world, (r + 1) * n // world) for r in range(world)]


def step_indices(rank: int, step: int, size: int, bounds: tuple[int, int], seed: int) -> torch.Tensor:
    """The samples a replica takes at a step: drawn from its own shard, reproducibly."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    lo, hi = bounds
    return torch.randint(lo, hi, (size,), generator=g)


def replica(rank: int, args: argparse.Namespace, address: str, mode: str, out: Any) -> None:
    """One replica's training loop; puts its per-epoch times and per-step batch sizes."""
    from worker import connect
    from worker.balance import Balancer, batch_sizes

    torch.set_num_threads(1)
    x, y = make_data(args.samples, args.seed)
    bounds = shard_bounds(args.samples, args.workers)[rank]
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    params = list(model.parameters())
    slowdown = args.slow if rank == 0 else 1.0
    steps_per_epoch = args.samples // args.global_batch
    epoch_times: list[float] = []
    sizes_log: list[list[int]] = []
    with connect(address, rank=rank, world_size=args.workers, job=f"hetero-{mode}", timeout=60) as w:
        balancer = Balancer(w, args.global_batch)
        equal = batch_sizes([1.0] * args.workers, args.global_batch)
        step = 0
        for _ in range(args.epochs):
            t0 = time.perf_counter()
            for _ in range(steps_per_epoch):
                sizes = equal if mode == "equal" else balancer.batch_sizes()
                sizes_log.append(sizes)
                n = sizes[rank]
                idx = step_indices(rank, step, n, bounds, args.seed)
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
                loss.backward()
                # The emulated slower hardware: compute time proportional to the batch.
                time.sleep(args.ms_per_sample * 1e-3 * n * slowdown)
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                if mode == "unweighted":
                    # A one-element weighted op reports the batch and compute time for
                    # balancing; the gradients themselves are averaged plainly.
                    w.allreduce(np.zeros(1, np.float32), weight=n)
                    flat = w.allreduce(flat) / args.workers
                else:
                    # Equal batches weigh equally; the weight also reports the batch for balancing.
                    flat = w.allreduce(flat, weight=n)
                torch.nn.utils.vector_to_parameters(flat, [p.grad for p in params])
                opt.step()
                step += 1
            epoch_times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put({"mode": mode, "epoch_times": epoch_times, "sizes": sizes_log,
                 "params": [p.detach().numpy().copy() for p in params]})


def reference(args: argparse.Namespace, sizes_log: list[list[int]]) -> list[np.ndarray]:
    """One process, the same global batches: the mean loss over all replicas' samples."""
    x, y = make_data(args.samples, args.seed)
    bounds = shard_bounds(args.samples, args.workers)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for step, sizes in enumerate(sizes_log):
        idx = torch.cat([step_indices(r, step, n, bounds[r], args.seed) for r, n in enumerate(sizes)])
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def evaluate(args: argparse.Namespace, params: list[np.ndarray]) -> tuple[float, float]:
    x, y = make_data(args.samples, args.seed)
    model = make_model()
    with torch.no_grad():
        for p, v in zip(model.parameters(), params, strict=True):
            p.copy_(torch.from_numpy(v))
        logits = model(x)
        return float(nn.functional.cross_entropy(logits, y)), float((logits.argmax(1) == y).float().mean())


def run_mode(args: argparse.Namespace, address: str, mode: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=replica, args=(r, args, address, mode, out), daemon=True) for r in range(args.workers)]
    for p in procs:
        p.start()
    try:
        res = out.get(timeout=args.timeout)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"{mode}: a replica failed (exit codes {[p.exitcode for p in procs]})")
    ref = reference(args, res["sizes"])
    res["ref_gap"] = max(float(np.abs(a - b).max()) for a, b in zip(res["params"], ref, strict=True))
    res["loss"], res["accuracy"] = evaluate(args, res["params"])
    res["ref_loss"], res["ref_accuracy"] = evaluate(args, ref)
    return res


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--slow", type=float, default=2.0, help="slowdown of replica 0")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--samples", type=int, default=6144)
    p.add_argument("--global-batch", type=int, default=96)
    p.add_argument("--ms-per-sample", type=float, default=0.5, help="emulated compute per sample at full speed")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--modes", nargs="+", default=["equal", "balanced", "unweighted"],
                   choices=["equal", "balanced", "unweighted"])
    p.add_argument("--timeout", type=float, default=600, help="seconds a run may take")
    p.add_argument("--json", action="store_true", help="print one JSON line per run instead of a table")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.workers < 2 or args.global_batch < args.workers:
        raise SystemExit("needs at least 2 workers and a global batch of at least one sample each")
    from aggregator import Aggregator

    agg = Aggregator(listen="tcp://127.0.0.1:0", timeout=120).start()
    rows = []
    try:
        for mode in args.modes:
            res = run_mode(args, agg.address, mode)
            times = res["epoch_times"]
            row = {
                "mode": mode, "first_epoch_s": round(times[0], 3),
                "later_epochs_s": round(float(np.mean(times[1:])) if len(times) > 1 else times[0], 3),
                "last_sizes": res["sizes"][-1], "loss": round(res["loss"], 4), "accuracy": round(res["accuracy"], 4),
                "reference_loss": round(res["ref_loss"], 4), "max_param_gap_to_reference": res["ref_gap"],
            }
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
    finally:
        agg.close()
    if not args.json:
        print(f"{args.workers} replicas, replica 0 {args.slow}x slower, global batch {args.global_batch}, "
              f"{args.samples // args.global_batch} steps per epoch")
        print(f"{'mode':<11} {'epoch 1 s':>9} {'later s':>8} {'last batches':<16} {'loss':>7} {'acc':>6} "
              f"{'ref loss':>8} {'gap to ref':>10}")
        for r in rows:
            print(f"{r['mode']:<11} {r['first_epoch_s']:>9.3f} {r['later_epochs_s']:>8.3f} {str(r['last_sizes']):<16} "
                  f"{r['loss']:>7.4f} {r['accuracy']:>6.3f} {r['reference_loss']:>8.4f} "
                  f"{r['max_param_gap_to_reference']:>10.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
