"""worker.embedding_rows: which tables are tracked, and how a bucket is planned (stand-in buckets)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from omnireduce import ConfigError  # noqa: E402
from worker.ddp import OmniReduceState, omnireduce_hook  # noqa: E402
from worker.embedding_rows import RowTracker, track_embedding_rows  # noqa: E402
from worker.knownrows import KnownRows  # noqa: E402


class _Worker:
    """One rank alone: every allreduce returns its input; the calls are recorded."""

    rank, world_size, block_size, message_blocks, streams = 0, 1, 256, 4096, 8

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any]] = []

    def allreduce_async(self, x: Any, **_: Any) -> Future:
        f: Future = Future()
        if isinstance(x, KnownRows):  # a rows op: its tensor, the rows given
            self.calls.append((x.source, x.rows.copy()))
            f.set_result(x.result)
        else:
            self.calls.append((x, None))
            f.set_result(x)
        return f


class _Bucket:
    """A DDP bucket of ``params``, their gradients laid one after the other in one buffer."""

    def __init__(self, params: list[Any], index: int = 0) -> None:
        self._params = params
        self._buffer = torch.cat([p.grad.reshape(-1) for p in params])
        self._grads, at = [], 0
        for p in params:
            self._grads.append(self._buffer[at : at + p.numel()].view_as(p))
            at += p.numel()
        self._index = index

    def buffer(self) -> Any:
        return self._buffer

    def parameters(self) -> list[Any]:
        return self._params

    def gradients(self) -> list[Any]:
        return self._grads

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return True


class _Model(nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Embedding(20, 4)
        self.b = nn.EmbeddingBag(30, 4, mode="sum")
        self.c = nn.Embedding(10, 3)
        self.sparse = nn.Embedding(10, 4, sparse=True)
        self.head = nn.Linear(4, 20, bias=False)
        if tied:
            self.head.weight = self.a.weight

    def forward(self, i: Any) -> Any:
        x = self.a(i) + self.b(i.view(1, -1)) + self.c(i)[:, :1] + self.sparse(i % 10)
        return self.head(x).sum()


def test_tracks_dense_tables_that_no_other_module_holds() -> None:
    assert track_embedding_rows(OmniReduceState(_Worker()), _Model()) == ["a", "b", "c"]
    # A tied output projection gets gradients for every row: its table is not tracked.
    assert track_embedding_rows(OmniReduceState(_Worker()), _Model(tied=True)) == ["b", "c"]
    frozen = _Model()
    frozen.c.weight.requires_grad_(False)
    assert track_embedding_rows(OmniReduceState(_Worker()), frozen) == ["a", "b"]
    with pytest.raises(ConfigError, match="not its dense mode"):
        track_embedding_rows(OmniReduceState(_Worker(), mode="dense", dense_group=object()), _Model())
    assert track_embedding_rows(OmniReduceState(_Worker(), mode="auto", dense_group=object()), _Model()) == [
        "a", "b", "c"]
    with pytest.raises(ConfigError, match="verify_every"):
        RowTracker(verify_every=-1)


def test_a_bucket_goes_as_runs_of_tables_and_one_dense_op() -> None:
    model = _Model()
    w = _Worker()
    state = OmniReduceState(w, average=False)
    track_embedding_rows(state, model)
    with torch.no_grad():
        model(torch.tensor([0, 1, 2, 3, 4]))  # not recorded: no gradients come of it
    model(torch.tensor([2, 7, 7, 9], dtype=torch.int32)).backward()  # int32 ids, as embeddings take too
    # a and b are adjacent tables of width 4: one rows op; head's weight is between b and c
    # (c is of width 3): c its own rows op, head the dense op.
    bucket = _Bucket([model.a.weight, model.b.weight, model.head.weight, model.c.weight])
    expected = bucket.buffer().clone()
    assert omnireduce_hook(state, bucket).wait() is bucket.buffer()
    kinds = [("rows" if rows is not None else "dense", tuple(x.shape)) for x, rows in w.calls]
    assert kinds == [("rows", (50, 4)), ("rows", (10, 3)), ("dense", (80,))]
    np.testing.assert_array_equal(w.calls[0][1], [2, 7, 9, 20 + 2, 20 + 7, 20 + 9])
    np.testing.assert_array_equal(w.calls[1][1], [2, 7, 9])
    assert torch.equal(bucket.buffer(), expected)
    assert state.rows is not None and state.rows.buckets == 1
    # The ids were consumed: a step without lookups sends no rows.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    w.calls.clear()
    omnireduce_hook(state, _Bucket([model.a.weight, model.b.weight])).wait()
    assert [len(rows) for _, rows in w.calls] == [0]


def test_rows_are_averaged_and_a_table_with_gradients_elsewhere_is_dropped() -> None:
    model = _Model()
    w = _Worker()
    w.world_size = 4
    state = OmniReduceState(w)
    track_embedding_rows(state, model, verify_every=1)
    model(torch.tensor([1, 5], dtype=torch.int32)).backward()
    with torch.no_grad():
        model.c.weight.grad[8] = 1.0  # a gradient the lookups do not explain
    bucket = _Bucket([model.a.weight, model.c.weight])
    before = bucket.buffer().clone()
    omnireduce_hook(state, bucket).wait()
    # a: its looked-up rows divided by the world size (the only nonzero ones); c is dropped
    # after its check and goes with the dense op, divided whole.
    assert [rows is None for _, rows in w.calls] == [False, True]
    torch.testing.assert_close(bucket.buffer(), before / 4)
    assert state.rows is not None and state.rows.dropped == ["c"] and state.rows.tables == ["a", "b"]


def test_keyword_lookups_retracking_and_gpu_buckets() -> None:
    model = _Model()
    state = OmniReduceState(_Worker(), average=False)
    track_embedding_rows(state, model)
    first = state.rows
    track_embedding_rows(state, model)  # again: the first tracker's hooks are removed
    assert first is not None and first is not state.rows and len(model.a._forward_hooks) == 1
    model.a(input=torch.tensor([3, 4])).sum().backward()  # a keyword input is recorded too

    class _Elsewhere(_Bucket):
        def buffer(self) -> Any:
            return torch.empty(self._buffer.numel(), device="meta")

    tracker = state.rows
    assert tracker is not None and len(tracker._ids[id(model.a.weight)]) == 1
    # A bucket that is not a CPU buffer takes the usual path, and its tables' ids are consumed.
    assert tracker.bucket_parts(_Elsewhere([model.a.weight])) is None
    assert tracker._ids[id(model.a.weight)] == []


class _Doubling(_Worker):
    """Two ranks holding the same gradients: every op's sum is twice its input, written in place."""

    def allreduce_async(self, x: Any, **kw: Any) -> Future:
        if isinstance(x, KnownRows):
            x.dest[x.rows] *= 2
        else:
            x.mul_(2)
        return super().allreduce_async(x, **kw)


def test_dense_pieces_apart_go_as_one_copy_whose_sum_is_written_back() -> None:
    model = _Model()
    extra = nn.Linear(3, 2)  # its weight and bias lie on either side of table a in the bucket
    state = OmniReduceState(_Doubling(), average=False)
    track_embedding_rows(state, model)
    model(torch.tensor([1, 6])).backward()
    extra(torch.ones(1, 3)).sum().backward()
    bucket = _Bucket([extra.weight, model.a.weight, extra.bias])
    before = bucket.buffer().clone()
    omnireduce_hook(state, bucket).wait()
    kinds = [("rows" if rows is not None else "dense", tuple(x.shape)) for x, rows in state.worker.calls]
    assert kinds == [("rows", (20, 4)), ("dense", (8,))]
    # Every nonzero element doubled, wherever it lies: the dense copy's sum went back to both pieces.
    assert torch.equal(bucket.buffer(), 2 * before)


class _ReadOutside(nn.Module):
    """A table also read outside its lookups (its check drops it), and a head that works without it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 4)
        self.head = nn.Linear(4, 1)
        # The same weights on every rank, from a generator of its own: the ranks are threads here,
        # and the global one's draws would interleave.
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, ids: Any) -> Any:
        return self.head(self.emb(ids)).sum() + self.emb.weight[:2].sum()


def test_reducer_sends_a_dropped_table_whole_even_from_a_rank_that_did_not_use_it(aggregator: Any) -> None:
    # The table is dropped at its first check on both ranks; at step 2 rank 1 does not use it
    # (no gradient): it must send zeros the way rank 0 sends its gradient (whole, not as rows).
    from tests.helpers import run_ranks
    from worker import Worker
    from worker.reducer import GradientReducer

    def rank(r: int) -> dict[str, Any]:
        model, ref = _ReadOutside(), _ReadOutside()
        with Worker(aggregator.address, rank=r, world_size=2, job="dropped-unused", timeout=20) as w:
            reducer = GradientReducer(model, w, embedding_rows=True, verify_every=1)
            for step in range(3):
                model.zero_grad()
                ids = torch.tensor([r + 3, 7])
                if step == 2 and r == 1:
                    model.head(torch.ones(4)).sum().backward()
                else:
                    model(ids).backward()
                reducer.synchronize()
            ref(torch.tensor([3, 7])).backward()  # rank 0's step-2 gradient, unreduced
            return {"grad": model.emb.weight.grad.clone(), "dropped": list(reducer.rows.dropped),
                    "alone": ref.emb.weight.grad / 2}

    results = run_ranks(2, rank)
    for res in results:
        assert res["dropped"] == ["emb"]
        torch.testing.assert_close(res["grad"], results[0]["alone"])


def test_reducer_consumes_a_tables_ids_when_its_gradient_goes_whole(aggregator: Any) -> None:
    # A gradient that is not a contiguous CPU tensor (a CUDA model's; here a transposed copy)
    # goes whole; its lookups must not pile up in the tracker step after step.
    from worker import Worker
    from worker.reducer import GradientReducer

    model = _ReadOutside()
    with Worker(aggregator.address, rank=0, world_size=1, job="ids-consumed", timeout=20) as w:
        reducer = GradientReducer(model, w, embedding_rows=True, verify_every=0)
        weight = model.emb.weight
        for _ in range(3):
            model.zero_grad()
            with reducer.no_sync():  # nothing sent during backward: the gradient is swapped first
                model.head(model.emb(torch.tensor([4, 9]))).sum().backward()
            grad = weight.grad.clone()
            weight.grad = grad.t().contiguous().t()
            assert not weight.grad.is_contiguous()
            reducer.synchronize()
            torch.testing.assert_close(weight.grad, grad)
            assert reducer.rows is not None and reducer.rows._ids[id(weight)] == []
