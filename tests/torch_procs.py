"""Training runs executed in spawned rank processes by tests/test_torch.py.

Each run trains the same seeded model twice in one process, once with the
reference (DDP on gloo, or a hand-written gloo all_reduce) and once through
omnireduce, and returns both sets of parameters for the test to compare.
"""

from __future__ import annotations

import io
import os
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

VOCAB = 4000
DIM = 16


class ClickModel(nn.Module):
    """Embedding-heavy: most of the gradient (the embedding table) is zero rows."""

    def __init__(self, unused: bool = False, vocab: int = VOCAB) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, DIM, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, 1))
        self.unused = nn.Linear(7, 7) if unused else None

    def forward(self, idx: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(idx, offsets)).squeeze(-1)


def batch(
    rank: int, step: int, n: int = 16, per: int = 4, vocab: int = VOCAB
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    idx = torch.randint(0, vocab, (n * per,), generator=g)
    offsets = torch.arange(0, n * per, per)
    y = torch.randint(0, 2, (n,), generator=g).float()
    return idx, offsets, y


class MisusedClickModel(ClickModel):
    """Its table's weight is also read outside its lookups: gradients outside the looked-up rows."""

    def forward(self, idx: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return super().forward(idx, offsets) + self.emb.weight[:5].sum() * 0.01


class RareTableClickModel(ClickModel):
    """A second table that only some batches use (on a step, some ranks have no gradient for
    it); both tables ``sparse=True`` (sparse COO gradients) or both dense."""

    def __init__(self, unused: bool = False, vocab: int = VOCAB, sparse: bool = True) -> None:
        super().__init__(unused, vocab)
        self.emb.sparse = sparse
        # As wide as the other: sparse, the two go as one op.
        self.rare = nn.Embedding(50, DIM, sparse=sparse)

    def forward(self, idx: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        out = super().forward(idx, offsets)
        if int(idx[0]) % 2 == 0:
            out = out + self.rare(idx[:3] % 50).sum()
        return out


def _model(unused: bool = False, vocab: int = VOCAB, misused: bool = False, rare: bool = False,
           sparse: bool = True) -> ClickModel:
    torch.manual_seed(0)
    if rare:
        return RareTableClickModel(unused, vocab, sparse)
    return (MisusedClickModel if misused else ClickModel)(unused, vocab)


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    vocab = (model.module if isinstance(model, DDP) else model).emb.num_embeddings
    idx, off, y = batch(rank, step, vocab=vocab)
    return nn.functional.binary_cross_entropy_with_logits(model(idx, off), y)


def _train_ddp(ddp: nn.Module, rank: int, steps: int, accumulate: bool, synced: bool = False) -> list[torch.Tensor]:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    for step in range(steps):
        opt.zero_grad()
        if accumulate:
            with ddp.no_sync():
                _loss(ddp, rank, 100 + step).backward()
        elif synced:
            # Two synced backward passes per step: the second adds to the first's averaged gradient.
            _loss(ddp, rank, 100 + step).backward()
        _loss(ddp, rank, step).backward()
        opt.step()
    return [p.detach().clone() for p in ddp.module.parameters()]


def _average_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


def ddp_case(rank: int, world: int, address: str, case: str, steps: int = 4) -> dict[str, Any]:
    """DDP with gloo's allreduce against DDP with omnireduce_hook, for one case.

    ``address`` "colocated" runs the hook on a :class:`worker.colocated.ColocatedWorker`.
    """
    from worker import Worker
    from worker.ddp import OmniReduceState, cast_wrapper, omnireduce_hook

    unused = case == "unused"
    # A recommender-sized table for the traffic case: a step touches 64 of its rows.
    vocab = 100_000 if case in ("traffic", "rows", "rows_view") else VOCAB
    misused = case == "rows_misused"
    small = case in ("buckets", "rows_buckets")
    kwargs: dict[str, Any] = dict(bucket_cap_mb=0.001 if small else 25, find_unused_parameters=unused)
    if case.endswith("view"):
        # The memory-saving options: gradients are views of DDP's buckets, and the graph is static.
        kwargs.update(gradient_as_bucket_view=True, static_graph=True)
    ref = DDP(_model(unused, vocab, misused), **kwargs)
    ours = DDP(_model(unused, vocab, misused), **kwargs)
    if address == "colocated":
        # Every rank serves one aggregator shard: no daemon, addresses over the gloo group.
        from worker.colocated import ColocatedWorker, torch_exchange

        worker: Any = ColocatedWorker(torch_exchange(), rank, world, job=f"ddp-{case}-{world}", timeout=30)
    else:
        worker = Worker(address, rank=rank, world_size=world, job=f"ddp-{case}-{world}", timeout=30)
    with worker as w:
        # "rows_auto": the hook in its auto mode (gloo the dense group) with tracked tables.
        state = OmniReduceState(w, mode="auto", dense_group=dist.group.WORLD) if case == "rows_auto" else (
            OmniReduceState(w))
        if case == "fp16":
            ref.register_comm_hook(None, default_hooks.fp16_compress_hook)
            ours.register_comm_hook(state, default_hooks.fp16_compress_wrapper(omnireduce_hook))
        elif case == "bf16":
            # torch's bf16_compress_hook needs NCCL; the same cast around gloo's allreduce instead.
            ref.register_comm_hook(None, cast_wrapper(torch.bfloat16, _average_hook))
            ours.register_comm_hook(state, cast_wrapper(torch.bfloat16, omnireduce_hook))
        else:
            ours.register_comm_hook(state, omnireduce_hook)
        tables: list[str] = []
        if case.startswith("rows"):
            from worker.embedding_rows import track_embedding_rows

            # The embedding's gradient goes out as the rows each step looked up (no mask pass).
            # Checked every second use; "rows_synced" never, so that only its rule for
            # accumulated gradients (not the check dropping the table) keeps it right.
            tables = track_embedding_rows(state, ours, verify_every=0 if case == "rows_synced" else 2)
        accumulate = case in ("no_sync", "rows_buckets")
        synced = case == "rows_synced"
        expected = _train_ddp(ref, rank, steps, accumulate, synced)
        got = _train_ddp(ours, rank, steps, accumulate, synced)
        stats = w.stats.total.as_dict()
    rows = state.rows
    return {"expected": expected, "got": got, "stats": stats, "buckets": state.buckets, "error": state.error,
            "tables": tables, "rows_buckets": rows.buckets if rows else 0, "dropped": rows.dropped if rows else [],
            "votes": state.votes}


def _gloo_sum(p: torch.Tensor, world: int, share: float | None = None) -> None:
    """The reference's mean gradient of ``p`` (sparse ones through gloo's sparse allreduce);
    with ``share`` (this rank's share of the samples), the samples-weighted mean."""
    sparse = id(p) in _SPARSE
    if p.grad is None:
        # Unused here; another rank may have used it.
        g = torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.int64), torch.empty((0, *p.shape[1:])),
                                    tuple(p.shape), check_invariants=True) if sparse else torch.zeros_like(p)
    else:
        g = p.grad
    if share is not None:
        g = g * share
    dist.all_reduce(g)
    if share is None:
        g = g / world
    if p.grad is not None or (g._nnz() if g.is_sparse else g.count_nonzero()):
        p.grad = g


_SPARSE: set[int] = set()


def reducer_case(rank: int, world: int, address: str, steps: int = 4, case: str = "dense") -> dict[str, Any]:
    """GradientReducer (no DDP) against a hand-written gloo all_reduce of every gradient.

    Cases: "dense"; "sparse" (sparse tables, one that some ranks do not use); "weighted"
    (the same, rank r counting r + 1 samples); "rows" (dense tables, ``embedding_rows``,
    checked at every use); "rows_synced" (two synced backward passes per step, the second
    adding to the first's sum: only the tracker's rule for accumulated rows keeps it
    right, the check is off); "rows_misused" (the table also read outside its lookups: its
    check drops it on every rank).
    """
    from worker import Worker
    from worker.reducer import GradientReducer

    rows = case.startswith("rows")
    sparse = case in ("sparse", "weighted")
    misused = case == "rows_misused"
    ref = _model(unused=True, rare=not misused and (rows or sparse), sparse=sparse, misused=misused)
    ours = _model(unused=True, rare=not misused and (rows or sparse), sparse=sparse, misused=misused)
    if sparse:
        _SPARSE.update([id(ref.emb.weight), id(ref.rare.weight)])
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(ours.parameters(), lr=0.5)
    if address == "colocated":
        from worker.colocated import ColocatedWorker, torch_exchange

        worker: Any = ColocatedWorker(torch_exchange(), rank, world, job=f"reducer-{case}-{world}", timeout=30,
                                      shard_bytes=0)
    else:
        worker = Worker(address, rank=rank, world_size=world, job=f"reducer-{world}", timeout=30)
    with worker as w:
        reducer = GradientReducer(ours, w, bucket_cap_mb=0.01, embedding_rows=rows,
                                  verify_every=0 if case == "rows_synced" else 1)
        share = None
        if case == "weighted":
            reducer.samples = rank + 1
            share = (rank + 1) / (world * (world + 1) / 2)
        for step in range(steps):
            opt_ref.zero_grad()
            if case == "rows_synced":
                _loss(ref, rank, 100 + step).backward()
                for p in ref.parameters():
                    _gloo_sum(p, world, share)
            _loss(ref, rank, step).backward()
            for p in ref.parameters():
                _gloo_sum(p, world, share)
            opt_ref.step()
            opt.zero_grad()
            if case == "rows_synced":
                _loss(ours, rank, 100 + step).backward()
                reducer.synchronize()
            else:
                with reducer.no_sync():
                    _loss(ours, rank, 100 + step).backward()
                opt.zero_grad()  # the accumulated micro-batch is dropped again: checks no_sync sent nothing
            _loss(ours, rank, step).backward()
            reducer.synchronize()
            opt.step()
        buckets = reducer.num_buckets
        ops = w.stats.ops
        layouts = [str(p.grad.layout) if p.grad is not None else None for p in ours.parameters()]
        ref_layouts = [str(p.grad.layout) if p.grad is not None else None for p in ref.parameters()]
    return {
        "expected": [p.detach().clone() for p in ref.parameters()],
        "got": [p.detach().clone() for p in ours.parameters()],
        "buckets": buckets, "ops": ops, "steps": steps, "layouts": layouts, "ref_layouts": ref_layouts,
        "bytes": w.stats.total.as_dict(), "tables": reducer.rows.tables if reducer.rows else [],
        "dropped": reducer.rows.dropped if reducer.rows else [],
    }


def backend_case(rank: int, world: int, address: str, steps: int = 4) -> dict[str, Any]:
    """DDP on an "omnireduce" process group against DDP on gloo; plus the basic collectives."""
    import os

    import worker.backend  # noqa: F401 - registers the backend

    os.environ["OMNIREDUCE_ADDRESS"] = address
    group = dist.new_group(backend="omnireduce")
    out: dict[str, Any] = {"backend": dist.get_backend(group)}
    t = torch.arange(6, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t, group=group)
    out["all_reduce"] = t
    work = dist.all_reduce(torch.ones(3, dtype=torch.float64), group=group, async_op=True)
    work.wait()
    b = torch.tensor([rank * 10 + 1, -7, 2**40 + rank], dtype=torch.int64)
    dist.broadcast(b, src=world - 1, group=group)
    out["broadcast"] = b
    gathered = [torch.zeros(2, dtype=torch.float16) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([rank, -0.5], dtype=torch.float16), group=group)
    out["all_gather"] = gathered
    dist.barrier(group=group)
    # recv from any source: rank 0 takes one message of each other rank, in whichever order
    # they come, then a tagged one through irecv.
    if rank == 0:
        got: dict[str, Any] = {}
        for _ in range(world - 1):
            t = torch.full((3,), -1.0)
            got[f"recv from {dist.recv(t, group=group)}"] = t
        t = torch.full((2,), -1.0)
        work = dist.irecv(t, group=group, tag=4)
        work.wait()
        got[f"irecv from {work._source_rank()}"] = t
        out["any_source"] = got
    else:
        dist.send(torch.full((3,), float(rank)), 0, group=group)
        if rank == world - 1:
            dist.send(torch.full((2,), 9.0), 0, group=group, tag=4)
    ref = DDP(_model(), bucket_cap_mb=0.01)
    ours = DDP(_model(), bucket_cap_mb=0.01, process_group=group)
    out["expected"] = _train_ddp(ref, rank, steps, accumulate=False)
    out["got"] = _train_ddp(ours, rank, steps, accumulate=False)
    return out


def auto_case(rank: int, world: int, address: str, steps: int = 5, stubborn: int | None = None) -> dict[str, Any]:
    """DDP with the hook in auto mode (gloo as the dense path) against DDP on gloo alone.

    Rank ``stubborn``, if given, has a model that always predicts the sparse path faster.
    """
    from worker import Worker
    from worker.ddp import OmniReduceState, omnireduce_hook

    if rank == stubborn:
        import worker.auto

        worker.auto.model.choose_path = lambda *_a, **_k: ("sparse", 0.0, 1.0)

    def model() -> nn.Module:
        m = _model(vocab=100_000)  # the embedding's gradient: 64 rows of 100,000
        # A wide top (1 MB of dense gradient) that fills DDP's first bucket on its own.
        m.mlp = nn.Sequential(nn.Linear(DIM, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1))
        return m

    ref = DDP(model(), bucket_cap_mb=0.05)
    ours = DDP(model(), bucket_cap_mb=0.05)
    with Worker(address, rank=rank, world_size=world, job=f"auto-{world}", timeout=30) as w:
        state = OmniReduceState(w, dense_group=dist.group.WORLD, mode="auto", probe_every=100)
        ours.register_comm_hook(state, omnireduce_hook)
        expected = _train_ddp(ref, rank, steps, accumulate=False)
        got = _train_ddp(ours, rank, steps, accumulate=False)
        unions = dict(state._chooser._union)
    return {"expected": expected, "got": got, "paths": dict(state.paths), "unions": unions,
            "buckets": state.buckets, "error": state.error, "votes": state.votes}


def weighted_case(rank: int, world: int, address: str, steps: int = 3) -> dict[str, Any]:
    """Ranks with unequal batches (8, 16, 24, ...): DDP with samples-weighted gradients and an
    omnireduce process group with a weighted AVG, against one model trained on the global batch."""
    import worker.backend  # noqa: F401 - registers the backend
    from worker import Worker
    from worker.ddp import OmniReduceState, omnireduce_hook

    sizes = [8 * (r + 1) for r in range(world)]

    def loss_on(model: nn.Module, r: int, step: int) -> torch.Tensor:
        idx, off, y = batch(r, step, n=sizes[r])
        return nn.functional.binary_cross_entropy_with_logits(model(idx, off), y, reduction="sum")

    # The reference: the mean loss over every rank's samples, in one process.
    ref = _model()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(steps):
        opt_ref.zero_grad()
        (sum(loss_on(ref, r, step) for r in range(world)) / sum(sizes)).backward()
        opt_ref.step()
    out: dict[str, Any] = {"expected": [p.detach().clone() for p in ref.parameters()]}

    def train(ddp: DDP, set_samples: Any) -> list[torch.Tensor]:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        for step in range(steps):
            opt.zero_grad()
            set_samples(sizes[rank])
            # Each rank's loss is the mean over its own batch, as in any training loop.
            (loss_on(ddp, rank, step) / sizes[rank]).backward()
            opt.step()
        return [p.detach().clone() for p in ddp.module.parameters()]

    with Worker(address, rank=rank, world_size=world, job=f"weighted-{world}", timeout=30) as w:
        state = OmniReduceState(w)
        ours = DDP(_model(), bucket_cap_mb=0.01)
        ours.register_comm_hook(state, omnireduce_hook)
        out["hook"] = train(ours, lambda n: setattr(state, "samples", n))
        # Without the weights, the plain average of per-rank means: biased towards small batches.
        plain = DDP(_model(), bucket_cap_mb=0.01)
        plain.register_comm_hook(OmniReduceState(w), omnireduce_hook)
        out["unweighted"] = train(plain, lambda _n: None)
    os.environ["OMNIREDUCE_ADDRESS"] = address
    group = dist.new_group(backend="omnireduce")
    # The backend's constructor returns a ProcessGroup, which torch hands back as the group.
    assert isinstance(group, worker.backend.OmniReduceProcessGroup), type(group)
    # DDP's own allreduce divides by the world size and SUMs; a weighted AVG is the
    # backend's, used here as a loop without DDP would.
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(steps):
        opt.zero_grad()
        (loss_on(model, rank, step) / sizes[rank]).backward()
        group.set_samples(sizes[rank])
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=group)
        opt.step()
    out["backend"] = [p.detach().clone() for p in model.parameters()]
    return out


def entry(fn_name: str, rank: int, world: int, init_file: str, results: Any, args: tuple) -> None:
    """Process entry: joins the gloo group, runs one case, puts (rank, result or traceback)."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        try:
            # Bytes, not tensors: a queued tensor is shared through a file descriptor
            # that dies with this process before the parent reads it.
            buf = io.BytesIO()
            torch.save(globals()[fn_name](rank, world, *args), buf)
            results.put((rank, buf.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, traceback.format_exc()))


def train_until_failure(rank: int, world: int, init_file: str, address: str, timeout: float, events: Any) -> None:
    """Trains with the hook until backward() fails; reports when and how.

    Puts ("ready", rank) after a few good steps, then ("failed", rank, time, message,
    state.error's text) once an error reaches backward().
    """
    import time

    from worker import Worker
    from worker.ddp import OmniReduceState, omnireduce_hook

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = DDP(_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with Worker(address, rank=rank, world_size=world, job="doomed", timeout=timeout) as w:
            state = OmniReduceState(w)
            model.register_comm_hook(state, omnireduce_hook)
            for step in range(100_000):
                opt.zero_grad()
                try:
                    _loss(model, rank, step).backward()
                except RuntimeError as e:
                    events.put(("failed", rank, time.time(), str(e), str(state.error)))
                    return
                opt.step()
                if step == 3:
                    events.put(("ready", rank))
                time.sleep(0.01)
        events.put(("finished", rank))
    except BaseException:  # noqa: BLE001 - reported to the parent
        events.put(("crashed", rank, traceback.format_exc()))
    finally:
        # A Queue's put hands the item to a feeder thread: flush it before the hard exit,
        # or the parent may never see the last event.
        events.close()
        events.join_thread()
        # The gloo group cannot be torn down cleanly once a DDP step failed half-way.
        os._exit(0)


class SparseClickModel(nn.Module):
    """ClickModel with ``sparse=True`` embeddings (two tables): their gradients are sparse COO tensors."""

    def __init__(self, vocab: int = VOCAB) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, DIM, mode="sum", sparse=True)
        self.emb2 = nn.Embedding(vocab // 2, DIM, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(2 * DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, idx: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        second = self.emb2(idx[offsets] % self.emb2.num_embeddings)
        return self.mlp(torch.cat([self.emb(idx, offsets), second], dim=1)).squeeze(-1)


class ShortAt:
    """Fault injector around a worker: this rank's op number ``at`` sends its tensor one element
    short, as a rank out of step with the others would, so the aggregator reports a mismatch."""

    def __init__(self, worker: Any, at: int) -> None:
        self._worker = worker
        self._at = at
        self._ops = 0

    def _spoil(self, x: Any, options: dict[str, Any]) -> Any:
        options.pop("inplace", None)
        return x.detach().reshape(-1)[:-1].clone()

    def allreduce_async(self, x: Any, **options: Any) -> Any:
        n, self._ops = self._ops, self._ops + 1
        if n == self._at:
            x = self._spoil(x, options)
        return self._worker.allreduce_async(x, **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._worker, name)


class RefuseAt(ShortAt):
    """Fault injector around a worker: this rank's op number ``at`` is given a negative weight,
    which its worker refuses (a ConfigError here; the op is failed on every rank)."""

    def _spoil(self, x: Any, options: dict[str, Any]) -> Any:
        options["weight"] = -1.0
        return x


class WiderAt:
    """Fault injector for rows ops: this rank's ``at``-th allreduce of :class:`worker.SparseRows`
    claims one row more than the others' (a rank whose tables differ), so the aggregator
    reports a mismatch for the whole coalesced op."""

    def __init__(self, worker: Any, at: int) -> None:
        self._worker = worker
        self._at = at
        self._rows_ops = 0

    def allreduce_async(self, x: Any, **options: Any) -> Any:
        from worker.rows import SparseRows

        if isinstance(x, SparseRows):
            n, self._rows_ops = self._rows_ops, self._rows_ops + 1
            if n == self._at:
                x = SparseRows(x.rows, x.values, x.num_rows + 1)
        return self._worker.allreduce_async(x, **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._worker, name)


class TwoTables(nn.Module):
    """Two sparse tables of one width: the hook sends their gradients as one rows op."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.EmbeddingBag(VOCAB, DIM, mode="sum", sparse=True)
        self.b = nn.EmbeddingBag(VOCAB // 2, DIM, mode="sum", sparse=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, idx: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.a(idx, offsets) + self.b(idx % (VOCAB // 2), offsets)).squeeze(-1)


def sparse_failure_case(rank: int, world: int, address: str) -> dict[str, Any]:
    """DDP with the hook on two coalesced sparse tables; rank 0's rows op of step 2 is out of step.

    Returns the errors backward raised (step, text) and the hook's paths.
    """
    from worker import connect
    from worker.ddp import OmniReduceState, omnireduce_hook

    torch.manual_seed(0)
    ddp = DDP(TwoTables())
    w = connect(address, rank=rank, world_size=world, job="sparse-failure", timeout=5.0)
    state = OmniReduceState(w)
    ddp.register_comm_hook(state, omnireduce_hook)
    if rank == 0:
        # Rows ops 0 and 1 are step 0's tables (a first pass sends each alone), 2 is step 1's
        # joined tables: 3 is step 2's.
        state.worker = WiderAt(w, at=3)
    errors = []
    for step in range(4):
        try:
            _sparse_loss(ddp, rank, step).backward()
        except RuntimeError as e:
            errors.append((step, str(e)))
            break
    out = {"errors": errors, "paths": dict(state.paths), "recorded": repr(state.error)}
    dist.barrier()
    w.close()
    return out


def _sparse_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    idx, off, y = batch(rank, step)
    return nn.functional.binary_cross_entropy_with_logits(model(idx, off), y)


def sparse_ddp_case(rank: int, world: int, address: str, how: str, steps: int = 4) -> dict[str, Any]:
    """DDP with ``sparse=True`` embeddings on gloo against the same through omnireduce.

    ``how``: "hook" (omnireduce_hook on a Worker), "sharded" (the hook on two
    aggregator shards: ``address`` is a comma-separated pair) or "backend" (DDP on an
    omnireduce process group). Returns both runs' parameters and the last step's
    embedding gradients (their rows must be the union of every rank's rows, as gloo's).
    """
    from worker import connect
    from worker.ddp import OmniReduceState, omnireduce_hook

    def model() -> nn.Module:
        torch.manual_seed(0)
        return SparseClickModel()

    def train(ddp: DDP) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        for step in range(steps):
            opt.zero_grad()
            _sparse_loss(ddp, rank, step).backward()
            grads = [ddp.module.emb.weight.grad.clone(), ddp.module.emb2.weight.grad.clone()]
            opt.step()
        return [p.detach().clone() for p in ddp.module.parameters()], grads

    out: dict[str, Any] = {}
    out["expected"], out["expected_grads"] = train(DDP(model()))
    if how == "backend":
        os.environ["OMNIREDUCE_ADDRESS"] = address
        group = dist.new_group(backend="omnireduce")
        out["got"], out["grads"] = train(DDP(model(), process_group=group))
        return out
    addresses = address.split(",") if how == "sharded" else address
    with connect(addresses, rank=rank, world_size=world, job=f"sparse-ddp-{how}-{world}", timeout=30) as w:
        ours = DDP(model())
        state = OmniReduceState(w)
        ours.register_comm_hook(state, omnireduce_hook)
        out["got"], out["grads"] = train(ours)
        out["paths"] = dict(state.paths)
    return out


def static_graph_case(rank: int, world: int, address: str) -> dict[str, Any]:
    """DDP(static_graph=True), whose first iteration hands the hook every bucket as index 0 and
    none as the last: a sparse embedding (held for a next bucket, it never went out: a hang)
    and a Linear through the dense group, with samples that change from step to step (the
    first iteration's agreed share was kept for the next). Against gloo weighting by hand."""
    from worker import Worker
    from worker.ddp import OmniReduceState, omnireduce_hook

    samples = [[1, 1, 1], [3, 1, 1]][rank % 2]
    share: dict[str, float] = {}

    def weighted_gloo(_state, bucket):  # type: ignore[no-untyped-def]  # DDP reads the annotations as objects
        n = torch.tensor([share["n"]])
        total = n.clone()
        dist.all_reduce(total)
        buf = bucket.buffer()
        buf = buf * (n / total) if buf.is_sparse else buf.mul_(n / total)
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])

    def train(ours: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(20, 4, sparse=True), nn.Linear(4, 1))
        ddp = DDP(model, static_graph=True, bucket_cap_mb=1e-5)
        w = None
        if ours:
            w = Worker(address, rank=rank, world_size=world, job="static-graph", timeout=20)
            state = OmniReduceState(w, mode="dense", dense_group=dist.group.WORLD)
            ddp.register_comm_hook(state, omnireduce_hook)
        else:
            ddp.register_comm_hook(None, weighted_gloo)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        for n in samples:
            share["n"] = float(n)
            if ours:
                state.samples = n
            opt.zero_grad()
            ddp(torch.randint(0, 20, (n,), generator=g)).sum().backward()
            opt.step()
        if w is not None:
            w.close()
        return [p.detach().clone() for p in model.parameters()]

    return {"expected": train(False), "got": train(True)}


def group_timeout_case(rank: int, world: int, address: str) -> dict[str, Any]:
    """The op timeout of omnireduce groups made with and without ``timeout=`` and OMNIREDUCE_TIMEOUT:
    each group's worker's, and how long rank 0's all_reduce, which no other rank joins, waits."""
    from datetime import timedelta

    os.environ["OMNIREDUCE_ADDRESS"] = address
    os.environ.pop("OMNIREDUCE_TIMEOUT", None)
    out: dict[str, Any] = {}
    groups = {
        "torch_default": dist.new_group(backend="omnireduce"),
        "given": dist.new_group(backend="omnireduce", timeout=timedelta(seconds=1.5)),
    }
    os.environ["OMNIREDUCE_TIMEOUT"] = "2.5"
    groups["env_wins"] = dist.new_group(backend="omnireduce", timeout=timedelta(seconds=100))
    del os.environ["OMNIREDUCE_TIMEOUT"]
    for name, group in groups.items():
        out[name] = group.worker.settings.timeout
    for name in ("given", "env_wins"):
        if rank == 0:
            start = time.monotonic()
            try:
                dist.all_reduce(torch.ones(3), group=groups[name])
                out[name + "_error"] = None
            except Exception as e:  # noqa: BLE001 - the test checks the text
                out[name + "_error"] = str(e)
            out[name + "_waited"] = time.monotonic() - start
        dist.barrier()
    return out


def failure_case(rank: int, world: int, address: str) -> dict[str, Any]:
    """Failed collectives on an omnireduce group: what every rank sees.

    Each entry is what the rank observed: the exception's type and text (None if
    nothing was raised) and whether the tensor was left as it was.
    """
    from worker.ddp import OmniReduceState, omnireduce_hook

    os.environ["OMNIREDUCE_ADDRESS"] = address
    os.environ["OMNIREDUCE_TIMEOUT"] = "3"
    group = dist.new_group(backend="omnireduce")
    out: dict[str, Any] = {}

    def attempt(name: str, fn: Any, t: torch.Tensor | None = None) -> None:
        before = None if t is None else t.clone()
        try:
            fn()
            out[name] = None
        except Exception as e:  # noqa: BLE001 - the test checks type and text
            out[name] = (type(e).__name__, isinstance(e, RuntimeError), str(e))
        if t is not None:
            out[name + "_unchanged"] = torch.equal(t, before)

    # Ranks disagree on the length: a mismatch, reported to every rank.
    t = torch.ones(10 + rank)
    attempt("sync", lambda: dist.all_reduce(t, group=group), t)
    w = dist.all_reduce(t, group=group, async_op=True)
    attempt("wait", w.wait, t)
    out["is_completed"] = w.is_completed()
    fut = dist.all_reduce(t, group=group, async_op=True).get_future()
    attempt("future_wait", fut.wait, t)
    attempt("future_value", fut.value)
    # A failed collective leaves the group working.
    ok = torch.ones(4) * (rank + 1)
    dist.all_reduce(ok, group=group)
    out["after"] = ok
    # One rank does not call: the others time out (OMNIREDUCE_TIMEOUT).
    if rank == 0:
        attempt("timeout", lambda: dist.all_reduce(torch.ones(3), group=group))
    dist.barrier()
    if rank != 0:
        # Rank 1 catches up on the op rank 0 gave up on, so that their op numbers agree again
        # (it completes if the aggregator still holds rank 0's part, else it times out too).
        attempt("catch_up", lambda: group.worker.allreduce(torch.ones(3)))
    dist.barrier()
    # DDP: the backward of the step where rank 0 is out of step raises on every rank.
    for name, use_hook in (("ddp_backend", False), ("ddp_hook", True)):
        torch.manual_seed(0)
        ddp = DDP(ClickModel(), process_group=dist.group.WORLD if use_hook else group)
        state = OmniReduceState(group.worker)
        if use_hook:
            ddp.register_comm_hook(state, omnireduce_hook)
        errors = []
        for step in range(4):
            if step == 2 and rank == 0:
                # From the third step on (DDP has rebuilt its buckets), rank 0 sends one element short.
                if use_hook:
                    state.worker = ShortAt(state.worker, at=0)
                else:
                    group.worker = ShortAt(group.worker, at=0)
            try:
                _loss(ddp, rank, step).backward()
            except RuntimeError as e:
                errors.append((step, str(e)))
                break
        out[name] = errors
        if isinstance(group.worker, ShortAt):
            group.worker = group.worker._worker
        dist.barrier()
    return out


def collectives_case(rank: int, world: int, address: str) -> dict[str, Any]:
    """The same collectives on gloo (the default group) and on omnireduce groups, for comparison.

    Returns {name: (gloo's result, omnireduce's result)} plus "groups": what the
    subgroups saw. ``OMNIREDUCE_JOB`` is set, as a launcher would, so the subgroups
    must derive jobs of their own from it.
    """
    os.environ["OMNIREDUCE_ADDRESS"] = address
    os.environ["OMNIREDUCE_JOB"] = "collectives"
    ours = dist.new_group(backend="omnireduce")
    g = torch.Generator().manual_seed(rank)
    out: dict[str, Any] = {}

    def both(name: str, make: Any, call: Any) -> None:
        results = []
        for group in (dist.group.WORLD, ours):
            t = make()
            call(t, group)
            results.append(t)
        out[name] = tuple(results)

    ints = {torch.int32: 2**31 - 5, torch.int64: 2**62, torch.int16: 2**15 - 3, torch.int8: 120, torch.uint8: 250}
    for dtype, high in ints.items():
        # Large values: int32/int8/uint8 sums wrap around, as gloo's do; int64 is beyond 2**53.
        base = torch.randint(0, high, (1000,), generator=g, dtype=torch.int64).to(dtype)
        base[::7] = 0
        if dtype == torch.int16:
            # gloo refuses int16: compare with torch's own addition of every rank's tensor.
            gathered = [torch.zeros(len(base), dtype=torch.int32) for _ in range(world)]
            dist.all_gather(gathered, base.to(torch.int32))
            t = base.clone()
            dist.all_reduce(t, group=ours)
            out["sum_int16"] = (sum(x.to(torch.int16) for x in gathered), t)
            continue
        both(f"sum_{dtype}", lambda base=base: base.clone(), lambda t, grp: dist.all_reduce(t, group=grp))
    floats = torch.randn(3, 5, generator=g)
    for op in ("MIN", "MAX", "PRODUCT"):
        both(f"{op}_float", lambda: floats.clone(), lambda t, grp, op=op: dist.all_reduce(t, getattr(dist.ReduceOp, op),
                                                                                          group=grp))
    both("MAX_int64", lambda: torch.tensor([rank, -rank, 2**40 * rank]),
         lambda t, grp: dist.all_reduce(t, dist.ReduceOp.MAX, group=grp))
    both("BOR_uint8", lambda: torch.tensor([1 << rank, 3], dtype=torch.uint8),
         lambda t, grp: dist.all_reduce(t, dist.ReduceOp.BOR, group=grp))
    both("sum_0dim", lambda: torch.tensor(rank + 0.5), lambda t, grp: dist.all_reduce(t, group=grp))
    both("sum_empty", lambda: torch.empty(0, 4), lambda t, grp: dist.all_reduce(t, group=grp))
    # reduce_scatter: each rank keeps its piece of the reduction; the inputs stay as they were.
    pieces = [torch.randn(4, 2, generator=g) for _ in range(world)]
    both("reduce_scatter_float", lambda: torch.zeros(4, 2),
         lambda t, grp: dist.reduce_scatter(t, [p.clone() for p in pieces], group=grp))
    laid = (torch.randn(world * 6, generator=g) * 2**40).to(torch.int64)
    both("reduce_scatter_tensor_int64", lambda: torch.zeros(6, dtype=torch.int64),
         lambda t, grp: dist.reduce_scatter_tensor(t, laid, group=grp))
    both("reduce_scatter_tensor_MAX_float", lambda: torch.zeros(2, 3),
         lambda t, grp: dist.reduce_scatter_tensor(t, laid.float().reshape(world * 2, 3), dist.ReduceOp.MAX,
                                                   group=grp))
    out["reduce_scatter_input_unchanged"] = (laid, laid.clone())
    # The tensor forms of torch 2.13 (all_gather_single, reduce_scatter_single), one by one and
    # coalesced (torch's coalescing manager sends the ops of its block as one call).
    mine = torch.randn(2, 3, generator=g)
    both("into_tensor_all_gather", lambda: torch.zeros(world * 2, 3),
         lambda t, grp: dist.all_gather_into_tensor(t, mine, group=grp))

    def coalesced(t: torch.Tensor, grp: Any) -> None:
        with dist._coalescing_manager(group=grp):
            dist.all_gather_into_tensor(t[0], mine, group=grp)
            dist.all_gather_into_tensor(t[1], mine * 2, group=grp)
        with dist._coalescing_manager(group=grp):
            dist.reduce_scatter_tensor(t[2, :2], laid.float().reshape(world * 2, 3), group=grp)
            dist.reduce_scatter_tensor(t[3, :2], -laid.float().reshape(world * 2, 3), group=grp)
    both("coalesced_tensor_forms_float", lambda: torch.zeros(4, world * 2, 3), coalesced)
    # all_to_all: equal splits, unequal ones (rank r sends r + 1 + j rows to rank j), complex
    # (torch sends it as its real view), and the list form.
    rows = torch.randn(world * 2, 3, generator=g)
    both("all_to_all_single_float", lambda: torch.zeros(world * 2, 3),
         lambda t, grp: dist.all_to_all_single(t, rows, group=grp))
    sent = [rank + 1 + j for j in range(world)]
    wanted = [j + 1 + rank for j in range(world)]
    ragged = (torch.randn(sum(sent), 2, generator=g) * 2**40).to(torch.int64)
    both("all_to_all_single_unequal_int64", lambda: torch.zeros(sum(wanted), 2, dtype=torch.int64),
         lambda t, grp: dist.all_to_all_single(t, ragged, wanted, sent, group=grp))
    both("all_to_all_single_complex", lambda: torch.zeros(world * 2, dtype=torch.complex64),
         lambda t, grp: dist.all_to_all_single(t, torch.view_as_complex(rows[:, :2].contiguous()), group=grp))
    pieces_to = [torch.randn(2, 2, generator=g) for _ in range(world)]
    both("all_to_all_float", lambda: torch.zeros(world, 2, 2),
         lambda t, grp: dist.all_to_all(list(t.unbind(0)), [p.clone() for p in pieces_to], group=grp))
    # Tensors of different sizes per rank (gloo refuses them): rank r gets (j, r) from rank j.
    ins = [torch.full((j + 1, rank + 1), rank * 10 + j) for j in range(world)]
    outs = [torch.zeros(rank + 1, j + 1, dtype=torch.int64) for j in range(world)]
    dist.all_to_all(outs, ins, group=ours)
    out["all_to_all_ragged"] = ([torch.full((rank + 1, j + 1), j * 10 + rank) for j in range(world)], outs)
    # Refused: output splits that do not add up to the output's rows. Failed on the rank whose
    # splits disagree with what the others send (rank 0 expects 2 rows from the last rank, which
    # sends 1), after both ops, so the ranks stay in step for the next all_to_all.
    for name, rows_out, splits in (("refused", world, [1] * (world - 1) + [2]),
                                   ("disagree", world + (rank == 0), [1] * (world - 1) + [1 + (rank == 0)])):
        try:
            dist.all_to_all_single(torch.zeros(rows_out), torch.zeros(world), splits, group=ours)
            out[f"all_to_all_{name}"] = None
        except Exception as e:  # noqa: BLE001 - the test checks the text
            out[f"all_to_all_{name}"] = str(e)
    both("all_to_all_single_after_errors", lambda: torch.zeros(world * 2, 3),
         lambda t, grp: dist.all_to_all_single(t, rows * 2, group=grp))
    gloo_sum = torch.zeros(4, 2)
    dist.reduce_scatter(gloo_sum, [p.clone() for p in pieces])
    avg = torch.zeros(4, 2)
    dist.reduce_scatter(avg, [p.clone() for p in pieces], dist.ReduceOp.AVG, group=ours)
    out["reduce_scatter_AVG_float"] = (gloo_sum / world, avg)
    both("sum_noncontiguous", lambda: torch.arange(12.0).reshape(3, 4).t() * (rank + 1),
         lambda t, grp: dist.all_reduce(t, group=grp))
    sparse = torch.sparse_coo_tensor(torch.randint(0, 50, (1, 20), generator=g), torch.randn(20, 3, generator=g),
                                     (50, 3))
    both("sum_sparse", lambda: sparse.clone(), lambda t, grp: dist.all_reduce(t, group=grp))
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
                  torch.uint8, torch.bool, torch.complex64):
        src = (torch.randn(7, generator=g) * 100).to(dtype) if dtype != torch.bool else torch.rand(7, generator=g) > .5
        # gloo refuses bool and complex: its reference moves their bytes (as uint8) instead.
        as_gloo = (lambda t: t.view(torch.uint8)) if dtype in (torch.bool, torch.complex64) else (lambda t: t)
        results = []
        for grp in (dist.group.WORLD, ours):
            t = src.clone()
            dist.broadcast(as_gloo(t) if grp is dist.group.WORLD else t, src=world - 1, group=grp)
            results.append(t)
        out[f"broadcast_{dtype}"] = tuple(results)
        gathered = []
        for grp in (dist.group.WORLD, ours):
            outs = [torch.zeros_like(src) for _ in range(world)]
            if grp is dist.group.WORLD:
                dist.all_gather([as_gloo(o) for o in outs], as_gloo(src), group=grp)
            else:
                dist.all_gather(outs, src, group=grp)
            gathered.append(outs)
        out[f"all_gather_{dtype}"] = tuple(gathered)
    both("broadcast_empty_int64", lambda: torch.empty(0, dtype=torch.int64),
         lambda t, grp: dist.broadcast(t, src=0, group=grp))
    # Views at an offset that is not a multiple of 8 bytes (slices of a buffer), where the other
    # ranks' buffers start at 0: the bytes go as one type whatever each rank's offset.
    spread = torch.randn(world, 9, generator=g)
    root = 1 % world
    both("broadcast_offset_view_float", lambda: spread[rank].clone()[1:] if rank == root else torch.zeros(8),
         lambda t, grp: dist.broadcast(t, src=root, group=grp))
    gathered = []
    for grp in (dist.group.WORLD, ours):
        outs = [torch.zeros(world * 9)[1 + 9 * j : 9 * (j + 1)] for j in range(world)]
        dist.all_gather(outs, spread[rank][1:], group=grp)
        gathered.append(outs)
    out["all_gather_offset_view_float"] = tuple(gathered)
    both("scatter_offset_view_float", lambda: torch.zeros(11)[3:11],
         lambda t, grp: dist.scatter(t, [spread[j][1:] for j in range(world)] if rank == 0 else None, src=0,
                                     group=grp))

    # Groups: each its own job, even with OMNIREDUCE_JOB set; tearing one down leaves the others.
    groups: dict[str, Any] = {"world_name": ours.group_name}
    pair = dist.new_group([0, 1], backend="omnireduce")
    sub, _ = dist.new_subgroups(group_size=2 if world % 2 == 0 else 1, backend="omnireduce")
    if pair is not None and rank in (0, 1):
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, group=pair)
        groups["pair"] = (t, pair.worker.job, dist.get_world_size(pair))
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, group=sub)
    groups["sub"] = (t, sub.worker.job, dist.get_world_size(sub))
    if pair is not None and rank in (0, 1):
        dist.destroy_process_group(pair)
    t = torch.ones(2)
    dist.all_reduce(t, group=ours)
    groups["after_destroy"] = t
    groups["jobs"] = (ours.worker.job, sub.worker.job)
    out["groups"] = groups
    return out


def rows_disagree_case(rank: int, world: int, address: str, mode: str = "sparse") -> dict[str, Any]:
    """Tracked embedding rows where only rank 0's table gets gradients outside its lookups: rank 0
    drops the table at its first check and sends the bucket by the mask pass, the others as rows.
    What each rank sees from backward(), with the hook in ``mode`` (auto: gloo the dense group)."""
    from worker import Worker
    from worker.ddp import OmniReduceState, omnireduce_hook
    from worker.embedding_rows import track_embedding_rows

    if mode == "auto":
        import worker.auto

        # The cost model would send the bucket dense: rank 0's dropped table must not make it so.
        worker.auto.model.choose_path = lambda *_a, **_k: ("dense", 1.0, 0.0)
    model = DDP(_model(misused=rank == 0))
    with Worker(address, rank=rank, world_size=world, job=f"rows-disagree-{mode}-{world}", timeout=5) as w:
        state = OmniReduceState(w, mode=mode, dense_group=dist.group.WORLD if mode == "auto" else None)
        model.register_comm_hook(state, omnireduce_hook)
        if mode == "auto":
            # Two steps before tracking: the bucket's density is measured, so that from then on
            # the ranks would vote on its path (and it would go dense, through gloo).
            for step in range(2):
                model.zero_grad()
                _loss(model, rank, 10 + step).backward()
            assert state.paths["dense"] == 1, state.paths
            model.zero_grad()
        track_embedding_rows(state, model, verify_every=1)
        error = None
        try:
            _loss(model, rank, 0).backward()
        except Exception as e:  # noqa: BLE001 - the test checks type and text
            error = (type(e).__name__, isinstance(e, RuntimeError), str(e))
        rows = state.rows
        assert rows is not None
        return {"error": error, "dropped": list(rows.dropped), "state_error": type(state.error).__name__}


def refusal_case(rank: int, world: int, address: str) -> dict[str, Any]:
    """Collectives whose arguments only rank 1 gets wrong, on a group whose op timeout is long:
    what every rank raises, how fast, and whether the group works afterwards.

    Returns {name: (exception type, text, seconds)} and "after": an all_reduce's result.
    """
    os.environ["OMNIREDUCE_ADDRESS"] = address
    os.environ["OMNIREDUCE_TIMEOUT"] = "60"
    group = dist.new_group(backend="omnireduce")
    bad = rank == 1
    out: dict[str, Any] = {}

    def attempt(name: str, fn: Any) -> None:
        start = time.monotonic()
        try:
            fn()
            out[name] = (None, "", time.monotonic() - start)
        except Exception as e:  # noqa: BLE001 - the test checks type and text
            out[name] = (type(e).__name__, str(e), time.monotonic() - start)

    x = torch.arange(4, dtype=torch.float32)
    attempt("all_reduce", lambda: dist.all_reduce(x.bool() if bad else x.clone(), group=group))
    attempt("all_reduce_max", lambda: dist.all_reduce(x.to_sparse() if bad else x.clone(), op=dist.ReduceOp.MAX,
                                                      group=group))
    attempt("all_gather", lambda: dist.all_gather([torch.zeros(4) for _ in range(world - bad)], x, group=group))
    attempt("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(
        torch.zeros(4 * world + bad), x, group=group))
    # The root's outputs are of another size (torch itself checks their dtype, not their size).
    outs = [torch.zeros(3) for _ in range(world)] if bad else None
    attempt("gather", lambda: dist.gather(x, outs, dst=1, group=group))
    attempt("reduce_scatter", lambda: dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(2 * world + bad),
                                                                 group=group))
    splits = [1, 2] if bad else [2, 2]  # rank 1's do not add up to its 4 rows
    attempt("all_to_all_single", lambda: dist.all_to_all_single(torch.zeros(4), x, input_split_sizes=splits,
                                                                output_split_sizes=[2, 2], group=group))
    ok = torch.ones(4) * (rank + 1)
    dist.all_reduce(ok, group=group)
    out["after"] = ok
    return out


def _until_refused(rank: int, holder: Any, worker: Any, step: Any) -> list[tuple[int, str, float]]:
    """Runs ``step(n)`` for steps 0-2, rank 0's ``holder.worker`` refusing its first op of step 1
    (:class:`RefuseAt`); returns the first error: (step, type and text, seconds the step took)."""
    for n in range(3):
        if n == 1 and rank == 0:
            holder.worker = RefuseAt(worker, at=0)
        start = time.monotonic()
        try:
            step(n)
        except Exception as e:  # noqa: BLE001 - the test checks type and text
            return [(n, f"{type(e).__name__}: {e}", time.monotonic() - start)]
    return []


def ddp_refusal_case(rank: int, world: int, address: str) -> dict[str, Any]:
    """DDP with the hook and many buckets, a 60 s op timeout: at step 1 rank 0's worker refuses
    that rank's first bucket. What each rank's backward raises and how fast, and whether the
    ranks' next ops pair up."""
    from worker import Worker
    from worker.ddp import OmniReduceState, omnireduce_hook

    torch.manual_seed(0)
    model = DDP(ClickModel(), bucket_cap_mb=0.001)
    with Worker(address, rank=rank, world_size=world, job=f"ddp-refusal-{world}", timeout=60) as w:
        state = OmniReduceState(w)
        model.register_comm_hook(state, omnireduce_hook)

        def step(n: int) -> None:
            model.zero_grad()
            _loss(model, rank, n).backward()

        errors = _until_refused(rank, state, w, step)
        after = w.allreduce(torch.ones(4) * (rank + 1))
        return {"errors": errors, "state_error": repr(state.error), "buckets": state.buckets, "after": after}


def dense_failure_case(rank: int, world: int, address: str, mode: str) -> dict[str, Any]:
    """DDP with the hook in ``mode`` ("dense" or "auto") on a dense model, whose buckets take the
    dense group (gloo): before step 2 rank 0 alone fails (``state.error`` set, as by a bucket
    result it could not write). What each rank's backward raises first, and whether gloo's
    collectives still pair up afterwards."""
    from worker import Worker
    from worker.ddp import OmniReduceState, omnireduce_hook

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)), bucket_cap_mb=0.02)
    x = torch.randn(8, 64) + rank
    with Worker(address, rank=rank, world_size=world, job=f"dense-failure-{mode}-{world}", timeout=60) as w:
        state = OmniReduceState(w, mode=mode, dense_group=dist.group.WORLD, probe_every=100)
        model.register_comm_hook(state, omnireduce_hook)
        errors = []
        for n in range(4):
            if n == 2 and rank == 0:
                state.record(RuntimeError("injected: a failure on rank 0 alone"))
            start = time.monotonic()
            try:
                model.zero_grad()
                model(x).sum().backward()
            except Exception as e:  # noqa: BLE001 - the test checks type and text
                errors.append((n, f"{type(e).__name__}: {e}", time.monotonic() - start))
                break
        after = torch.ones(4) * (rank + 1)
        dist.all_reduce(after)
        return {"errors": errors, "paths": dict(state.paths), "state_error": repr(state.error), "after": after}


def dense_samples_case(rank: int, world: int, address: str, kind: str) -> dict[str, Any]:
    """The hook in dense mode (gloo) with ``samples`` per rank ("ok": 3 and 5; "negative": 3 and -1;
    "one": 3 and None, set on rank 0 only): the gradient each rank gets, or what it raised."""
    from worker import Worker
    from worker.ddp import OmniReduceState, omnireduce_hook

    samples = {"ok": [3.0, 5.0], "negative": [3.0, -1.0], "one": [3.0, None]}[kind][rank]
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    ddp = DDP(model)
    with Worker(address, rank=rank, world_size=world, job=f"dense-samples-{kind}", timeout=30) as w:
        state = OmniReduceState(w, dense_group=dist.group.WORLD, mode="dense", samples=samples)
        ddp.register_comm_hook(state, omnireduce_hook)
        try:
            ddp(torch.full((2, 4), float(rank + 1))).sum().backward()
            return {"grad": model.weight.grad.clone(), "error": None}
        except Exception as e:  # noqa: BLE001 - the test checks the text
            return {"grad": None, "error": f"{type(e).__name__}: {e}", "state_error": repr(state.error)}


class _Bucket:
    """A stand-in for dist.GradBucket: one bucket per step."""

    def __init__(self, buf: torch.Tensor) -> None:
        self._buf = buf

    def buffer(self) -> torch.Tensor:
        return self._buf

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def auto_partial_failure_case(rank: int, world: int, address: str, steps: int = 6) -> dict[str, Any]:
    """The hook in auto mode; step 3's op succeeds on rank 0 and fails on rank 1 alone (its RESULT
    cannot be applied there: injected). Rank 0 records the op's density, rank 1 does not; the
    ranks must still vote at the same ops. Returns each step's outcome and seconds."""
    import worker.auto
    import worker.op
    from omnireduce.errors import ProtocolError
    from worker import Worker
    from worker.ddp import OmniReduceState, omnireduce_hook

    worker.auto.model.choose_path = lambda *_a, **_k: ("sparse", 0.0, 1.0)
    if rank == 1:
        real = worker.op.WorkerOp.on_result

        def on_result(self: Any, msg: Any, data: Any) -> Any:
            if self.op == 3:
                raise ProtocolError("injected: a RESULT rank 1 cannot apply")
            return real(self, msg, data)

        worker.op.WorkerOp.on_result = on_result
    with Worker(address, rank=rank, world_size=world, job=f"auto-partial-{world}", timeout=30) as w:
        state = OmniReduceState(w, dense_group=dist.group.WORLD, mode="auto", probe_every=100)
        out = []
        for step in range(steps):
            buf = torch.zeros(1 << 14)
            buf[: 1 << 10] = rank + 1
            start = time.monotonic()
            try:
                omnireduce_hook(state, _Bucket(buf)).wait()
                out.append((step, "ok", time.monotonic() - start))
            except Exception as e:  # noqa: BLE001 - the test checks what each rank saw
                out.append((step, f"{type(e).__name__}: {e}", time.monotonic() - start))
        return {"steps": out, "votes": state.votes}


def p2p_case(rank: int, world: int, address: str) -> dict[str, Any]:
    """Point-to-point messages on gloo (the default group) and on an omnireduce group, the
    same calls on each: {name: (gloo's received tensors, omnireduce's)}, and what a refused
    and a mismatched message raise on omnireduce.

    A ring of ``batch_isend_irecv`` (every rank sends to the next, receives from the
    previous), messages of several dtypes and shapes (empty, bfloat16, int64 beyond 2**53),
    and two tags sent in one order and received in the other.
    """
    os.environ["OMNIREDUCE_ADDRESS"] = address
    os.environ["OMNIREDUCE_TIMEOUT"] = "20"
    ours = dist.new_group(backend="omnireduce")
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    g = torch.Generator().manual_seed(rank)
    sent = [torch.randn(4, 3, generator=g), torch.randint(-2**62, 2**62, (7,), generator=g),
            torch.randn(5, generator=g).to(torch.bfloat16), torch.zeros(0), torch.randn(2, 3, 4, generator=g),
            # A view at 4 bytes into its buffer (the receiver's starts at 0): the same wire type.
            torch.randn(9, generator=g)[1:]]
    out: dict[str, Any] = {}
    for name, group in (("gloo", dist.group.WORLD), ("omnireduce", ours)):
        got = [torch.full_like(t, -1).contiguous() for t in sent]
        ops = [dist.P2POp(dist.isend, t, nxt, group=group) for t in sent]
        ops += [dist.P2POp(dist.irecv, t, prev, group=group) for t in got]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        # Tags: rank 0 sends tag 1 then tag 0; rank 1 receives tag 0 then tag 1.
        tagged = [torch.full((3,), -1.0), torch.full((3,), -1.0)]
        if rank == 0:
            reqs = [dist.isend(torch.full((3,), 1.0), 1, group=group, tag=1),
                    dist.isend(torch.full((3,), 0.0), 1, group=group, tag=0)]
            for req in reqs:
                req.wait()
        elif rank == 1:
            dist.recv(tagged[0], 0, group=group, tag=0)
            dist.recv(tagged[1], 0, group=group, tag=1)
        out[name] = got + tagged
    errors: dict[str, str] = {}
    for name, call in (
        # torch's dist.send checks this itself; the group is called directly.
        ("self", lambda: ours.send([torch.ones(2)], rank, 0).wait()),
        # Rank 1 receives a tensor one element short of what rank 0 sends: both fail, named.
        ("short", lambda: dist.send(torch.ones(4), 1, group=ours) if rank == 0 else
         dist.recv(torch.ones(3), 0, group=ours) if rank == 1 else None),
    ):
        try:
            call()
            errors[name] = ""
        except Exception as e:  # noqa: BLE001 - the test checks the text
            errors[name] = f"{type(e).__name__}: {e}"
    out["errors"] = errors
    # After the failed message, the pair's next one goes through.
    after = torch.zeros(2)
    if rank == 0:
        dist.send(torch.full((2,), 7.0), 1, group=ours)
    elif rank == 1:
        dist.recv(after, 0, group=ours)
    out["after"] = after
    return out


def reducer_refusal_case(rank: int, world: int, address: str) -> dict[str, Any]:
    """GradientReducer (dense buckets, two sparse tables sent as one op, an unused layer) with a
    60 s op timeout: at step 1 rank 0's worker refuses that rank's first op. What each rank's
    step raises and how fast, and whether the ranks' next ops pair up."""
    from worker import Worker
    from worker.reducer import GradientReducer

    model = _model(unused=True, rare=True, sparse=True)
    with Worker(address, rank=rank, world_size=world, job=f"reducer-refusal-{world}", timeout=60) as w:
        reducer = GradientReducer(model, w, bucket_cap_mb=0.01)

        def step(n: int) -> None:
            model.zero_grad()
            _loss(model, rank, n).backward()
            reducer.synchronize()

        errors = _until_refused(rank, reducer, w, step)
        after = w.allreduce(torch.ones(4) * (rank + 1))
        return {"errors": errors, "error": repr(reducer.error), "buckets": reducer.num_buckets, "after": after}


class _SometimesUsed(nn.Module):
    """A layer, and a parameter that only rank 0 uses, with a gradient of exact zeros."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 1)
        self.extra = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        y = self.lin(x).sum()
        return y + 0.0 * self.extra.sum() if use else y


def reducer_unused_case(rank: int, world: int, address: str, steps: int = 3) -> dict[str, Any]:
    """GradientReducer against DDP on gloo (``find_unused_parameters``) for a parameter that only
    rank 0 uses, whose summed gradient is exact zeros, under SGD with momentum and weight decay:
    DDP gives every rank the zeros, so every rank's optimizer moves the parameter alike."""
    from worker import Worker
    from worker.reducer import GradientReducer

    ref, ours = DDP(_SometimesUsed(), find_unused_parameters=True), _SometimesUsed()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1) for m in (ref, ours)]
    with Worker(address, rank=rank, world_size=world, job=f"reducer-unused-{world}", timeout=30) as w:
        reducer = GradientReducer(ours, w, bucket_cap_mb=0.01)
        for step in range(steps):
            x = torch.full((2, 4), float(rank + step))
            for model, opt in zip((ref, ours), opts, strict=True):
                opt.zero_grad()
                model(x, rank == 0).backward()
                if model is ours:
                    reducer.synchronize()
                opt.step()
        grads = [None if p.grad is None else p.grad.clone() for p in ours.parameters()]
    return {"expected": [p.detach().clone() for p in ref.module.parameters()],
            "got": [p.detach().clone() for p in ours.parameters()], "grads": grads}
