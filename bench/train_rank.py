"""One rank of :mod:`bench.train`: a replica of the model per system, trained step by step, interleaved.

Launched the way torchrun launches a rank: ``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` in the environment, ``init_process_group("gloo")``
from them. The systems share the process and the gloo group, and take turns on every
step (the order rotates each step), so a slow moment of the machine falls on all of
them alike. Every replica starts from the same parameters and sees the same batches;
all of them compute the same gradients, so their parameters stay equal up to float
rounding, which rank 0 reports at the end.

Systems:

- ``gloo-dense``: DDP's default allreduce of dense gradients (``sparse=False`` embeddings).
- ``gloo-sparse``: ``sparse=True`` embeddings; DDP allreduces their COO gradients through
  gloo (an allgather of every rank's rows): torch's own sparse path.
- ``omnireduce``: dense gradients through the omnireduce DDP hook (block mask per bucket).
- ``omnireduce-sparse``: ``sparse=True`` embeddings through the hook: rows are blocks, no mask.
- ``omnireduce-colocated``: as ``omnireduce-sparse``, every rank serving one aggregator shard.
- ``omnireduce-auto``: ``sparse=True`` embeddings as rows through omnireduce, and each dense
  bucket (the MLP's, the LSTM's) through omnireduce or gloo's ring, whichever the cost model
  predicts faster: what a user of a model with both kinds of gradients would run.
- ``omnireduce-colocated-auto``: as ``omnireduce-auto``, with every rank serving one
  aggregator shard (no aggregator host).
- ``omnireduce-rows``: dense gradients (``sparse=False`` embeddings, as ``omnireduce``), the
  tables' sent as the rows each step looked up (``worker.embedding_rows``: no mask pass
  over them), the other parameters as a dense op.
- ``omnireduce-colocated-rows``: as ``omnireduce-rows``, every rank serving one aggregator shard.

Rank 0 prints one JSON object per line on stdout (``step`` and ``params`` events).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from bench import train_models

logger = logging.getLogger(__name__)

__all__ = ["SYSTEMS", "SPARSE_SYSTEMS", "COLOCATED_SYSTEMS", "PHASES", "Replica", "net_bytes", "run"]

SYSTEMS = (
    "gloo-dense", "gloo-sparse", "omnireduce", "omnireduce-sparse", "omnireduce-colocated", "omnireduce-auto",
    "omnireduce-colocated-auto", "omnireduce-rows", "omnireduce-colocated-rows",
)
#: The systems whose models have ``sparse=True`` embeddings (COO gradients).
SPARSE_SYSTEMS = frozenset({
    "gloo-sparse", "omnireduce-sparse", "omnireduce-colocated", "omnireduce-auto", "omnireduce-colocated-auto",
})
#: The systems whose ranks serve the aggregator shards themselves.
COLOCATED_SYSTEMS = frozenset({"omnireduce-colocated", "omnireduce-colocated-auto", "omnireduce-colocated-rows"})
#: The slowest rank's step in phases (a step event's ``phases``): forward, backward until the last
#: gradient is computed, backward's wait for communication after it, optimizer step.
PHASES = ("forward", "backward", "tail", "optimizer")
#: The system the others' parameters are compared with.
REFERENCE = "gloo-dense"


def net_bytes(iface: str | None) -> tuple[int, int] | None:
    """(received, sent) bytes of ``iface`` in this process's network namespace, or None.

    ``/proc/net/dev`` shows the namespace of the reading process, so in a rank's own
    namespace it counts that rank's traffic alone.
    """
    if not iface:
        return None
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == iface:
                    fields = rest.split()
                    return int(fields[0]), int(fields[8])
    except OSError:
        return None
    return None


@dataclass
class Replica:
    """One system's copy of the model, its optimiser and its communication."""

    system: str
    model: DDP
    optimizer: torch.optim.Optimizer
    worker: Any = None
    state: Any = None
    seconds: float = 0.0
    loss: float = 0.0
    metric: float = 0.0
    received: int | None = None
    sent: int | None = None
    #: This rank's last step in phases (seconds): forward, backward until the last
    #: gradient was computed, the communication left after it, optimizer.
    phases: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    #: CPU seconds this rank's process (every thread) spent in each phase of its last step.
    cpu: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    last_grad: float = 0.0
    last_grad_cpu: float = 0.0

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def _replica(system: str, spec: train_models.ModelSpec, cfg: dict[str, Any], rank: int, world: int) -> Replica:
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
    module = spec.build(sparse=system in SPARSE_SYSTEMS, seed=cfg["seed"])
    model = DDP(module, gradient_as_bucket_view=bool(cfg.get("bucket_view", False)))
    if cfg.get("optimizer", "model") == "sgd":
        # Plain SGD: a parameter moves by lr x its gradient, so the replicas' gaps stay at the
        # rounding of the sums (Adagrad divides by the gradient's own size: a rounding-sized
        # gradient of a row can move it by lr).
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr)
    else:
        optimizer = spec.optimizer(model.parameters())
    replica = Replica(system, model, optimizer)

    def grad_ready(_: torch.Tensor) -> None:
        replica.last_grad = time.perf_counter()
        replica.last_grad_cpu = time.process_time()

    # The time the last gradient was computed: what backward() spends after it is
    # communication that did not overlap the computation.
    for p in module.parameters():
        p.register_post_accumulate_grad_hook(grad_ready)
    if system.startswith("omnireduce"):
        from worker import connect
        from worker.colocated import torch_exchange
        from worker.ddp import OmniReduceState, omnireduce_hook

        options: dict[str, Any] = dict(rank=rank, world_size=world, job=f"{cfg['job']}-{system}",
                                       timeout=cfg["op_timeout"])
        if system in COLOCATED_SYSTEMS:
            replica.worker = connect(exchange=torch_exchange(), listen=cfg["colocated_listen"][rank], **options)
        else:
            replica.worker = connect(cfg["address"], **options)
        if system.endswith("-auto"):
            replica.state = OmniReduceState(replica.worker, dense_group=dist.group.WORLD, mode="auto")
        else:
            replica.state = OmniReduceState(replica.worker)
        model.register_comm_hook(replica.state, omnireduce_hook)
        if system.endswith("-rows"):
            from worker.embedding_rows import track_embedding_rows

            track_embedding_rows(replica.state, module)
    return replica


def _step(replica: Replica, spec: train_models.ModelSpec, batch: tuple[torch.Tensor, ...], iface: str | None) -> None:
    before = net_bytes(iface)
    c0, t0 = time.process_time(), time.perf_counter()
    replica.optimizer.zero_grad(set_to_none=True)
    loss, metric = spec.loss(replica.model, batch)
    c1, t1 = time.process_time(), time.perf_counter()
    loss.backward()
    c2, t2 = time.process_time(), time.perf_counter()
    replica.optimizer.step()
    c3, t3 = time.process_time(), time.perf_counter()
    replica.seconds = t3 - t0
    grads = min(max(replica.last_grad, t1), t2)
    replica.phases = (t1 - t0, grads - t1, t2 - grads, t3 - t2)
    # Where the step's CPU went: work done during backward slows the computation on a
    # loaded machine, work done while backward waits for the link costs nothing.
    grads_cpu = min(max(replica.last_grad_cpu, c1), c2)
    replica.cpu = (c1 - c0, grads_cpu - c1, c2 - grads_cpu, c3 - c2)
    after = net_bytes(iface)
    replica.loss = float(loss.detach())
    replica.metric = float(metric)
    if before is not None and after is not None:
        replica.received, replica.sent = after[0] - before[0], after[1] - before[1]


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _param_gap(replica: Replica, reference: Replica) -> dict[str, float]:
    """Largest absolute difference from the reference's parameters, and its relative size."""
    worst = 0.0
    scale = 0.0
    for p, q in zip(replica.model.parameters(), reference.model.parameters(), strict=True):
        worst = max(worst, float((p.detach() - q.detach()).abs().max()))
        scale = max(scale, float(q.detach().abs().max()))
    return {"max_abs_diff": worst, "max_abs_param": scale}


def run(cfg: dict[str, Any]) -> None:
    """Trains every system of ``cfg`` for ``cfg["steps"]`` steps on this rank.

    Args:
        cfg: the run's settings, written by :mod:`bench.train`: model, scale, seed,
            steps, batch, systems, job, address (the aggregator), colocated_listen
            (per rank), iface (the rank's network interface, for byte counts; None on
            loopback), op_timeout, torch_threads, optimizer ("model": the model's own,
            or "sgd"), bucket_view (DDP's ``gradient_as_bucket_view``).
    """
    torch.set_num_threads(int(cfg["torch_threads"]))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = train_models.get(cfg["model"], scale=cfg["scale"], seed=cfg["seed"])
    batch_size = int(cfg["batch"] or spec.default_batch)
    replicas = [_replica(s, spec, cfg, rank, world) for s in cfg["systems"]]
    iface = cfg.get("iface")
    try:
        for step in range(int(cfg["steps"])):
            batch = spec.batch(rank, world, step, batch_size)
            k = step % len(replicas)
            for replica in replicas[k:] + replicas[:k]:
                # Every rank starts the step together: a system's time is its own step alone.
                dist.barrier()
                _step(replica, spec, batch, iface)
            # The ranks' mean loss and metric, and the slowest rank's time: the step's real time.
            values = torch.tensor([[r.loss, r.metric] for r in replicas], dtype=torch.float64)
            dist.all_reduce(values)
            values /= world
            # Every rank's time and phases: the step's time is the slowest rank's, and so are its phases.
            timing = torch.zeros(world, len(replicas), 1 + 2 * len(PHASES), dtype=torch.float64)
            timing[rank] = torch.tensor([[r.seconds, *r.phases, *r.cpu] for r in replicas], dtype=torch.float64)
            dist.all_reduce(timing)
            cpu = timing[:, :, 1 + len(PHASES):].mean(dim=0)
            slowest = timing[:, :, 0].argmax(dim=0)
            seconds = timing[slowest, torch.arange(len(replicas)), 0]
            if rank == 0:
                for i, r in enumerate(replicas):
                    event: dict[str, Any] = {
                        "type": "step", "system": r.system, "step": step, "seconds": float(seconds[i]),
                        "loss": float(values[i, 0]), "metric": float(values[i, 1]), "samples": batch_size * world,
                        "bytes_sent": r.sent, "bytes_received": r.received,
                        "slowest_rank": int(slowest[i]),
                        "phases": dict(zip(PHASES, timing[slowest[i], i, 1 : 1 + len(PHASES)].tolist(), strict=True)),
                        # The ranks' mean CPU seconds per phase (process CPU: every thread).
                        "cpu": dict(zip(PHASES, cpu[i].tolist(), strict=True)),
                    }
                    if r.worker is not None and r.worker.stats.total is not None:
                        total = r.worker.stats.total
                        event["protocol_bytes_sent"] = total.bytes_sent
                        event["dense_bytes"] = total.dense_bytes
                    if r.state is not None:
                        event["paths"] = dict(r.state.paths)
                        if r.state.rows is not None:
                            # Buckets whose tables went out as their looked-up rows (rank 0's count).
                            event["rows_buckets"] = r.state.rows.buckets
                    _emit(event)
        reference = next((r for r in replicas if r.system == REFERENCE), replicas[0])
        if rank == 0:
            for r in replicas:
                _emit({"type": "params", "system": r.system, "reference": reference.system,
                       **_param_gap(r, reference)})
        dist.barrier()
    finally:
        for r in replicas:
            r.close()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if len(args) != 1:
        print("usage: python -m bench.train_rank CONFIG.json (with torchrun's environment)", file=sys.stderr)
        return 2
    with open(args[0]) as f:
        cfg = json.load(f)
    run(cfg)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skips interpreter teardown, where a hung ZeroMQ context would block the exit.
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
