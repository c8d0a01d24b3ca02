"""The DDP hook's grouping of sparse gradients, with stand-in buckets and a stand-in worker."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from omnireduce.errors import ConfigError  # noqa: E402
from worker.ddp import OmniReduceState, omnireduce_hook  # noqa: E402
from worker.rows import SparseRows  # noqa: E402


class _Worker:
    """One rank alone: every allreduce returns its input, and the calls are recorded."""

    rank, world_size, block_size, message_blocks, streams = 0, 1, 256, 4096, 8

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.keys: list[Any] = []

    def allreduce_async(self, x: Any, inplace: bool = False, weight: float | None = None, key: Any = None) -> Future:
        self.calls.append(x)
        self.keys.append(key)
        f: Future = Future()
        f.set_result(x if not isinstance(x, SparseRows) else SparseRows(x.rows, x.values.copy(), x.num_rows))
        return f


class _Bucket:
    def __init__(self, index: int, buffer: Any, last: bool) -> None:
        self._index, self._buffer, self._last = index, buffer, last

    def buffer(self) -> Any:
        return self._buffer

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last


def _sparse(rows: list[int], num_rows: int = 10, width: int = 4) -> Any:
    idx = torch.tensor([rows])
    return torch.sparse_coo_tensor(idx, torch.ones(len(rows), width), (num_rows, width)).coalesce()


def _kinds(calls: list[Any]) -> list[Any]:
    return [("rows", x.num_rows) if isinstance(x, SparseRows) else ("dense", x.numel()) for x in calls]


def test_a_dense_bucket_sends_the_sparse_gradients_held_before_it() -> None:
    w = _Worker()
    state = OmniReduceState(w)
    # A sampled softmax's output embedding is ready first, the LSTM's dense bucket next, the
    # input embedding last: the first table goes out before the dense bucket, not at the end.
    buckets = [_Bucket(0, _sparse([1, 3]), False), _Bucket(1, torch.ones(8), False),
               _Bucket(2, _sparse([2], num_rows=6), False), _Bucket(3, _sparse([0, 5], num_rows=6), True)]
    for b in buckets:  # the first pass, which tells the next what follows each bucket
        omnireduce_hook(state, b)
    w.calls.clear()
    futures = [omnireduce_hook(state, b) for b in buckets]
    assert _kinds(w.calls) == [("rows", 10), ("dense", 8), ("rows", 12)]
    for b, f in zip(buckets, futures, strict=True):
        got = f.wait()
        want = b.buffer()
        assert torch.equal(got.to_dense(), want.to_dense()) if want.is_sparse else torch.equal(got, want)


def test_consecutive_sparse_gradients_are_one_op() -> None:
    w = _Worker()
    state = OmniReduceState(w)
    buckets = [_Bucket(0, torch.ones(8), False), *(_Bucket(i, _sparse([i]), i == 3) for i in (1, 2, 3))]
    for f in [omnireduce_hook(state, b) for b in buckets]:
        f.wait()
    # The first pass cannot know what follows a bucket: each goes out alone.
    assert _kinds(w.calls) == [("dense", 8), ("rows", 10), ("rows", 10), ("rows", 10)]
    w.calls.clear()
    for f in [omnireduce_hook(state, b) for b in buckets]:
        f.wait()
    assert _kinds(w.calls) == [("dense", 8), ("rows", 30)]


def test_after_the_first_pass_a_sparse_gradient_followed_by_a_dense_bucket_goes_out_at_once() -> None:
    w = _Worker()
    state = OmniReduceState(w)

    def buckets() -> list[_Bucket]:
        return [_Bucket(0, _sparse([1, 3]), False), _Bucket(1, torch.ones(8), False),
                _Bucket(2, _sparse([2], num_rows=6), False), _Bucket(3, _sparse([0, 5], num_rows=6), True)]

    first = buckets()
    omnireduce_hook(state, first[0])
    # The first pass cannot know what follows: the table goes out at once (held, it would wait
    # for a next bucket, which a first pass may not announce: DDP's static_graph).
    assert _kinds(w.calls) == [("rows", 10)]
    for b in first[1:]:
        omnireduce_hook(state, b)
    w.calls.clear()
    second = buckets()
    futures = [omnireduce_hook(state, second[0])]
    # The previous pass says a dense bucket follows: the table goes out before backward reaches it.
    assert _kinds(w.calls) == [("rows", 10)]
    futures.append(omnireduce_hook(state, second[1]))
    futures.append(omnireduce_hook(state, second[2]))
    # A sparse one follows bucket 2: it is held, and joined with bucket 3's rows.
    assert _kinds(w.calls) == [("rows", 10), ("dense", 8)]
    futures.append(omnireduce_hook(state, second[3]))
    assert _kinds(w.calls) == [("rows", 10), ("dense", 8), ("rows", 12)]
    # A dense bucket's op names it from step to step (a sharded worker sizes it from its last
    # union); rows sent through the hold (joined or not) have no key of their own.
    assert w.keys[-3:] == [None, (1, 8, torch.float32), None]
    for b, f in zip(second, futures, strict=True):
        got, want = f.wait(), b.buffer()
        assert torch.equal(got.to_dense(), want.to_dense()) if want.is_sparse else torch.equal(got, want)


def test_a_pass_that_differs_from_the_previous_one_still_sends_every_gradient() -> None:
    w = _Worker()
    state = OmniReduceState(w)
    for b in [_Bucket(0, _sparse([1]), False), _Bucket(1, torch.ones(8), True)]:
        omnireduce_hook(state, b)
    w.calls.clear()
    # Now two sparse buckets come where the last pass had a sparse and a dense one.
    futures = [omnireduce_hook(state, b) for b in [_Bucket(0, _sparse([1]), False), _Bucket(1, _sparse([2]), True)]]
    assert _kinds(w.calls) == [("rows", 10), ("rows", 10)]
    assert [sorted(f.wait().coalesce().indices()[0].tolist()) for f in futures] == [[1], [2]]


class _Refusing(_Worker):
    """Records the ops it refuses: (bytes, key)."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: list[tuple[int, Any]] = []

    def refuse(self, error: BaseException, x: Any = None, **options: Any) -> None:
        self.refused.append((x.numel() * x.element_size(), options.get("key")))


def _stub_dense_group(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Makes the hook's dense-group allreduce return its input, and its closing agreement of a
    pass pass the last bucket's future through; returns the sizes the allreduce is called with
    and "agreement" for each agreement, in order."""
    import worker.ddp as ddp

    calls: list[Any] = []

    def dense(state: Any, buf: torch.Tensor) -> torch.futures.Future:
        calls.append(buf.numel())
        f: torch.futures.Future = torch.futures.Future()
        f.set_result(buf)
        return f

    def agreement(state: Any, last: torch.futures.Future, device: Any) -> torch.futures.Future:
        calls.append("agreement")
        return last

    monkeypatch.setattr(ddp, "_dense_allreduce", dense)
    monkeypatch.setattr(ddp, "_step_agreement", agreement)
    monkeypatch.setattr(ddp, "_pass_weight", lambda state: None)
    return calls


def test_after_a_failure_buckets_are_refused_on_their_own_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once ``state.error`` is set, a bucket of the sparse protocol is refused (numbered and failed
    on every rank), a bucket of the dense group joins the group's allreduce (the other ranks run
    it; gloo stays in step) and numbers nothing; held sparse gradients are refused as one op."""
    dense_calls = _stub_dense_group(monkeypatch)
    for mode in ("sparse", "dense"):
        w = _Refusing()
        state = OmniReduceState(w, mode=mode, dense_group=None if mode == "sparse" else object())
        state.error = RuntimeError("an earlier bucket failed")
        state._last_kinds = {0: False, 1: True, 2: True}  # as the previous pass left it
        dense_calls.clear()
        buckets = [_Bucket(0, torch.ones(8), False), _Bucket(1, _sparse([1, 3]), False),
                   _Bucket(2, _sparse([2], num_rows=6), True)]
        futures = [omnireduce_hook(state, b) for b in buckets]
        for f in futures:
            with pytest.raises(RuntimeError, match="skipped after an earlier failure"):
                f.wait()
        assert w.calls == []
        # The two tables (10 + 6 rows of 4 float32) as one joined op, as they would have gone.
        joined = (16 * 4 * 4, None)
        if mode == "sparse":
            assert w.refused == [(32, (0, 8, torch.float32)), joined] and dense_calls == []
        else:
            # The pass used the dense group: it ends with the ranks' agreement on it.
            assert w.refused == [joined] and dense_calls == [8, "agreement"]


def test_after_a_failure_auto_mode_follows_a_standing_verdict_and_votes_sparse_on_a_new_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In auto mode after a failure: a bucket whose dense verdict stands (no vote) still joins the
    dense group's allreduce, as the other ranks take that path too; where the ranks would vote,
    this rank votes sparse (so the others do not wait in gloo) and refuses the op."""
    import worker.ddp as ddp

    dense_calls = _stub_dense_group(monkeypatch)
    votes: list[tuple[str, Any]] = []

    def agree(state: Any, key: Any, path: str, basis: Any) -> str:
        votes.append((path, basis))
        return path if basis is None else "sparse"  # the MIN of the ranks' votes: this one's sparse

    monkeypatch.setattr(ddp, "_agree", agree)

    class Chooser:
        def __init__(self, plans: list[tuple[str, Any]]) -> None:
            self.plans = plans

        def plan(self, key: Any, numel: int, size: int) -> tuple[str, Any]:
            return self.plans.pop(0)

    w = _Refusing()
    state = OmniReduceState(w, mode="auto", dense_group=object())
    state._chooser = Chooser([("dense", None), ("dense", 7)])
    state.error = RuntimeError("an earlier bucket failed")
    futures = [omnireduce_hook(state, _Bucket(0, torch.ones(8), False)),
               omnireduce_hook(state, _Bucket(1, torch.ones(4), True))]
    for f in futures:
        with pytest.raises(RuntimeError, match="skipped after an earlier failure"):
            f.wait()
    assert votes == [("dense", None), ("sparse", 7)]
    assert dense_calls == [8, "agreement"] and w.refused == [(16, (1, 4, torch.float32))] and w.calls == []


def test_a_failed_dense_group_bucket_is_the_states_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucket whose dense-group allreduce fails keeps its error in ``state.error``, as an
    omnireduce bucket's does, so that the buckets after it are refused."""
    import worker.ddp as ddp

    class FailedWork:
        def get_future(self) -> torch.futures.Future:
            f: torch.futures.Future = torch.futures.Future()
            f.set_exception(RuntimeError("gloo: connection closed by peer"))
            return f

    monkeypatch.setattr(ddp.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(ddp.dist, "all_reduce", lambda *a, **k: FailedWork())
    state = OmniReduceState(_Refusing(), mode="dense", dense_group=object())
    future = ddp._dense_allreduce(state, torch.ones(4))
    with pytest.raises(RuntimeError, match="connection closed by peer"):
        future.wait()
    assert state.error is not None and "connection closed by peer" in str(state.error)


def test_the_state_refuses_what_is_not_a_worker() -> None:
    # README's snippet once passed the worker package itself: an AttributeError at the first bucket.
    import worker

    for bad in (worker, None, "tcp://127.0.0.1:5555"):
        with pytest.raises(ConfigError, match=r"needs a connected worker \(worker.connect"):
            OmniReduceState(bad)  # type: ignore[arg-type]


def test_the_hooks_auto_mode_refuses_a_worker_that_chooses_for_itself() -> None:
    """The worker's own auto mode picks each op's path from its host's cost file alone: beside the
    hook's auto mode, whose votes every rank must join alike, ranks could drift apart."""
    choosing = _Worker()
    choosing.mode = "auto"  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="needs a worker in sparse mode"):
        OmniReduceState(choosing, mode="auto", dense_group=object())
    OmniReduceState(choosing, mode="sparse")  # the hook's sparse mode leaves the choice to the worker
    plain = _Worker()
    plain.mode = "sparse"  # type: ignore[attr-defined]
    OmniReduceState(plain, mode="auto", dense_group=object())


def test_a_bucket_that_held_a_tracked_table_takes_the_sparse_protocol_in_every_mode(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank may drop a tracked table on its own (its check failed): its bucket then has no
    rows parts there, while the other ranks' still have. In dense mode too (a state switched to
    it after tracking) that bucket must not go to the dense group on that rank alone."""
    dense_calls = _stub_dense_group(monkeypatch)

    class Dropped:
        def ever_held(self, bucket: Any) -> bool:
            return True

        def bucket_parts(self, bucket: Any) -> None:
            return None  # dropped here: the whole bucket as one op

    for mode in ("dense", "auto"):
        w = _Worker()
        state = OmniReduceState(w, mode=mode, dense_group=object())
        state.rows = Dropped()
        omnireduce_hook(state, _Bucket(0, torch.ones(8), True)).wait()
        assert _kinds(w.calls) == [("dense", 8)] and dense_calls == [], mode


def test_a_healthy_and_a_failed_rank_run_the_same_dense_group_collectives_in_a_first_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Samples are agreed per bucket in a first pass (its end may go unseen): a healthy rank and
    one that failed earlier (whose dense buckets only join the group) must still run the same
    collectives, or gloo pairs one rank's agreement with another's bucket."""
    import worker.ddp as ddp

    class Done:
        def __init__(self, t: torch.Tensor) -> None:
            self._t = t

        def get_future(self) -> torch.futures.Future:
            f: torch.futures.Future = torch.futures.Future()
            f.set_result([self._t])
            return f

    def collectives(failed: bool) -> list[tuple[int, torch.dtype]]:
        calls: list[tuple[int, torch.dtype]] = []

        def all_reduce(t: torch.Tensor, *args: Any, **kwargs: Any) -> Done:
            calls.append((t.numel(), t.dtype))
            if t.dtype == torch.float64:
                t.mul_(2)  # the other rank set the same samples
            return Done(t)

        monkeypatch.setattr(ddp.dist, "all_reduce", all_reduce)
        monkeypatch.setattr(ddp.dist, "get_world_size", lambda group=None: 2)
        state = OmniReduceState(_Refusing(), mode="dense", dense_group=object(), samples=3.0)
        if failed:
            state.error = RuntimeError("an earlier bucket failed")
        for b in [_Bucket(0, torch.ones(8), False), _Bucket(1, torch.ones(4), True)]:
            try:
                omnireduce_hook(state, b).wait()
            except RuntimeError:
                assert failed
        return calls

    healthy = collectives(failed=False)
    assert healthy == [(3, torch.float64), (8, torch.float32), (3, torch.float64), (4, torch.float32),
                       (1, torch.int32)]
    assert collectives(failed=True) == healthy
