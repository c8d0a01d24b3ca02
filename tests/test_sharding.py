"""Sharded aggregators: ``connect([addr0, addr1, ...])`` splits every op over several aggregators."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from aggregator import Aggregator
from omnireduce import ConfigError, MismatchError, OmniReduceError, PeerRefusedError, WorkerClosedError
from tests.helpers import run_ranks, sparse
from worker import Allreducer, ShardedWorker, Worker, connect
from worker.sharded import shard_bounds

# Small blocks and messages: short tensors still span many blocks, shards and rounds.
# shard_bytes=0: every op is split over every shard, however small (the split is what is tested).
SMALL = dict(block_size=16, message_blocks=4, streams=2, shard_bytes=0)
LENGTHS = [0, 1, 2, 15, 16, 17, 47, 100, 1000, 4099, 100_003]


def _inputs(seed: int, world: int, n: int, dtype: Any, density: float = 0.4, block: int = 16) -> list[np.ndarray]:
    """Random non-integer values in random blocks: float sums that depend on order, so equal
    bits mean the same additions in the same order. Zeros are +0.0: the aggregator's sum of
    -0.0 values depends on how a round's payloads line up (numerically equal either way)."""
    rng = np.random.default_rng(seed)
    return [sparse(rng, n, density, block, dtype, normal=True) for _ in range(world)]


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


def _reduce_all(address: Any, world: int, job: str, inputs: list[list[Any]], **kw: Any) -> list[list[Any]]:
    """Every rank sums every tensor of its list, all ops in flight at once."""

    def rank(r: int) -> list[Any]:
        with connect(address, rank=r, world_size=world, job=job, timeout=20, **SMALL, **kw) as w:
            futures = [w.allreduce_async(x) for x in inputs[r]]
            return [f.result(timeout=30) for f in futures]

    return run_ranks(world, rank)


def test_shard_bounds_split_on_blocks() -> None:
    assert shard_bounds(0, 16, 3) == [(0, 0), (0, 0), (0, 0)]
    assert shard_bounds(17, 16, 3) == [(0, 0), (0, 16), (16, 17)]
    assert shard_bounds(100, 10, 3) == [(0, 30), (30, 60), (60, 100)]
    b = shard_bounds(1_000_003, 256, 4)
    assert b[0][0] == 0 and b[-1][1] == 1_000_003
    assert all(lo % 256 == 0 and hi >= lo for lo, hi in b)
    assert all(b[i][1] == b[i + 1][0] for i in range(3))


@pytest.mark.parametrize("n_shards", [1, 2, 3])
def test_identical_to_one_aggregator(shards: list[Aggregator], n_shards: int) -> None:
    world = 3
    per_dtype = {np.float32: LENGTHS, np.float64: [0, 17, 1000, 4099], np.float16: [1, 33, 4099]}
    cases = [(dt, n) for dt, lengths in per_dtype.items() for n in lengths]
    inputs = [[] for _ in range(world)]
    for i, (dt, n) in enumerate(cases):
        for r, x in enumerate(_inputs(i, world, n, dt)):
            inputs[r].append(x)
    for r in range(world):
        inputs[r].append(inputs[r][-1][:4098].reshape(3, -1)[:, :1000])  # a non-contiguous 2-D view
    addresses = [a.address for a in shards[:n_shards]]
    got = _reduce_all(addresses, world, f"sharded-{n_shards}", inputs)
    ref = _reduce_all(shards[2].address, world, f"single-{n_shards}", inputs)
    for r in range(world):
        for i, x in enumerate(inputs[r]):
            assert type(got[r][i]) is np.ndarray and got[r][i].shape == x.shape and got[r][i].dtype == x.dtype
            assert np.array_equal(_bits(got[r][i]), _bits(ref[r][i])), (r, i, x.dtype, x.shape)
            assert np.array_equal(_bits(got[r][i]), _bits(got[0][i]))


def test_torch_bfloat16_float32_inplace_and_out(shards: list[Aggregator]) -> None:
    torch = pytest.importorskip("torch")
    world = 2
    addresses = [a.address for a in shards]
    xs = [_inputs(7, world, 4099, np.float32)[r] for r in range(world)]

    def run(address: Any, job: str) -> list[list[Any]]:
        def rank(r: int) -> list[Any]:
            with connect(address, rank=r, world_size=world, job=job, timeout=20, **SMALL) as w:
                t = torch.from_numpy(xs[r].copy()).reshape(1, 4099)
                bf = t.to(torch.bfloat16)
                half = t.to(torch.float16)[:, ::2]  # non-contiguous
                inplace = t.clone()
                out = np.zeros(4099, dtype=np.float32)
                futures = [w.allreduce_async(bf), w.allreduce_async(t), w.allreduce_async(half)]
                w.allreduce(inplace, inplace=True)
                res = w.allreduce(xs[r], out=out)
                assert res.base is out or np.shares_memory(res, out)
                return [f.result(timeout=30) for f in futures] + [inplace, out]

        return run_ranks(world, rank)

    got = run(addresses, "torch-sharded")
    ref = run(shards[0].address, "torch-single")
    for r in range(world):
        for g, e in zip(got[r], ref[r], strict=True):
            if isinstance(e, np.ndarray):
                assert np.array_equal(g, e)
                continue
            assert isinstance(g, torch.Tensor) and g.dtype == e.dtype and g.shape == e.shape
            assert torch.equal(g.view(torch.int16) if g.dtype == torch.bfloat16 else g,
                               e.view(torch.int16) if e.dtype == torch.bfloat16 else e)
    assert got[0][0].dtype == torch.bfloat16 and got[0][3].shape == (1, 4099)


def test_many_ops_in_flight_from_several_threads(shards: list[Aggregator]) -> None:
    world = 2
    addresses = [a.address for a in shards[:2]]
    inputs = [[_inputs(100 + i, world, 50 + 37 * i, np.float32)[r] for i in range(40)] for r in range(world)]

    def rank(r: int) -> list[np.ndarray]:
        with connect(addresses, rank=r, world_size=world, job="inflight", timeout=20, **SMALL) as w:
            # Two callers submit in turns under a lock, so every rank numbers the ops alike.
            futures: list[Any] = [None] * len(inputs[r])
            lock = threading.Lock()
            order = iter(range(len(inputs[r])))

            def submit() -> None:
                while True:
                    with lock:
                        i = next(order, None)
                        if i is None:
                            return
                        futures[i] = w.allreduce_async(inputs[r][i])

            ts = [threading.Thread(target=submit) for _ in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(30)
            out = [f.result(timeout=30) for f in futures]
            assert w.stats.ops == len(inputs[r])
            assert w.stats.total.elements == sum(len(x) for x in inputs[r])
            return out

    got = run_ranks(world, rank)
    for i in range(len(inputs[0])):
        expected = inputs[0][i] + inputs[1][i]
        for r in range(world):
            assert np.array_equal(got[r][i], expected)


def test_weighted_ops_match_one_aggregator(shards: list[Aggregator]) -> None:
    world = 2
    inputs = [[_inputs(40 + i, world, n, np.float32)[r] for i, n in enumerate([5, 1000, 4099])] for r in range(world)]

    def run(address: Any, job: str) -> list[list[np.ndarray]]:
        def rank(r: int) -> list[np.ndarray]:
            with connect(address, rank=r, world_size=world, job=job, timeout=20, **SMALL) as w:
                futures = [w.allreduce_async(x, weight=3 * r + 1, compute_time=0.1) for x in inputs[r]]
                out = [f.result(timeout=30) for f in futures]
                out.append(w.recommended_batches)
                return out

        return run_ranks(world, rank)

    got, ref = run([a.address for a in shards], "weighted-sharded"), run(shards[0].address, "weighted-single")
    for r in range(world):
        for g, e in zip(got[r][:-1], ref[r][:-1], strict=True):
            assert np.array_equal(_bits(g), _bits(e))
        assert got[r][-1] == ref[r][-1]


def test_comma_string_and_environment(shards: list[Aggregator], monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = shards[0].address, shards[1].address
    monkeypatch.setenv("OMNIREDUCE_ADDRESS", f"{a}, {b}")
    x = [np.arange(1000, dtype=np.float32), np.ones(1000, dtype=np.float32)]

    def rank(r: int) -> np.ndarray:
        if r == 0:
            w = connect(rank=r, world_size=2, job="env", timeout=20, **SMALL)
        else:
            # The old way still works, with a warning.
            with pytest.warns(DeprecationWarning, match="worker.connect"):
                w = Worker(f"{a},{b}", r, 2, "env", timeout=20, **SMALL)
        with w:
            assert isinstance(w, ShardedWorker) and isinstance(w, Allreducer)
            assert w.addresses == (a, b) and w.address == f"{a},{b}"
            assert (w.rank, w.world_size, w.job, w.block_size) == (r, 2, "env", 16)
            y = w.allreduce(x[r])
            assert w.stats.last is not None and w.stats.last.elements == 1000
            assert w.stats.last.dense_bytes == 4000
            return y

    for y in run_ranks(2, rank):
        assert np.array_equal(y, x[0] + x[1])
    # One address keeps the plain worker.
    monkeypatch.setenv("OMNIREDUCE_ADDRESS", a)
    with Worker(rank=0, world_size=1, timeout=20) as w:
        assert type(w) is Worker
    with Worker(a, rank=0, world_size=1, timeout=20) as w:
        assert type(w) is Worker


def test_bad_addresses_and_closed() -> None:
    with pytest.raises(ConfigError, match="twice"):
        connect(["tcp://127.0.0.1:1", "tcp://127.0.0.1:1"], rank=0, world_size=1)
    with pytest.raises(ConfigError):
        connect(["tcp://127.0.0.1:1", "nonsense"], rank=0, world_size=1)
    w = connect(["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], rank=0, world_size=2, timeout=30)
    fut = w.allreduce_async(np.ones(100, dtype=np.float32))
    w.close()
    with pytest.raises(WorkerClosedError, match="shard 0"):
        fut.result(timeout=10)
    with pytest.raises(WorkerClosedError):
        w.allreduce_async(np.ones(3, dtype=np.float32))


def test_inputs_the_sharded_worker_refuses() -> None:
    class FakeDeviceArray:
        __cuda_array_interface__: dict[str, Any] = {}

    with connect(["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], rank=0, world_size=2, timeout=30) as w:
        with pytest.raises(ConfigError, match="torch tensors only"):
            w.allreduce_async(FakeDeviceArray())
        with pytest.raises(ConfigError, match="contiguous"):
            w.allreduce_async(np.ones((4, 4), dtype=np.float32)[:, :2], inplace=True)
        with pytest.raises(ConfigError, match="out must be"):
            w.allreduce_async(np.ones(10, dtype=np.float32), out=np.zeros(9, dtype=np.float32))
        with pytest.raises(ConfigError):
            w.allreduce_async([1.0, 2.0])
        assert w.stats.ops == 0


def test_an_integer_cuda_tensor_is_refused_before_any_shard_takes_a_part(shards: list[Aggregator],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused up front: with one block over two shards the first part is empty (sent as a
    host tensor, which a shard takes), and a refusal by the second shard would leave the
    shards' op numbers apart, the worker broken for good."""
    torch = pytest.importorskip("torch")
    from worker import sharded

    # No GPU here: CPU torch tensors stand in for CUDA ones on the sharded path.
    monkeypatch.setattr(sharded, "is_cuda_tensor", lambda x: isinstance(x, torch.Tensor))
    assert sharded.shard_bounds(4, 16, 2)[0] == (0, 0)
    with connect([a.address for a in shards[:2]], rank=0, world_size=1, job="int-cuda", timeout=20, **SMALL) as w:
        with pytest.raises(ConfigError, match="CUDA torch.int32"):
            w.allreduce_async(torch.ones(4, dtype=torch.int32))
        x = np.arange(40, dtype=np.float32)
        np.testing.assert_array_equal(w.allreduce(x), x)  # still usable


def test_closed_shard_fails_the_op_naming_it(shards: list[Aggregator]) -> None:
    addresses = [a.address for a in shards[:2]]
    ws = [connect(addresses, rank=r, world_size=2, job="shard-dies", timeout=3, heartbeat=0.2,
                 heartbeat_timeout=1, **SMALL) for r in range(2)]
    try:
        x = np.ones(1000, dtype=np.float32)
        for y in run_ranks(2, lambda r: ws[r].allreduce(x)):
            assert np.array_equal(y, 2 * x)
        # Rank 0 alone: its op waits for rank 1 on both shards, then shard 1 goes away.
        fut = ws[0].allreduce_async(x)
        time.sleep(0.2)
        shards[1].close()
        t0 = time.monotonic()
        with pytest.raises(OmniReduceError) as info:
            fut.result(timeout=15)
        assert time.monotonic() - t0 < 10
        err = info.value
        assert f"shard 1 ({addresses[1]})" in str(err)
        assert type(err) is type(err.__cause__)
        # Rank 1's matching op: shard 0 completes it, shard 1 is unreachable, so it fails
        # within the worker's timeout, naming shard 1.
        t0 = time.monotonic()
        with pytest.raises(OmniReduceError, match=r"shard 1 \(") as info:
            ws[1].allreduce(x)
        assert time.monotonic() - t0 < 10
        assert ws[1].shards[0].stats.ops == 2  # shard 0's chunk was summed
    finally:
        for w in ws:
            w.close()


def test_set_timeout_reaches_every_shard_and_the_ops_in_flight(shards: list[Aggregator]) -> None:
    w = connect([a.address for a in shards[:2]], rank=0, world_size=2, job="shard-set-timeout", timeout=30, **SMALL)
    try:
        fut = w.allreduce_async(np.ones(1000, dtype=np.float32))  # rank 1 never comes
        w.set_timeout(0.5)
        t0 = time.monotonic()
        with pytest.raises(OmniReduceError, match=r"for 0.5 s"):
            fut.result(timeout=15)
        assert time.monotonic() - t0 < 10
        assert [s.timeout for s in w.shards] == [0.5, 0.5] and w.timeout == 0.5
        with pytest.raises(ConfigError, match="timeout"):
            w.set_timeout(float("inf"))
        assert w.timeout == 0.5
    finally:
        w.close()


@pytest.mark.slow
def test_ddp_hook_and_backend_through_shards(shards: list[Aggregator], tmp_path) -> None:
    torch = pytest.importorskip("torch")
    from tests.helpers import run_procs

    address = ",".join(a.address for a in shards[:2])
    for res in run_procs("ddp_case", 2, tmp_path, address, "buckets"):
        assert res["error"] is None and res["buckets"] > 4
        torch.testing.assert_close(res["got"], res["expected"])
    for res in run_procs("backend_case", 2, tmp_path, address):
        assert res["backend"] == "omnireduce"
        torch.testing.assert_close(res["all_reduce"], torch.arange(6, dtype=torch.float32) * 3)
        torch.testing.assert_close(res["got"], res["expected"])


def test_small_inplace_tensors_and_op_stats_through_shards(shards: list[Aggregator]) -> None:
    """A tensor with fewer blocks than shards leaves a shard an empty chunk, in place too;
    the sharded future carries the op's stats, as a plain Worker's does."""
    addrs = [a.address for a in shards[:2]]
    xs = [np.full(10, r + 1, np.float32) for r in range(2)]

    def rank(r: int) -> tuple[np.ndarray, Any]:
        with connect(addrs, rank=r, world_size=2, job="small-inplace", timeout=20) as w:
            y = xs[r].copy()
            fut = w.allreduce_async(y, inplace=True)
            assert fut.result() is y
            return y, fut.op_stats

    for y, stats in run_ranks(2, rank):
        np.testing.assert_array_equal(y, np.full(10, 3, np.float32))
        assert stats.path == "sparse" and stats.blocks_received == 1


def test_connect_makes_the_kind_of_worker_that_fits(shards: list[Aggregator], monkeypatch: pytest.MonkeyPatch) -> None:
    from worker import ColocatedWorker

    a = shards[0].address
    with connect(a, rank=0, world_size=1, timeout=20) as w:
        assert type(w) is Worker and isinstance(w, Allreducer)
    with pytest.raises(ConfigError, match="not both"):
        connect(a, exchange=lambda own: [own], rank=0, world_size=1)
    monkeypatch.delenv("OMNIREDUCE_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match="no aggregator address"):
        connect(rank=0, world_size=1)
    with connect(exchange=lambda own: [own], rank=0, world_size=1, timeout=20) as w:
        assert isinstance(w, ColocatedWorker) and isinstance(w, Allreducer)
        assert w.allreduce(np.arange(5, dtype=np.float32)).tolist() == [0, 1, 2, 3, 4]


def test_small_ops_take_the_shards_in_turn(shards: list[Aggregator]) -> None:
    """An op of b bytes goes to ceil(b / shard_bytes) shards, op n starting at shard n % S;
    a weighted op too (a rank's own weight must not change the shards it takes).
    Sums stay exact whatever the shards."""
    import torch

    from worker.rows import SparseRows

    addresses = [a.address for a in shards]
    world = 2
    # 400 bytes per shard: 100 float32 -> 1 shard, 250 -> 3 (capped at 3), 150 -> 2.
    lengths = [100, 100, 100, 100, 150, 150, 250, 100]
    rng = np.random.default_rng(5)
    inputs = [[sparse(rng, n, 0.5, 16, np.float32, normal=True) for n in lengths] for _ in range(world)]
    rows = [SparseRows(np.array([1, 4, 6], np.int64), rng.standard_normal((3, 8)).astype(np.float32), 12)
            for _ in range(world)]  # 12 x 8 float32 = 384 bytes: 1 shard
    coo = [torch.sparse_coo_tensor(torch.tensor([[0, 30 + r]]), torch.ones(2, 4), (40, 4)) for r in range(world)]

    def rank(r: int) -> tuple[list[Any], list[list[int]]]:
        with connect(addresses, rank=r, world_size=world, job="turns", timeout=20, block_size=16,
                     message_blocks=4, streams=2, shard_bytes=400) as w:
            out, ops = [], []
            for x in [*inputs[r], rows[r], coo[r]]:
                before = [s.stats.ops for s in w.shards]
                out.append(w.allreduce(x))
                ops.append([s.stats.ops - b for s, b in zip(w.shards, before, strict=True)])
                # The op's number is the sharded worker's, not a shard's count of its parts.
                assert w.stats.last is not None and w.stats.last.op == len(ops) - 1
            before = [s.stats.ops for s in w.shards]
            out.append(w.allreduce(inputs[r][0], weight=r + 1.0))
            ops.append([s.stats.ops - b for s, b in zip(w.shards, before, strict=True)])
            return out, ops

    got = run_ranks(world, rank)
    # 100, 100, 100, 100 -> one shard each, in turn; 150 -> two (ops 4 and 5: from shards
    # 1 and 2); 250 -> all three; then the 100 and the rows one each, the 640-byte COO
    # tensor two; the weighted op of 100 one, in turn.
    expected_ops = [[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 0, 0], [0, 1, 1], [1, 0, 1], [1, 1, 1],
                    [0, 1, 0], [0, 0, 1], [1, 1, 0], [0, 1, 0]]
    for r in range(world):
        out, ops = got[r]
        assert ops == expected_ops
        for i in range(len(lengths)):
            assert np.array_equal(out[i], inputs[0][i] + inputs[1][i])
        summed = out[len(lengths)]
        assert np.array_equal(summed.rows, rows[0].rows)
        assert np.array_equal(summed.values, rows[0].values + rows[1].values)
        dense = out[len(lengths) + 1].to_dense()
        assert torch.equal(dense, coo[0].to_dense() + coo[1].to_dense())
        w0, w1 = 1.0, 2.0
        np.testing.assert_allclose(out[-1], (w0 * inputs[0][0] + w1 * inputs[1][0]) / (w0 + w1), rtol=1e-6)


def test_a_weight_on_one_rank_only_fails_that_op_and_the_next_ops_pair_up(shards: list[Aggregator]) -> None:
    # A weighted op used to go to every shard while a plain one went to one shard in turn:
    # a weight (or compute_time) given on one rank only put the shards' op numbers out of
    # step, and later ops were summed with the wrong ones (silently) until one timed out.
    addresses = [a.address for a in shards[:2]]

    def rank(r: int) -> list[Any]:
        out: list[Any] = []
        with connect(addresses, rank=r, world_size=2, job="one-weight", timeout=10) as w:
            for i, options in enumerate([{"weight": 3.0} if r == 0 else {}, {"compute_time": 0.5} if r == 0 else {},
                                         {}, {}, {}]):
                try:
                    out.append(float(w.allreduce(np.full(100, (r + 1) * 10.0**i, np.float32), **options)[0]))
                except MismatchError:
                    out.append("mismatch")
        return out

    for got in run_ranks(2, rank):
        # The compute time is no part of the op's agreement: the second op sums as usual.
        assert got == ["mismatch", 30.0, 300.0, 3000.0, 30000.0], got


def test_shard_bytes_is_checked_and_read_from_the_environment(shards: list[Aggregator],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    addresses = [a.address for a in shards[:2]]
    with pytest.raises(ConfigError, match="shard_bytes"):
        ShardedWorker(addresses, rank=0, world_size=1, shard_bytes=-1)
    monkeypatch.setenv("OMNIREDUCE_SHARD_BYTES", "lots")
    with pytest.raises(ConfigError, match="OMNIREDUCE_SHARD_BYTES"):
        ShardedWorker(addresses, rank=0, world_size=1)
    monkeypatch.setenv("OMNIREDUCE_SHARD_BYTES", "0")
    with ShardedWorker(addresses, rank=0, world_size=1, job="env-bytes", timeout=20) as w:
        assert w.shard_bytes == 0
        w.allreduce(np.ones(4, np.float32))  # 16 bytes, yet every shard (0: no choice)
        assert [s.stats.ops for s in w.shards] == [1, 1]
    # The option means nothing to a plain worker, which takes it all the same.
    with connect(addresses[0], rank=0, world_size=1, job="one", timeout=20, shard_bytes=5) as w:
        assert type(w) is Worker


def test_a_sparse_tensor_takes_the_shards_its_last_union_needs(shards: list[Aggregator]) -> None:
    """The first op of a key counts its dense size; the next ones its last union's."""
    import torch

    addresses = [a.address for a in shards]
    world = 2
    x = [np.zeros(1600, np.float32) for _ in range(world)]
    x[0][0:16], x[1][32:48] = 1.0, 2.0  # 2 of 100 blocks: 128 bytes of a 6400-byte tensor
    # 400-row table of 4 float32 (6400 bytes): rows 3 and 7 (rank 0), 7 (rank 1): 32 bytes.
    coo = [torch.sparse_coo_tensor(torch.tensor([[3, 7] if r == 0 else [7]]), torch.ones(2 - r, 4), (400, 4))
           for r in range(world)]

    def rank(r: int) -> tuple[list[Any], list[list[int]]]:
        with connect(addresses, rank=r, world_size=world, job="unions", timeout=20, block_size=16,
                     message_blocks=4, streams=2, shard_bytes=400) as w:
            out, ops = [], []
            for t, kw in [(x[r], {"key": "x"}), (x[r], {"key": "x"}), (x[r], {"key": "other"}),
                          (x[r], {"key": "other"}), (coo[r], {"key": "coo"}), (coo[r], {"key": "coo"}),
                          (x[r], {}), (x[r], {})]:
                before = [s.stats.ops for s in w.shards]
                out.append(w.allreduce(t, **kw))
                ops.append([s.stats.ops - b for s, b in zip(w.shards, before, strict=True)])
            return out, ops

    got = run_ranks(world, rank)
    for r in range(world):
        out, ops = got[r]
        # Without a key, the dense size alone decides (ops of one size may be meant to overlap).
        assert [sum(o) for o in ops] == [3, 1, 3, 1, 3, 1, 3, 3]
        for y in out[:4] + out[6:]:
            assert np.array_equal(y, x[0] + x[1])
        for y in out[4:6]:
            assert torch.equal(y.to_dense(), coo[0].to_dense() + coo[1].to_dense())


def test_an_op_waits_for_the_last_of_its_key_to_choose_alike_on_every_rank(shards: list[Aggregator]) -> None:
    addresses = [a.address for a in shards]
    x = np.zeros(1600, np.float32)
    x[0:16] = 1.0

    def rank(r: int) -> list[int]:
        with connect(addresses, rank=r, world_size=2, job="in-flight-key", timeout=20, block_size=16,
                     message_blocks=4, streams=2, shard_bytes=400) as w:
            # Rank 1 is late: rank 0's second op is chosen while its first is still waiting for rank 1.
            if r == 1:
                time.sleep(0.5)
            first = w.allreduce_async(x, key="k")
            second = w.allreduce_async(x, key="k")  # waits for the first to learn its union
            assert first.done()
            for f in (first, second):
                assert np.array_equal(f.result(timeout=20), 2 * x)
            return [s.stats.ops for s in w.shards]

    # 3 shards for the first (6400 dense bytes), 1 for the second (a 64-byte union, op 1: shard 1).
    assert run_ranks(2, rank) == [[1, 2, 1], [1, 2, 1]]


def test_each_shard_cuts_eager_ops_in_its_share_of_the_pieces(shards: list[Aggregator]) -> None:
    from omnireduce.layout import EAGER_PIECES

    with connect([a.address for a in shards[:2]], rank=0, world_size=1, job="pieces", timeout=20, **SMALL) as w:
        assert w.settings.eager_pieces == EAGER_PIECES
        assert [s.settings.eager_pieces for s in w.shards] == [EAGER_PIECES // 2] * 2


def test_a_part_refused_by_one_shard_fails_the_op_on_every_rank_and_breaks_nothing(
    shards: list[Aggregator], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's second shard refuses its part after the first shard took its own: the op
    fails on both ranks at once (rank 1 names rank 0), and both workers go on, in step."""
    addresses = [a.address for a in shards[:2]]
    ws = [connect(addresses, rank=r, world_size=2, job="part-refused", timeout=30, **SMALL) for r in range(2)]
    try:
        real = ws[0].shards[1]._request
        calls = [0]

        def refuse_once(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == 1:
                raise ConfigError("injected refusal")
            return real(*args, **kwargs)

        monkeypatch.setattr(ws[0].shards[1], "_request", refuse_once)
        x = np.arange(1000, dtype=np.float32)

        def rank(r: int) -> tuple[float, type, np.ndarray]:
            t = time.monotonic()
            with pytest.raises(OmniReduceError) as info:
                ws[r].allreduce(x)
            took = time.monotonic() - t
            return took, type(info.value), ws[r].allreduce(x * (r + 1))

        (t0, e0, y0), (t1, e1, y1) = run_ranks(2, rank)
        assert e0 is ConfigError and e1 is PeerRefusedError and max(t0, t1) < 10
        np.testing.assert_array_equal(y0, 3 * x)
        np.testing.assert_array_equal(y1, 3 * x)
    finally:
        for w in ws:
            w.close()


def test_an_op_refused_before_its_split_takes_the_shards_the_others_take(shards: list[Aggregator]) -> None:
    """Refused up front (an ``out=`` of the wrong size on rank 0 only), the op still takes its
    number, at every shard, so every later op agrees."""
    addresses = [a.address for a in shards]
    x = np.arange(200, dtype=np.float32)  # 800 bytes: 2 shards of 400

    def rank(r: int) -> tuple[type, list[np.ndarray], list[int]]:
        with connect(addresses, rank=r, world_size=2, job="refused-up-front", timeout=30, block_size=16,
                     message_blocks=4, streams=2, shard_bytes=400) as w:
            bad = {"out": np.zeros(3, np.float32)} if r == 0 else {}
            with pytest.raises(OmniReduceError) as info:
                w.allreduce(x, **bad)
            after = [w.allreduce(x), w.allreduce(x[:50]), w.allreduce(x)]
            return type(info.value), after, [s.stats.ops for s in w.shards]

    (e0, after0, ops0), (e1, after1, ops1) = run_ranks(2, rank)
    assert e0 is ConfigError and e1 is PeerRefusedError
    for y in (after0, after1):
        for got, want in zip(y, [2 * x, 2 * x[:50], 2 * x], strict=True):
            np.testing.assert_array_equal(got, want)
    # The refused op took shards 0 and 1 on rank 1, then ops 1-3 take 1+2, 2, 0+1; the shards
    # count the ops that ran.
    assert ops0 == ops1 == [1, 2, 2]


@pytest.mark.parametrize("bad", ["out", "rows"])
def test_a_keyed_op_refused_on_one_rank_leaves_the_ranks_sizing_the_next_alike(shards: list[Aggregator],
                                                                              bad: str) -> None:
    """Ops of a key go to as many shards as the last one's union density says. After an op of
    the key refused on rank 0 only (an ``out=`` of the wrong size; ``rows=`` outside the tensor),
    both ranks size the next op of the key alike: the refusing rank forgets the key's history,
    as the other rank's failed op counts as density 1."""
    addresses = [a.address for a in shards[:2]]
    x = np.zeros((63, 16), np.float32)
    x[:2] = 1.0  # 2 of 63 rows: a union density that sends the next op to one shard

    def rank(r: int) -> tuple[str, np.ndarray, list[int]]:
        with connect(addresses, rank=r, world_size=2, job=f"keyed-refusal-{bad}", timeout=20, block_size=16,
                     message_blocks=4, streams=2, shard_bytes=2000) as w:
            good: dict[str, Any] = {"rows": [0, 1]} if bad == "rows" else {}
            w.allreduce(x, key="k", **good)
            spoiled = {"rows": [999]} if bad == "rows" else {"out": np.zeros(3, np.float32)}
            with pytest.raises(OmniReduceError) as info:
                w.allreduce(x, key="k", **(spoiled if r == 0 else good))
            y = w.allreduce(x, key="k", **good)
            return type(info.value).__name__, y, [s.stats.ops for s in w.shards]

    (e0, y0, ops0), (e1, y1, ops1) = run_ranks(2, rank)
    assert (e0, e1) == ("ConfigError", "PeerRefusedError")
    for y in (y0, y1):
        np.testing.assert_array_equal(y, 2 * x)
    assert ops0 == ops1


def test_a_keyed_op_whose_result_fails_to_convert_on_one_rank_leaves_the_next_sized_alike(
        shards: list[Aggregator]) -> None:
    """An op of a key that every shard completed, but whose result rank 0 alone fails to
    convert (a MemoryError, say), still records the union density there: both ranks send the
    key's next ops to the same shards, in the same turns."""
    addresses = [a.address for a in shards[:2]]
    x = np.zeros((63, 16), np.float32)
    x[:2] = 1.0

    def rank(r: int) -> tuple[list[str], list[int], int]:
        with connect(addresses, rank=r, world_size=2, job="keyed-conversion", timeout=20, block_size=16,
                     message_blocks=4, streams=2, shard_bytes=2000) as w:
            assert isinstance(w, ShardedWorker)
            real = w._split_host
            calls = [0]

            def split(*args: Any, **kwargs: Any) -> Any:
                chunks, options, finish = real(*args, **kwargs)
                calls[0] += 1
                if r == 0 and calls[0] == 2:
                    def failing(_results: Any) -> Any:
                        raise MemoryError("injected")
                    return chunks, options, failing
                return chunks, options, finish

            w._split_host = split  # type: ignore[method-assign]
            outcomes = []
            for _ in range(4):
                try:
                    np.testing.assert_array_equal(w.allreduce(x, key="k"), 2 * x)
                    outcomes.append("ok")
                except OmniReduceError as e:
                    outcomes.append(type(e).__name__)
            return outcomes, [s.stats.ops for s in w.shards], w._ops

    (out0, ops0, turn0), (out1, ops1, turn1) = run_ranks(2, rank)
    assert out0 == ["ok", "OpError", "ok", "ok"] and out1 == ["ok"] * 4
    assert ops0 == ops1 and turn0 == turn1


def test_a_keyed_ops_history_holds_neither_its_result_nor_every_key(shards: list[Aggregator],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker keeps each key's last op for its union density only: not its result (a second
    copy of every DDP bucket), and not every key ever used (the oldest are forgotten, alike on
    every rank)."""
    import gc
    import weakref

    from worker import sharded

    monkeypatch.setattr(sharded, "_KEYS_KEPT", 8)
    addresses = [a.address for a in shards[:2]]

    def rank(r: int) -> tuple[bool, int, list[int]]:
        with connect(addresses, rank=r, world_size=2, job="keyed-history", timeout=20, block_size=16,
                     shard_bytes=1) as w:
            result = w.allreduce(np.ones(1 << 16, np.float32), key="bucket0")
            ref = weakref.ref(result)
            del result
            gc.collect()
            for i in range(20):
                w.allreduce(np.ones(1 << 10, np.float32), key=("step", i))
            return ref() is None, len(w._last_of), [s.stats.ops for s in w.shards]

    (freed0, kept0, ops0), (freed1, kept1, ops1) = run_ranks(2, rank)
    assert freed0 and freed1
    assert kept0 == kept1 == 8 and ops0 == ops1


# Ranks that split an op differently: the op fails on every rank, and the next ones are right.


def test_ranks_splitting_an_op_differently_fail_it_and_stay_in_step(shards: list[Aggregator]) -> None:
    """Rank 0's tensor is one shard's worth, rank 1's three: their parts used to pair with
    other ops' parts at the shards from then on (later ops summed with other ops' data)."""
    addresses = [a.address for a in shards]
    rng = np.random.default_rng(9)
    good = [[rng.standard_normal(n).astype(np.float32) for n in (100, 250, 150, 100)] for _ in range(2)]

    def rank(r: int) -> tuple[type, list[np.ndarray]]:
        with connect(addresses, rank=r, world_size=2, job="split-apart", timeout=20, block_size=16,
                     message_blocks=4, streams=2, shard_bytes=400) as w:
            with pytest.raises(OmniReduceError) as info:
                w.allreduce(np.ones(100 if r == 0 else 250, np.float32))
            return type(info.value), [w.allreduce(x) for x in good[r]]

    t0 = time.monotonic()
    for error, out in run_ranks(2, rank):
        assert error is MismatchError
        for got, a, b in zip(out, *good, strict=True):
            np.testing.assert_array_equal(got, a + b)
    assert time.monotonic() - t0 < 15  # no op waited for its timeout


def test_ranks_listing_the_shards_in_other_orders_fail_every_op(shards: list[Aggregator]) -> None:
    """Each rank's part k went to its own shard k: parts cut from other places of the tensor
    were summed together, silently."""
    addresses = [a.address for a in shards[:2]]

    def rank(r: int) -> list[str]:
        order = addresses if r == 0 else addresses[::-1]
        with connect(order, rank=r, world_size=2, job="reordered", timeout=20, block_size=16,
                     message_blocks=4, streams=2, shard_bytes=0) as w:
            errors = []
            for _ in range(3):
                with pytest.raises(MismatchError) as info:
                    w.allreduce(np.arange(64, dtype=np.float32) * (r + 1))
                errors.append(str(info.value))
            return errors

    for errors in run_ranks(2, rank):
        assert all("workers disagree on the op: part: (" in e for e in errors), errors


def test_a_misspelt_option_fails_the_op_on_every_rank_and_keeps_them_in_step(shards: list[Aggregator]) -> None:
    addresses = [a.address for a in shards]
    x = np.arange(300, dtype=np.float32)

    def rank(r: int) -> tuple[type, np.ndarray]:
        with connect(addresses, rank=r, world_size=2, job="misspelt", timeout=20, block_size=16,
                     message_blocks=4, streams=2, shard_bytes=400) as w:
            options = {"wieght": 1.0} if r == 0 else {}
            with pytest.raises((TypeError, PeerRefusedError)) as info:
                w.allreduce(x, **options)
            return type(info.value), w.allreduce(x[:100])

    (e0, y0), (e1, y1) = run_ranks(2, rank)
    assert e0 is TypeError and e1 is PeerRefusedError
    np.testing.assert_array_equal(y0, 2 * x[:100])
    np.testing.assert_array_equal(y1, 2 * x[:100])
