"""Trains a click-through-rate model (embedding-heavy, DLRM style) with DDP through omnireduce.

    torchrun --nproc_per_node 2 examples/train_ctr.py --steps 200

With ``OMNIREDUCE_ADDRESS`` unset, rank 0 starts an aggregator in-process on
``MASTER_ADDR:MASTER_PORT+1`` and every rank uses it; set the variable to use a
running ``omnireduce-aggregator`` instead. ``--hook auto`` sends each bucket through omnireduce or
gloo, whichever the cost model predicts faster. ``--hook rows`` sends each embedding
table's gradient as the rows the step looked up (``worker.embedding_rows``: no mask pass
over the tables). ``--hook gloo`` runs the same training with DDP's default gloo allreduce
for comparison.

The data is generated: a hidden "true" model labels random categorical and dense
features, so the loss falls as the model learns it.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class CTRModel(nn.Module):
    """Embedding tables for categorical features, an MLP over them and the dense features."""

    def __init__(self, tables: int, vocab: int, dim: int, dense: int) -> None:
        super().__init__()
        self.embeddings = nn.ModuleList(nn.EmbeddingBag(vocab, dim, mode="sum") for _ in range(tables))
        self.mlp = nn.Sequential(nn.Linear(tables * dim + dense, 128), nn.ReLU(), nn.Linear(128, 1))

    def forward(self, cats: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        # cats: (batch, tables), one id per table and sample.
        embs = [e(cats[:, i : i + 1]) for i, e in enumerate(self.embeddings)]
        return self.mlp(torch.cat([*embs, dense], dim=1)).squeeze(-1)


def make_data(args: argparse.Namespace, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank * 1_000_003 + step)
    # Zipf-like ids: a few popular items, a long tail, as in click logs.
    u = torch.rand(args.batch, args.tables, generator=g)
    cats = (args.vocab * u**3).long().clamp_max(args.vocab - 1)
    dense = torch.randn(args.batch, args.dense, generator=g)
    truth = torch.Generator().manual_seed(12345)
    w_cat = torch.randn(args.vocab, generator=truth)
    w_dense = torch.randn(args.dense, generator=truth)
    logits = w_cat[cats].sum(1) / args.tables**0.5 + dense @ w_dense / args.dense**0.5
    labels = (torch.rand(args.batch, generator=g) < torch.sigmoid(logits)).float()
    return cats, dense, labels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--vocab", type=int, default=50_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--dense", type=int, default=13)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--hook", choices=["omnireduce", "rows", "auto", "gloo"], default="omnireduce",
                   help="auto: each bucket through omnireduce or gloo, whichever the cost model predicts faster; "
                        "rows: the tables' gradients sent as the rows each step looked up")
    p.add_argument("--log-every", type=int, default=20)
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    aggregator = None
    if "OMNIREDUCE_ADDRESS" not in os.environ:
        address = f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{int(os.environ.get('MASTER_PORT', 29500)) + 1}"
        if rank == 0 and args.hook != "gloo":
            from aggregator import Aggregator

            aggregator = Aggregator(listen=address, timeout=60).start()
        os.environ["OMNIREDUCE_ADDRESS"] = address

    torch.manual_seed(0)
    model = DDP(CTRModel(args.tables, args.vocab, args.dim, args.dense))
    worker = None
    state = None
    if args.hook != "gloo":
        from worker import connect
        from worker.ddp import OmniReduceState, omnireduce_hook

        worker = connect(job="ctr-example")
        if args.hook == "auto":
            state = OmniReduceState(worker, dense_group=dist.group.WORLD, mode="auto")
        else:
            state = OmniReduceState(worker)
        model.register_comm_hook(state, omnireduce_hook)
        if args.hook == "rows":
            from worker.embedding_rows import track_embedding_rows

            track_embedding_rows(state, model)
    opt = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    loss_fn = nn.BCEWithLogitsLoss()
    times: list[float] = []
    window = 0.0
    for step in range(args.steps):
        cats, dense, labels = make_data(args, rank, step)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(model(cats, dense), labels)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        window += loss.item()
        if (step + 1) % args.log_every == 0 and rank == 0:
            median_ms = 1e3 * sorted(times)[len(times) // 2]
            msg = f"step {step + 1:5d}  loss {window / args.log_every:.4f}  step {median_ms:.1f} ms"
            if worker is not None:
                total = worker.stats.total
                msg += (f"  sent {total.bytes_sent / 1e6:.1f} MB of {total.dense_bytes / 1e6:.1f} MB dense"
                        f" ({total.sent_fraction:.1%})")
            if state is not None and state.mode == "auto":
                msg += f"  buckets sparse/dense {state.paths['sparse']}/{state.paths['dense']}"
            if state is not None and state.rows is not None:
                msg += f"  buckets as rows {state.rows.buckets}"
            print(msg, flush=True)
            window, times = 0.0, []
    if worker is not None:
        worker.close()
    dist.barrier()
    dist.destroy_process_group()
    if aggregator is not None:
        aggregator.close()


if __name__ == "__main__":
    main()
