"""allreduce(x, rows=...): dense tensors whose nonzero rows the caller gives (worker.knownrows)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from aggregator import Aggregator
from omnireduce import ConfigError, MismatchError, blocks
from tests.helpers import ThreadExchange, run_ranks
from worker import Worker, connect
from worker.colocated import ColocatedWorker
from worker.knownrows import known_rows
from worker.rows import SparseRows

OPTS = dict(message_blocks=4, streams=2, timeout=20)
WORLD = 3
NUM_ROWS = 40


def _inputs(seed: int, shape: tuple[int, ...], dtype: Any, integers: bool = True) -> tuple[list[Any], list[Any]]:
    """Per rank: a tensor zero outside its rows, and its rows as given (in any order, repeats; one rank none)."""
    rng = np.random.default_rng(seed)
    xs, given = [], []
    for r in range(WORLD):
        n = 0 if r == 2 else 12
        rows = rng.choice(shape[0], n, replace=False)
        x = np.zeros(shape, dtype)
        vals = rng.integers(-50, 50, (n, *shape[1:])) if integers else rng.standard_normal((n, *shape[1:]))
        x[rows] = vals.astype(dtype)
        # Unsorted, with a repeat and a listed row that holds zeros.
        spare = np.setdiff1d(np.arange(shape[0]), rows)[:1]
        given.append(np.concatenate([rows[::-1], rows[:2], spare]) if n else np.array([], np.int64))
        xs.append(x)
    return xs, given


def _topologies(aggregator: Aggregator, shards: list[Aggregator]) -> dict[str, Any]:
    ex = ThreadExchange(WORLD)
    addresses = [a.address for a in shards]
    return {
        "one_aggregator": lambda r: Worker(aggregator.address, rank=r, world_size=WORLD, job="one", **OPTS),
        "three_shards": lambda r: connect(addresses, rank=r, world_size=WORLD, job="three", shard_bytes=0, **OPTS),
        "colocated": lambda r: ColocatedWorker(ex(r), r, WORLD, job="coloc", close_timeout=5, shard_bytes=0, **OPTS),
    }


@pytest.mark.parametrize("topology", ["one_aggregator", "three_shards", "colocated"])
def test_sum_equals_the_dense_sum_in_every_form(aggregator: Aggregator, shards: list[Aggregator],
                                                topology: str) -> None:
    make = _topologies(aggregator, shards)[topology]
    f32, g32 = _inputs(1, (NUM_ROWS, 5), np.float32)
    i64, g64 = _inputs(2, (NUM_ROWS, 3), np.int64)
    bf, gbf = _inputs(3, (NUM_ROWS, 2, 3), np.float32)
    randn, grn = _inputs(4, (NUM_ROWS, 7), np.float32, integers=False)

    def rank(r: int) -> dict[str, Any]:
        with make(r) as w:
            res: dict[str, Any] = {"new": w.allreduce(f32[r], rows=g32[r])}
            x = f32[r].copy()
            res["inplace"] = (w.allreduce(x, rows=g32[r], inplace=True), x)
            out = np.zeros(f32[r].size, np.float32)
            res["out"] = (w.allreduce(f32[r], rows=torch.from_numpy(g32[r]), out=out), out)
            res["int64"] = w.allreduce(torch.from_numpy(i64[r]), rows=list(g64[r]))
            t = torch.from_numpy(bf[r]).to(torch.bfloat16)
            res["bf16_inplace"] = (w.allreduce(t, rows=gbf[r], inplace=True), t)
            res["randn"] = w.allreduce(randn[r], rows=grn[r])
            res["sent"] = w.stats.last.blocks_sent
            res["randn_dense"] = w.allreduce(randn[r])  # the mask pass's result, for comparison
            return res

    f32_sum = sum(f32)
    for r, res in enumerate(run_ranks(WORLD, rank)):
        assert isinstance(res["new"], np.ndarray) and res["new"].shape == (NUM_ROWS, 5)
        np.testing.assert_array_equal(res["new"], f32_sum)
        result, x = res["inplace"]
        assert result is x
        np.testing.assert_array_equal(x, f32_sum)
        result, out = res["out"]
        assert np.shares_memory(result, out) and result.shape == (NUM_ROWS, 5)
        np.testing.assert_array_equal(out.reshape(NUM_ROWS, 5), f32_sum)
        assert res["int64"].dtype == torch.int64
        np.testing.assert_array_equal(res["int64"].numpy(), sum(i64))
        result, t = res["bf16_inplace"]
        assert result is t and t.dtype == torch.bfloat16 and t.shape == (NUM_ROWS, 2, 3)
        # Small integers are exact in bfloat16, and so are their sums here.
        np.testing.assert_array_equal(t.float().numpy(), sum(bf))
        np.testing.assert_allclose(res["randn"], sum(randn), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(res["randn"], res["randn_dense"], rtol=1e-5, atol=1e-6)
        # Every row given is sent once, a listed row of zeros too.
        assert res["sent"] == len(np.unique(grn[r]))


def test_no_mask_pass_and_only_the_rows_are_read(aggregator: Aggregator,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def no_mask(*_: Any, **__: Any) -> Any:
        raise AssertionError("a mask pass on an op whose rows were given")

    monkeypatch.setattr(blocks, "block_mask", no_mask)
    xs = [np.zeros((10, 4), np.float32) for _ in range(2)]
    xs[0][[1, 3]] = 1.0
    xs[1][[3, 8]] = 2.0
    # A nonzero row the caller did not list is not read: it is left out of the sum.
    xs[0][7] = 100.0
    rows = [np.array([1, 3]), np.array([3, 8])]

    def rank(r: int) -> tuple[np.ndarray, np.ndarray, int]:
        with Worker(aggregator.address, rank=r, world_size=2, job="nomask", **OPTS) as w:
            new = w.allreduce(xs[r], rows=rows[r])
            x = xs[r].copy()
            w.allreduce(x, rows=rows[r], inplace=True)
            return new, x, w.stats.last.blocks_sent

    expected = np.zeros((10, 4), np.float32)
    expected[1], expected[3], expected[8] = 1.0, 3.0, 2.0
    (new0, in0, sent0), (new1, in1, sent1) = run_ranks(2, rank)
    np.testing.assert_array_equal(new0, expected)
    np.testing.assert_array_equal(new1, expected)
    np.testing.assert_array_equal(in1, expected)
    # In place, a row outside the union is not written: rank 0's unlisted row stays as it was.
    expected[7] = 100.0
    np.testing.assert_array_equal(in0, expected)
    assert sent0 == 2 and sent1 == 2


@pytest.mark.parametrize("sharded", [False, True], ids=["one_aggregator", "two_shards"])
def test_bad_rows_are_config_errors_on_every_rank(aggregator: Aggregator, shards: list[Aggregator],
                                                   sharded: bool) -> None:
    address = [a.address for a in shards[:2]] if sharded else aggregator.address
    x = np.zeros((6, 2), np.float32)
    x[2] = 1.0
    bad: list[tuple[Any, dict[str, Any], str]] = [
        (x, {"rows": [6]}, "row 6, outside the tensor's 6 rows"),
        (x, {"rows": [-1, 2]}, "row -1, outside"),
        # Named as given: the cast to int64 made it row -9223372036854775807.
        (x, {"rows": np.array([2**63 + 1, 2], np.uint64)}, "row 9223372036854775809, outside"),
        (x, {"rows": np.array([1.0, 2.0])}, "integer row indices"),
        (x, {"rows": np.array([[2]])}, "1-D array"),
        (np.array(3.0, np.float32), {"rows": [0]}, "at least one dimension"),
        (np.zeros((6, 0), np.float32), {"rows": [2]}, "rows of at least one element"),
        (torch.zeros(6, 2).to_sparse(), {"rows": [2]}, "a sparse tensor's rows are its indices"),
        (np.zeros((6, 4), np.float32)[:, ::2], {"rows": [2], "inplace": True}, "contiguous tensor"),
        (x, {"rows": [2], "out": np.zeros(5, np.float32)}, "out must be"),
        (x, {"rows": [2], "inplace": True, "out": np.zeros(12, np.float32)}, "inplace and out"),
        (x, {"rows": [2], "weight": 0}, "weight must be"),
        (x, {"rows": [2], "weight": 10**400}, "weight must be"),  # an int beyond any float: was OverflowError
    ]

    for res in _refused_then_summed(address, "bad", bad, x, {"rows": [2]}):
        np.testing.assert_array_equal(res, 2 * x)


def _refused_then_summed(address: Any, job: str, bad: list[tuple[Any, dict[str, Any], str]], x: Any,
                         options: dict[str, Any]) -> list[Any]:
    """Both ranks are refused each of ``bad`` (a ConfigError matching its text: every refusal
    takes its op number on both), then sum ``x``, which pairs up. The sums."""

    def rank(r: int) -> Any:
        with connect(address, rank=r, world_size=2, job=job, **OPTS) as w:
            for t, kwargs, match in bad:
                with pytest.raises(ConfigError, match=match):
                    w.allreduce(t, **kwargs)
            res = w.allreduce(x, **options)
            assert w.stats.ops == 1
            return res

    return run_ranks(2, rank)


@pytest.mark.parametrize("sharded", [False, True], ids=["one_aggregator", "two_shards"])
def test_rows_on_one_rank_only_fail_on_every_rank(aggregator: Aggregator, shards: list[Aggregator],
                                                  sharded: bool) -> None:
    address = [a.address for a in shards[:2]] if sharded else aggregator.address
    x = np.zeros((300, 4), np.float32)
    x[5] = 1.0

    def rank(r: int) -> np.ndarray:
        with connect(address, rank=r, world_size=2, job="half", shard_bytes=0, **OPTS) as w:
            with pytest.raises(MismatchError):
                w.allreduce(x, rows=[5]) if r == 0 else w.allreduce(x)
            # The ranks stay in step.
            return w.allreduce(x, rows=[5])

    for res in run_ranks(2, rank):
        np.testing.assert_array_equal(res, 2 * x)


def test_deal_gives_strided_views_of_the_tensor() -> None:
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    k = known_rows(x, [9, 0, 4, 5, 7], inplace=True)
    parts = k.deal(3)
    # Rows 0 and 9 to part 0 (its rows 0 and 3), 4 and 7 to part 1 (1, 2), 5 to part 2 (1).
    assert [p.rows.tolist() for p in parts] == [[0, 3], [1, 2], [1]]
    for j, p in enumerate(parts):
        assert np.shares_memory(p.source, x) and p.dest.ctypes.data == p.source.ctypes.data == x[j:].ctypes.data
        np.testing.assert_array_equal(p.source, x[j::3])
    assert k.deal(1) == [k]


@pytest.mark.parametrize("topology", ["one_aggregator", "three_shards", "colocated"])
def test_a_sparse_tensors_sum_comes_dense_on_request(aggregator: Aggregator, shards: list[Aggregator],
                                                     topology: str) -> None:
    make = _topologies(aggregator, shards)[topology]
    g = torch.Generator().manual_seed(0)

    def sparse(shape: tuple[int, ...], dims: int) -> torch.Tensor:
        dense = torch.randint(-5, 5, shape, generator=g) * (torch.rand(*shape[:dims], *[1] * (len(shape) - dims),
                                                                       generator=g) < 0.4)
        return dense.float().to_sparse(dims)

    mats = [sparse((NUM_ROWS, 3), 1) for _ in range(WORLD)]
    cubes = [sparse((4, 5, 2), 2) for _ in range(WORLD)]
    ref, ref3 = sum(t.to_dense() for t in mats), sum(t.to_dense() for t in cubes)

    def rank(r: int) -> tuple[Any, ...]:
        with make(r) as w:
            a = w.allreduce(mats[r], dense=True)
            b = w.allreduce(cubes[r], dense=True)
            out = np.zeros(NUM_ROWS * 3, np.float32)
            c = w.allreduce(mats[r], dense=True, out=out)
            d = w.allreduce(SparseRows.from_torch(mats[r]), dense=True)
            e = w.allreduce(mats[r].to(torch.bfloat16), dense=True)
            return a, b, c, out, d, e

    for a, b, c, out, d, e in run_ranks(WORLD, rank):
        assert a.layout == torch.strided and a.shape == (NUM_ROWS, 3) and torch.equal(a, ref)
        assert torch.equal(b, ref3)
        assert np.shares_memory(c.numpy(), out) and torch.equal(c, ref)
        assert isinstance(d, np.ndarray) and np.array_equal(d, ref.numpy())
        # Small integers are exact in bfloat16.
        assert e.dtype == torch.bfloat16 and torch.equal(e.float(), ref)


def test_dense_on_request_refuses_what_does_not_fit(aggregator: Aggregator) -> None:
    t = torch.zeros(6, 2)
    t[2] = 1.0
    s = t.to_sparse(1)
    bad: list[tuple[Any, dict[str, Any], str]] = [
        (t, {"dense": True}, "dense=True is for sparse tensors"),
        (s, {"dense": True, "inplace": True}, "neither rows= .* nor inplace"),
        (s, {"dense": True, "rows": [2]}, "neither rows="),
        (s, {"dense": True, "out": np.zeros(11, np.float32)}, "out must be a writeable flat float32 array of 12"),
    ]

    for res in _refused_then_summed(aggregator.address, "dense-bad", bad, s, {"dense": True}):
        assert torch.equal(res, 2 * t)
