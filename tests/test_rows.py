"""Row-sparse allreduce (``worker.rows``): SparseRows and sparse COO torch tensors, each row one block.

Expected results are computed independently of the code under test: NumPy dense
sums over the union of the ranks' rows, or torch's own ``(a + b).coalesce()``.
Values are small integers wherever a sum is compared exactly, so that every float
sum is exact whatever the order of its additions.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import numpy as np
import pytest
import torch

from aggregator import Aggregator
from omnireduce import ConfigError, MismatchError
from omnireduce.dtypes import DType
from tests.helpers import ThreadExchange, run_ranks
from worker import Worker, connect
from worker.colocated import ColocatedWorker
from worker.rows import RowPieces, ShardChunk, SparseRows, is_sparse_torch, rows_op_data
from worker.sharded import shard_bounds

pytestmark = pytest.mark.timeout(60)

# Few columns per message and few streams: a few dozen rows already take several rounds.
OPTS = dict(message_blocks=4, streams=2, timeout=20)
ROW_SHAPES = [(), (3,), (64,)]  # widths 1 (scalar rows), 3 and 64
FLOATS = [np.float32, np.float64, np.float16]
INTS = [np.int32, np.int64]


# Helpers.


def make_rows(rng: np.random.Generator, num_rows: int, rows: Any, row_shape: tuple[int, ...], dtype: Any,
              lo: int = -50, hi: int = 51) -> SparseRows:
    """SparseRows at ``rows`` (any order, no duplicates) with small integer values."""
    rows = np.sort(np.asarray(rows, dtype=np.int64))
    values = rng.integers(lo, hi, size=(len(rows), *row_shape)).astype(dtype)
    return SparseRows(rows, values, num_rows)


def random_rows(rng: np.random.Generator, num_rows: int, density: float) -> np.ndarray:
    return np.flatnonzero(rng.random(num_rows) < density)


def row_sets(rng: np.random.Generator, world: int, num_rows: int) -> dict[str, list[np.ndarray]]:
    """Each scenario's rows per rank."""
    perm = rng.permutation(num_rows)
    share = num_rows // (2 * world)
    overlap = [random_rows(rng, num_rows, 0.35) for _ in range(world)]
    return {
        "overlapping": overlap,
        "disjoint": [perm[r * share:(r + 1) * share] for r in range(world)],
        "one_empty": [*overlap[:-1], np.empty(0, np.int64)],
        "all_empty": [np.empty(0, np.int64) for _ in range(world)],
        # Every row, from one rank only; the others give the first and last rows.
        "full": [np.arange(num_rows), *([np.array([0, num_rows - 1])] * (world - 1))],
    }


def expected_sum(parts: list[SparseRows]) -> tuple[np.ndarray, np.ndarray]:
    """The union of the parts' rows and their sums (int64 wrapped to the type, or float64 rounded)."""
    p0 = parts[0]
    rows = functools.reduce(np.union1d, [p.rows for p in parts], np.empty(0, np.int64)).astype(np.int64)
    acc_type = np.int64 if p0.values.dtype.kind in "iu" else np.float64
    acc = np.zeros((p0.num_rows, *p0.row_shape), dtype=acc_type)
    for p in parts:
        acc[p.rows] += p.values.astype(acc_type)
    return rows, acc[rows].astype(p0.values.dtype)


def assert_rows(result: Any, like: SparseRows, rows: np.ndarray, values: np.ndarray) -> None:
    """``result`` is SparseRows of ``like``'s form holding exactly ``rows`` (increasing) with ``values``."""
    assert isinstance(result, SparseRows)
    assert result.num_rows == like.num_rows and result.dense_shape == like.dense_shape
    assert result.dtype == like.dtype and result.values.dtype == like.values.dtype
    assert result.row_shape == like.row_shape
    assert result.rows.dtype == np.int64
    assert np.all(np.diff(result.rows) > 0), "rows not strictly increasing"
    np.testing.assert_array_equal(result.rows, rows)
    assert result.values.shape == (len(rows), *like.row_shape)
    np.testing.assert_array_equal(result.values, values)


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def torch_sum(ts: list[torch.Tensor]) -> torch.Tensor:
    return functools.reduce(operator.add, ts).coalesce()


def assert_torch_sum(result: Any, inputs: list[torch.Tensor], exact: bool) -> None:
    """``result`` equals torch's coalesced sum of ``inputs``: indices exactly, values exactly or allclose."""
    like = inputs[0]
    assert isinstance(result, torch.Tensor) and result.layout == torch.sparse_coo
    assert result.is_coalesced()
    assert result.shape == like.shape and result.dtype == like.dtype
    assert result.sparse_dim() == like.sparse_dim() and result.dense_dim() == like.dense_dim()
    if like.dtype in (torch.bfloat16, torch.float16):
        # Summed in float32 (as the aggregator does; torch has no sparse float16 sum on the CPU),
        # rounded once to the 16-bit type.
        f = torch_sum([t.float() for t in inputs])
        expected = torch.sparse_coo_tensor(f.indices(), f.values().to(like.dtype), f.shape).coalesce()
    else:
        expected = torch_sum(inputs)
    assert torch.equal(result.indices(), expected.indices())
    if exact:
        assert torch.equal(result.values(), expected.values())
    else:
        torch.testing.assert_close(result.values(), expected.values(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result.to_dense(), expected.to_dense(), rtol=1e-5, atol=1e-6)


@pytest.fixture
def two_shards(shards: list[Aggregator]) -> list[str]:
    return [a.address for a in shards[:2]]


# SparseRows itself.


def _rows(*r: int) -> np.ndarray:
    return np.array(r, dtype=np.int64)


F3 = np.ones((3, 3), np.float32)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: SparseRows(_rows(0, 5, 2), F3, 10), "strictly increasing"),
        (lambda: SparseRows(_rows(1, 4, 4), F3, 10), "strictly increasing"),
        (lambda: SparseRows(_rows(1, 4, 10), F3, 10), r"must lie in \[0, 10\)"),
        (lambda: SparseRows(_rows(-1, 4, 9), F3, 10), r"must lie in \[0, 10\)"),
        (lambda: SparseRows(_rows(1), np.ones((1, 3), np.float32), 0), r"must lie in \[0, 0\)"),
        (lambda: SparseRows(np.array([1, 2**63 + 1], np.uint64), F3[:2], 10), r"must lie in \[0, 10\)"),
        (lambda: SparseRows(_rows(1, 4), F3, 10), "values must be an array of 2 rows"),
        (lambda: SparseRows(_rows(1, 4, 6), F3[:2], 10), "values must be an array of 3 rows"),
        (lambda: SparseRows(_rows(1, 4, 6), F3.tolist(), 10), "values must be an array of 3 rows"),
        (lambda: SparseRows(_rows(), np.float32(1.0), 10), "values must be an array"),
        (lambda: SparseRows(np.array([0.0, 1.0]), F3[:2], 10), "1-D integer array"),
        (lambda: SparseRows([0, 1], F3[:2], 10), "1-D integer array"),
        (lambda: SparseRows(_rows(0, 1).reshape(1, 2), F3[:2], 10), "1-D integer array"),
        (lambda: SparseRows(_rows(0, 1), F3[:2], -1), "num_rows must be a non-negative integer"),
        (lambda: SparseRows(_rows(0, 1), F3[:2], 10.0), "num_rows must be a non-negative integer"),
        (lambda: SparseRows(_rows(0, 1), F3[:2], True), "num_rows must be a non-negative integer"),
        (lambda: SparseRows(_rows(0, 1), F3[:2].astype(np.complex64), 10), "dtype complex64"),
        (lambda: SparseRows(_rows(0, 1), F3[:2].astype(np.uint16), 10), "dtype uint16"),
        (lambda: SparseRows(_rows(0, 1), F3[:2].astype(bool), 10), "dtype bool"),
        (lambda: SparseRows(_rows(0, 1), F3[:2].astype(">f4"), 10), "dtype >f4"),
        (lambda: SparseRows(_rows(0, 1), np.ones((2, 0), np.float32), 10), "empty rows"),
        (lambda: SparseRows(_rows(0, 1), np.ones((2, 3, 0), np.float32), 10), "empty rows"),
        (lambda: SparseRows(_rows(), np.ones((0, 0), np.float32), 0), "empty rows"),
        (lambda: SparseRows(_rows(0, 1), F3[:2], 10, shape=(10, 4)), r"shape \(10, 4\) does not hold 10 rows of 3"),
        (lambda: SparseRows(_rows(0, 1), F3[:2], 10, shape=(11, 3)), "does not hold 10 rows of 3"),
        (lambda: SparseRows(_rows(0, 1), F3[:2], 10, shape=(2, 5, 4)), "does not hold 10 rows of 3"),
        (lambda: SparseRows(_rows(0, 1), F3[:2], 10, dtype=DType.BFLOAT16), "must be stored as uint16"),
        (lambda: SparseRows(_rows(0, 1), F3[:2], 10, dtype=DType.FLOAT64), "must be stored as float64"),
    ],
    ids=[
        "unsorted", "duplicate", "row_eq_num_rows", "negative", "row_in_zero_rows", "uint64_huge",
        "values_too_many", "values_too_few", "values_list", "values_0d", "rows_float", "rows_list", "rows_2d",
        "num_rows_negative", "num_rows_float", "num_rows_bool", "complex", "uint16_without_dtype", "bool",
        "big_endian", "zero_width", "zero_width_2d", "zero_width_no_rows", "shape_width", "shape_rows",
        "shape_3d", "bf16_as_float32", "float64_as_float32",
    ],
)
def test_invalid_sparse_rows_are_config_errors(make: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make()


def test_valid_forms_are_normalised() -> None:
    # Any integer index type becomes int64; scalar rows (1-D values) have width 1.
    s = SparseRows(np.array([1, 3], np.uint8), np.array([2.0, 5.0], np.float32), 4)
    assert s.rows.dtype == np.int64 and s.row_shape == () and s.row_width == 1
    assert s.dense_shape == (4,) and s.dtype is DType.FLOAT32
    np.testing.assert_array_equal(s.to_dense(), [0, 2, 0, 5])
    # Several sparse dimensions are kept in shape; the rows are their flattened index.
    m = SparseRows(_rows(1, 5), np.array([[1, 2], [3, 4]], np.int32), 6, shape=(2, 3, 2))
    assert m.dtype is DType.INT32 and m.row_width == 2 and m.dense_shape == (2, 3, 2)
    dense = np.zeros((6, 2), np.int32)
    dense[[1, 5]] = [[1, 2], [3, 4]]
    np.testing.assert_array_equal(m.to_dense(), dense.reshape(2, 3, 2))
    # No rows, and no rows at all.
    e = SparseRows(_rows(), np.zeros((0, 4), np.float64), 7)
    np.testing.assert_array_equal(e.to_dense(), np.zeros((7, 4)))
    z = SparseRows(_rows(), np.zeros((0, 4), np.float64), 0)
    assert z.to_dense().shape == (0, 4)
    # bfloat16 travels as its uint16 bits, which needs the dtype.
    b = SparseRows(_rows(2), np.array([[0x3F80]], np.uint16), 3, dtype=DType.BFLOAT16)
    assert b.dtype is DType.BFLOAT16
    assert torch.equal(b.to_torch(1).to_dense(), torch.tensor([[0.0], [0.0], [1.0]], dtype=torch.bfloat16))
    for dt, code in [(np.int8, DType.INT8), (np.uint8, DType.UINT8), (np.int16, DType.INT16),
                     (np.int64, DType.INT64), (np.float16, DType.FLOAT16), (np.float64, DType.FLOAT64)]:
        assert SparseRows(_rows(0), np.ones((1, 2), dt), 1).dtype is code


@pytest.mark.parametrize("row_shape", [(), (3,), (2, 5)])
def test_to_dense_slice_and_join_round_trip(row_shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(11)
    num_rows = 23
    s = make_rows(rng, num_rows, random_rows(rng, num_rows, 0.4), row_shape, np.float32)
    dense = np.zeros((num_rows, *row_shape), np.float32)
    for r, v in zip(s.rows, s.values, strict=True):
        dense[r] = v
    np.testing.assert_array_equal(s.to_dense(), dense)
    for shards in (1, 2, 3, 5, 30):  # 30: more shards than rows, some chunks empty
        bounds = shard_bounds(num_rows, 1, shards)
        parts = [s.slice_rows(lo, hi) for lo, hi in bounds]
        for (lo, hi), p in zip(bounds, parts, strict=True):
            assert p.num_rows == hi - lo and p.row_shape == s.row_shape and p.dtype == s.dtype
            np.testing.assert_array_equal(p.to_dense(), dense[lo:hi])
        joined = SparseRows.join(parts, [lo for lo, _ in bounds], num_rows, None)
        np.testing.assert_array_equal(joined.rows, s.rows)
        np.testing.assert_array_equal(joined.values, s.values)
        assert joined.dense_shape == s.dense_shape and joined.dtype == s.dtype
    # A slice between stored rows is empty but keeps the row shape.
    gap = int(np.setdiff1d(np.arange(num_rows), s.rows)[0])
    for lo, hi in ((-1, 3), (3, 2), (0, s.num_rows + 1)):
        with pytest.raises(ConfigError, match="not a range"):
            s.slice_rows(lo, hi)
    empty = s.slice_rows(gap, gap + 1)
    assert len(empty.rows) == 0 and empty.values.shape == (0, *row_shape) and empty.num_rows == 1
    # join keeps a multi-dimensional shape.
    m = SparseRows(_rows(0, 3, 5), np.arange(3, dtype=np.int64), 6, shape=(2, 3))
    parts = [m.slice_rows(0, 3), m.slice_rows(3, 6)]
    j = SparseRows.join(parts, [0, 3], 6, (2, 3))
    assert j.dense_shape == (2, 3)
    np.testing.assert_array_equal(j.to_dense(), m.to_dense())


@pytest.mark.parametrize("row_shape", [(), (3,), (2, 5)])
def test_deal_and_undeal_round_trip(row_shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(12)
    num_rows = 23
    s = make_rows(rng, num_rows, random_rows(rng, num_rows, 0.5), row_shape, np.float32)
    dense = s.to_dense()
    for shards in (1, 2, 3, 5, 30):  # 30: more shards than rows, some parts empty
        parts = s.deal(shards)
        assert len(parts) == shards
        for k, p in enumerate(parts):
            # Part k holds rows k, k + shards, ... renumbered 0, 1, ...
            assert p.num_rows == len(range(k, num_rows, shards)) and p.row_shape == s.row_shape
            assert p.dtype == s.dtype and bool((np.diff(p.rows) > 0).all())
            np.testing.assert_array_equal(p.to_dense(), dense[k::shards])
            # Built unchecked: the checks would pass them all the same.
            SparseRows(p.rows, p.values, p.num_rows, dtype=p.dtype)
        chunks = s.deal(shards, ShardChunk)
        assert all(type(c) is ShardChunk for c in chunks)
        for c, p in zip(chunks, parts, strict=True):
            np.testing.assert_array_equal(c.rows, p.rows)
            np.testing.assert_array_equal(c.values, p.values)
            assert c.num_rows == p.num_rows and c.dtype == p.dtype
        back = SparseRows.undeal(parts, num_rows, (num_rows, *row_shape))
        np.testing.assert_array_equal(back.rows, s.rows)
        np.testing.assert_array_equal(back.values, s.values)
        assert back.dense_shape == s.dense_shape and back.dtype == s.dtype


def test_row_pieces_join_every_shard_in_one_pass() -> None:
    rng = np.random.default_rng(13)
    num_rows, shards = 40, 3
    s = make_rows(rng, num_rows, random_rows(rng, num_rows, 0.6), (2,), np.float32)
    results = []
    for part in s.deal(shards):
        chunk = ShardChunk(part.rows, part.values, part.num_rows, dtype=part.dtype)
        # As a shard's op hands them back: several pieces, out of order (a rank's own rows
        # land among the others'), each ascending.
        cut = len(part.rows) // 2
        pieces = [(part.rows[cut:], part.values[cut:].reshape(-1)), (part.rows[:cut], part.values[:cut].reshape(-1))]
        results.append(RowPieces(pieces, chunk))
    joined = RowPieces.join(results, num_rows, None)
    np.testing.assert_array_equal(joined.rows, s.rows)
    np.testing.assert_array_equal(joined.values, s.values)
    # No rows anywhere: an empty tensor of the right row shape.
    empty = RowPieces.join([RowPieces([], ShardChunk(_rows(), np.empty((0, 2), np.float32), 14)) for _ in range(3)],
                           num_rows, None)
    assert len(empty.rows) == 0 and empty.values.shape == (0, 2) and empty.num_rows == num_rows


def test_deal_spreads_a_table_whose_rows_come_first() -> None:
    # The first 1,000 rows of a million (a vocabulary sorted by frequency): ranges would
    # give them all to shard 0.
    s = SparseRows(np.arange(1000, dtype=np.int64), np.ones((1000, 2), np.float32), 1_000_000)
    assert [len(p.rows) for p in s.deal(4)] == [250, 250, 250, 250]


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.tensor([0.0, 2.0, 0.0, -3.0]).to_sparse(),  # a sparse vector
        lambda: torch.tensor([[0, 2, 0], [0, 0, 0], [1, 0, 7]], dtype=torch.int64).to_sparse(),  # sparse_dim 2
        lambda: torch.arange(24.0).reshape(4, 6).mul(torch.tensor([1.0, 0, 0, 1]).view(4, 1)).to_sparse(1),
        lambda: torch.arange(60.0).reshape(3, 4, 5).to_sparse(2),  # two sparse dims, a dense one
        lambda: torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to_sparse(1),
        lambda: torch.sparse_coo_tensor(torch.tensor([[3, 1, 3]]), torch.tensor([[1.0, 2], [3, 4], [5, 6]]), (5, 2)),
        lambda: torch.sparse_coo_tensor(size=(5, 3)),
        lambda: torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.long), torch.empty(0, 4, dtype=torch.float16),
                                        (6, 4)),
    ],
    ids=["vector", "matrix_int64", "rows_sd1", "hybrid_sd2", "bf16", "uncoalesced", "empty_sd2", "empty_sd1_f16"],
)
def test_torch_round_trip(make: Any) -> None:
    t = make()
    s = SparseRows.from_torch(t)
    assert is_sparse_torch(t) and not is_sparse_torch(t.to_dense())
    c = t.coalesce()
    assert s.dense_shape == tuple(t.shape) and s.num_rows == int(np.prod(t.shape[: t.sparse_dim()]))
    assert len(s.rows) == c._nnz() and np.all(np.diff(s.rows) > 0)
    back = s.to_torch(t.sparse_dim())
    assert back.is_coalesced() and back.dtype == t.dtype and back.shape == t.shape
    assert torch.equal(back.indices(), c.indices()) and torch.equal(back.values(), c.values())
    data = rows_op_data(t)
    assert data.block_size == s.row_width and data.length == int(np.prod(t.shape))
    np.testing.assert_array_equal(np.flatnonzero(data.mask), s.rows)


def test_torch_tensors_that_cannot_be_rows() -> None:
    with pytest.raises(ConfigError, match="torch.bool"):
        SparseRows.from_torch(torch.tensor([0, 1, 0]).bool().to_sparse())
    with pytest.raises(ConfigError, match="complex64"):
        SparseRows.from_torch(torch.tensor([0, 1, 0], dtype=torch.complex64).to_sparse())
    with pytest.raises(ConfigError, match="empty rows"):
        SparseRows.from_torch(torch.sparse_coo_tensor(torch.tensor([[1]]), torch.empty(1, 0), (5, 0)))


# Worker.allreduce of SparseRows.


@pytest.mark.parametrize("world", [2, 3])
def test_rows_sum_over_workers(aggregator: Aggregator, world: int) -> None:
    rng = np.random.default_rng(100 + world)
    num_rows = 37
    cases: list[tuple[str, list[SparseRows]]] = []
    for dtype in [*FLOATS, *INTS]:
        for row_shape in ROW_SHAPES:
            for name, sets in row_sets(rng, world, num_rows).items():
                inputs = [make_rows(rng, num_rows, sets[r], row_shape, dtype) for r in range(world)]
                cases.append((f"{np.dtype(dtype).name}/{row_shape}/{name}", inputs))
    # A 2-D row shape (4 x 16 = 64 per row), and int64 sums beyond 2**53.
    cases.append(("2d_rows", [make_rows(rng, 20, random_rows(rng, 20, 0.5), (4, 16), np.float32)
                              for _ in range(world)]))
    big = [SparseRows(_rows(0, 3), np.full((2, 3), 2**60 + r, np.int64), 5) for r in range(world)]
    cases.append(("int64_big", big))

    def rank(r: int) -> list[Any]:
        with Worker(aggregator.address, rank=r, world_size=world, job=f"rows{world}", **OPTS) as w:
            futures = [w.allreduce_async(inputs[r]) for _, inputs in cases]
            return [f.result(timeout=30) for f in futures]

    results = run_ranks(world, rank)
    for k, (name, inputs) in enumerate(cases):
        rows, values = expected_sum(inputs)
        for r in range(world):
            try:
                assert_rows(results[r][k], inputs[r], rows, values)
            except AssertionError as e:
                raise AssertionError(f"case {name}, rank {r}: {e}") from None
            assert bits(results[r][k].values) == bits(results[0][k].values)
    # The int64 sums are exact, beyond float64's integers.
    assert int(results[0][-1].values[0, 0]) == sum(2**60 + r for r in range(world))


def test_zero_rows_stay_integers_wrap_and_bfloat16_rounds_to_even(aggregator: Aggregator) -> None:
    a = SparseRows(_rows(1, 4, 6), np.array([[0, 0], [5, -7], [1, 1]], np.float32), 8)  # row 1 is all zeros
    b = SparseRows(_rows(4, 7), np.array([[-5, 7], [2, 3]], np.float32), 8)  # row 4 cancels
    i8 = [SparseRows(_rows(0, 2), np.array([[100], [-100]], np.int8), 3),
          SparseRows(_rows(0), np.array([[100]], np.int8), 3)]
    u8 = [SparseRows(_rows(1), np.array([200], np.uint8), 2), SparseRows(_rows(1), np.array([100], np.uint8), 2)]
    i16 = [SparseRows(_rows(0), np.array([[30000, -30000]], np.int16), 1)] * 2
    # bfloat16 as its bits: 1 + 2 = 3; 1 + 2**-8 and (1 + 2**-7) + 2**-8 are ties, rounded to even.
    bf = [SparseRows(_rows(0, 1, 2), np.array([0x3F80, 0x3F80, 0x3F81], np.uint16), 4, dtype=DType.BFLOAT16),
          SparseRows(_rows(0, 1, 2), np.array([0x4000, 0x3B80, 0x3B80], np.uint16), 4, dtype=DType.BFLOAT16)]

    def rank(r: int) -> list[Any]:
        with Worker(aggregator.address, rank=r, world_size=2, job="zeros", **OPTS) as w:
            return [w.allreduce(x) for x in ([a, b][r], i8[r], u8[r], i16[r], bf[r])]

    for res in run_ranks(2, rank):
        assert_rows(res[0], a, _rows(1, 4, 6, 7), np.array([[0, 0], [0, 0], [1, 1], [2, 3]], np.float32))
        assert_rows(res[1], i8[0], _rows(0, 2), np.array([[-56], [-100]], np.int8))  # 200 wraps to -56
        assert_rows(res[2], u8[0], _rows(1), np.array([44], np.uint8))  # 300 wraps to 44
        assert_rows(res[3], i16[0], _rows(0), np.array([[-5536, 5536]], np.int16))
        assert_rows(res[4], bf[0], _rows(0, 1, 2), np.array([0x4040, 0x3F80, 0x3F82], np.uint16))


def test_input_rows_are_not_modified_and_results_are_writeable(aggregator: Aggregator) -> None:
    rng = np.random.default_rng(5)
    # Non-contiguous values (every other column of a wider array) are read correctly.
    wide = [rng.integers(-9, 10, size=(6, 8)).astype(np.float32) for _ in range(2)]
    inputs = [SparseRows(_rows(0, 2, 3, 5, 8, 9), wide[r][:, ::2], 10) for r in range(2)]
    saved = [(x.rows.copy(), x.values.copy()) for x in inputs]

    def rank(r: int) -> SparseRows:
        with Worker(aggregator.address, rank=r, world_size=2, job="nc", **OPTS) as w:
            return w.allreduce(inputs[r])

    rows, values = expected_sum(inputs)
    for res in run_ranks(2, rank):
        assert_rows(res, inputs[0], rows, values)
        assert res.values.flags.writeable
        res.values[...] = 0  # the result is the caller's
    for x, (r0, v0) in zip(inputs, saved, strict=True):
        np.testing.assert_array_equal(x.rows, r0)
        np.testing.assert_array_equal(x.values, v0)


# Sparse COO torch tensors.


def _embedding_grad(seed: int, num: int, dim: int, lookups: int) -> torch.Tensor:
    """nn.Embedding(sparse=True)'s gradient: uncoalesced, duplicate indices, integer-valued."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.nn.Embedding(num, dim, sparse=True)
    idx = torch.randint(0, num, (lookups,), generator=g)
    coef = torch.randint(-5, 6, (lookups, dim), generator=g).float()
    (emb(idx) * coef).sum().backward()
    grad = emb.weight.grad
    assert grad.is_sparse and (lookups < 2 or not grad.is_coalesced())
    return grad


def _torch_cases(world: int) -> list[tuple[str, list[torch.Tensor], bool]]:
    """(name, one tensor per rank, whether values compare exactly)."""
    g = torch.Generator().manual_seed(world)

    def ints(*shape: int, dtype: Any = torch.float32) -> torch.Tensor:
        return torch.randint(-20, 21, shape, generator=g).to(dtype)

    def sparse_matrix(dtype: Any) -> torch.Tensor:
        keep = torch.rand(6, 7, generator=g) < 0.3
        return (ints(6, 7, dtype=dtype) * keep).to_sparse()

    def bf16() -> torch.Tensor:
        mag = torch.rand(9, 5, generator=g) * 1.5 + 0.5  # exponents close: float32 sums are exact
        sign = torch.where(torch.rand(9, 5, generator=g) < 0.5, -1.0, 1.0)
        keep = (torch.rand(9, 1, generator=g) < 0.5).float()
        return (mag * sign * keep).to(torch.bfloat16).to_sparse(1)

    cases: list[tuple[str, list[torch.Tensor], bool]] = [
        ("embedding_grad", [_embedding_grad(10 * world + r, 20, 8, 12) for r in range(world)], True),
        ("uncoalesced_f64", [torch.sparse_coo_tensor(torch.tensor([[3, 1, 3, 7 - r]]), ints(4, 2, dtype=torch.float64),
                                                     (9, 2)) for r in range(world)], True),
        ("matrix_f32", [sparse_matrix(torch.float32) for _ in range(world)], True),
        ("matrix_i64", [sparse_matrix(torch.int64) for _ in range(world)], True),
        ("matrix_i32", [sparse_matrix(torch.int32) for _ in range(world)], True),
        ("vector_f16", [(ints(30, dtype=torch.float16) * (torch.rand(30, generator=g) < 0.3)).to_sparse()
                        for _ in range(world)], True),
        ("hybrid_sd2", [(ints(3, 4, 5) * (torch.rand(3, 4, 1, generator=g) < 0.4)).to_sparse(2)
                        for _ in range(world)], True),
        ("bf16", [bf16() for _ in range(world)], True),
        ("randn_f32", [(torch.randn(15, 3, generator=g) * (torch.rand(15, 1, generator=g) < 0.5)).to_sparse(1)
                       for _ in range(world)], False),
        ("one_rank_empty", [*(sparse_matrix(torch.float32) for _ in range(world - 1)),
                            torch.sparse_coo_tensor(size=(6, 7))], True),
        ("empty_sd2", [torch.sparse_coo_tensor(size=(5, 3)) for _ in range(world)], True),
        ("empty_sd1", [torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.long), torch.empty(0, 4), (6, 4))
                       for _ in range(world)], True),
        ("empty_embedding_grad", [_embedding_grad(r, 20, 8, 0) for r in range(world)], True),
    ]
    return cases


@pytest.mark.parametrize("world", [2, 3])
def test_sparse_torch_sum_over_workers(aggregator: Aggregator, world: int) -> None:
    cases = _torch_cases(world)
    saved = [[t.clone() for t in ts] for _, ts, _ in cases]

    def rank(r: int) -> list[Any]:
        with Worker(aggregator.address, rank=r, world_size=world, job=f"torch{world}", **OPTS) as w:
            out = []
            for _, ts, _ in cases:
                out.append(w.allreduce(ts[r]))
                assert w.stats.last.blocks_sent == ts[r].coalesce()._nnz()
            return out

    results = run_ranks(world, rank)
    for k, (name, ts, exact) in enumerate(cases):
        for r in range(world):
            try:
                assert_torch_sum(results[r][k], ts, exact)
            except AssertionError as e:
                raise AssertionError(f"case {name}, rank {r}: {e}") from None
            assert torch.equal(results[r][k].values(), results[0][k].values())
        for t, s in zip(ts, saved[k], strict=True):  # the inputs are left as they were
            assert torch.equal(t.coalesce().indices(), s.coalesce().indices())
            assert torch.equal(t.coalesce().values(), s.coalesce().values())


# Refusals: each takes its op number on every rank (the others' op fails), so the ranks stay in step.


@pytest.mark.parametrize("sharded", [False, True], ids=["one_aggregator", "two_shards"])
def test_inplace_and_out_are_refused_on_every_rank_and_keep_them_in_step(aggregator: Aggregator,
                                                                         two_shards: list[str],
                                                                         sharded: bool) -> None:
    x = [SparseRows(_rows(1, 3), np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), 4),
         SparseRows(_rows(3), np.array([[10.0, 20.0]], np.float32), 4)]
    t = torch.tensor([[0.0, 1.0], [0.0, 0.0]]).to_sparse()
    ints = SparseRows(_rows(0), np.array([[1, 2]], np.int64), 4)
    address = two_shards if sharded else aggregator.address

    def rank(r: int) -> tuple[SparseRows, int, int]:
        with connect(address, rank=r, world_size=2, job="refused", **OPTS) as w:
            with pytest.raises(ConfigError, match="inplace and out are not supported"):
                w.allreduce(x[0], inplace=True)
            with pytest.raises(ConfigError, match="inplace and out are not supported"):
                w.allreduce_async(x[0], out=np.zeros(8, np.float32))
            with pytest.raises(ConfigError, match="inplace and out are not supported"):
                w.allreduce(t, inplace=True)
            with pytest.raises(ConfigError, match="inplace and out are not supported"):
                w.allreduce(t, out=np.zeros(4, np.float32))
            with pytest.raises(ConfigError, match="weight is not supported for int64"):
                w.allreduce(ints, weight=2)
            with pytest.raises(ConfigError, match="weight must be"):
                w.allreduce(x[0], weight=0)
            res = w.allreduce(x[r])
            return res, w.stats.ops, w.stats.last.op

    for res, ops, op in run_ranks(2, rank):
        assert_rows(res, x[0], _rows(1, 3), np.array([[1, 2], [13, 24]], np.float32))
        # Only the sum ran; it took the number after the six refused ops' (on a sharded
        # worker, op numbers in its stats count its ops, refused or not).
        assert ops == 1 and op == 6


# Sharded and co-located workers.


def _topology_cases(world: int) -> list[tuple[str, list[Any], bool]]:
    """(name, one input per rank, whether weighted by rank + 1): rows on every shard of 1, 2 and
    3 (rows are dealt round-robin), ranks sharing some of them."""
    rng = np.random.default_rng(7)
    cases: list[tuple[str, list[Any], bool]] = []
    # 10 rows: both residues of 2 and all three of 3, on every rank, with rows of their own.
    edges = [[0, 4, 5, 9], [2, 3, 5, 6], [5, 6, 9]]
    for dtype in (np.float32, np.int64, np.float16):
        cases.append((f"edges_{np.dtype(dtype).name}",
                      [make_rows(rng, 10, edges[r % 3], (3,), dtype) for r in range(world)], False))
    # Fewer rows than shards (some chunks empty), and no rows at all.
    cases.append(("one_row", [make_rows(rng, 1, [0] if r != 1 else [], (2,), np.float32) for r in range(world)], False))
    cases.append(("two_rows", [make_rows(rng, 2, [r % 2], (), np.float64) for r in range(world)], False))
    cases.append(("zero_rows", [make_rows(rng, 0, [], (4,), np.float32) for r in range(world)], False))
    cases.append(("all_empty", [make_rows(rng, 30, [], (64,), np.float32) for r in range(world)], False))
    # Random non-integer values: their float sums depend on the order of additions.
    randn = []
    for _ in range(world):
        rows = random_rows(rng, 50, 0.3)
        randn.append(SparseRows(rows, rng.standard_normal((len(rows), 5)).astype(np.float32), 50))
    cases.append(("randn", randn, False))
    cases.append(("weighted", randn, True))
    # Sparse torch tensors: a 4 x 5 matrix (20 flat rows, dealt to two or three shards), and bf16
    # embedding rows.
    boundary = [[(1, 4), (2, 0), (3, 4)], [(1, 0), (1, 1), (2, 0)], [(0, 0), (2, 2), (2, 3)]]
    mats = []
    for r in range(world):
        i = torch.tensor(boundary[r % 3]).T
        mats.append(torch.sparse_coo_tensor(i, torch.arange(1.0, 4.0) * (r + 1), (4, 5)).coalesce())
    cases.append(("torch_matrix", mats, False))
    g = torch.Generator().manual_seed(3)
    cases.append(("torch_bf16", [(torch.randn(12, 4, generator=g) * (torch.rand(12, 1, generator=g) < 0.5))
                                 .to(torch.bfloat16).to_sparse(1) for _ in range(world)], False))
    return cases


def _run_cases(make_worker: Any, world: int, cases: list[tuple[str, list[Any], bool]]) -> list[list[Any]]:
    """Every rank's (result, blocks sent) of every case."""

    def rank(r: int) -> list[Any]:
        with make_worker(r) as w:
            out = []
            for _, xs, weighted in cases:
                opts = {"weight": r + 1} if weighted else {}
                out.append((w.allreduce(xs[r], **opts), w.stats.last.blocks_sent))
            return out

    return run_ranks(world, rank)


def _same(a: Any, b: Any) -> None:
    if isinstance(a, SparseRows):
        assert isinstance(b, SparseRows)
        np.testing.assert_array_equal(a.rows, b.rows)
        assert a.values.dtype == b.values.dtype and a.values.shape == b.values.shape
        assert bits(a.values) == bits(b.values)
        assert a.dense_shape == b.dense_shape and a.dtype == b.dtype
    else:
        assert b.is_coalesced() and a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a.indices(), b.indices()) and torch.equal(a.values(), b.values())


def test_sharded_and_colocated_equal_one_aggregator(aggregator: Aggregator, two_shards: list[str]) -> None:
    world = 3
    cases = _topology_cases(world)
    single = _run_cases(lambda r: Worker(aggregator.address, rank=r, world_size=world, job="one", **OPTS),
                        world, cases)
    sharded = _run_cases(lambda r: connect(two_shards, rank=r, world_size=world, job="two", shard_bytes=0, **OPTS),
                         world, cases)
    ex = ThreadExchange(world)
    coloc = _run_cases(lambda r: ColocatedWorker(ex(r), r, world, job="coloc", close_timeout=5, shard_bytes=0, **OPTS),
                       world, cases)
    for k, (name, xs, weighted) in enumerate(cases):
        for r in range(world):
            ref = single[r][k][0]
            # Independent expectations for the single aggregator; the others must equal it bit for bit.
            if isinstance(xs[0], SparseRows) and not weighted:
                rows, values = expected_sum(xs)
                if name == "randn":
                    assert_rows(ref, xs[0], rows, ref.values)
                    np.testing.assert_allclose(ref.values, values, rtol=1e-5, atol=1e-6)
                else:
                    assert_rows(ref, xs[0], rows, values)
            elif isinstance(xs[0], SparseRows):
                acc = np.zeros((xs[0].num_rows, *xs[0].row_shape))
                for q, x in enumerate(xs):
                    acc[x.rows] += (q + 1) * x.values.astype(np.float64)
                rows = functools.reduce(np.union1d, [x.rows for x in xs])
                assert_rows(ref, xs[0], rows, ref.values)
                np.testing.assert_allclose(ref.values, acc[rows] / sum(range(1, world + 1)), rtol=1e-5, atol=1e-6)
            else:
                assert_torch_sum(ref, xs, exact=True)
            given = len(xs[r].rows) if isinstance(xs[r], SparseRows) else xs[r].coalesce()._nnz()
            for topo, res in (("single", single), ("sharded", sharded), ("colocated", coloc)):
                try:
                    _same(res[r][k][0], ref)
                    assert res[r][k][1] == given, f"blocks_sent {res[r][k][1]} != {given} rows given"
                except AssertionError as e:
                    raise AssertionError(f"case {name}, {topo}, rank {r}: {e}") from None


# Weighted means.


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_weighted_mean_of_rows(aggregator: Aggregator, dtype: Any) -> None:
    world, num_rows = 3, 40
    rng = np.random.default_rng(9)
    weights = [1.0, 2.0, 5.0]
    inputs = []
    for _ in range(world):
        rows = random_rows(rng, num_rows, 0.4)
        inputs.append(SparseRows(rows, rng.standard_normal((len(rows), 6)).astype(dtype), num_rows))
    ints = [make_rows(rng, num_rows, random_rows(rng, num_rows, 0.4), (6,), dtype) for _ in range(world)]

    def rank(r: int) -> list[Any]:
        with Worker(aggregator.address, rank=r, world_size=world, job="mean", **OPTS) as w:
            return [w.allreduce(inputs[r], weight=weights[r]), w.allreduce(ints[r], weight=2),
                    w.allreduce(ints[r])]

    rows = functools.reduce(np.union1d, [x.rows for x in inputs])
    acc = np.zeros((num_rows, 6))
    for x, wt in zip(inputs, weights, strict=True):
        acc[x.rows] += wt * x.values.astype(np.float64)
    expected = acc[rows] / sum(weights)
    tol = 1e-6 if dtype == np.float32 else 1e-13
    results = run_ranks(world, rank)
    for weighted, equal, plain in results:
        assert_rows(weighted, inputs[0], rows, weighted.values)
        np.testing.assert_allclose(weighted.values, expected, rtol=tol, atol=tol)
        assert bits(weighted.values) == bits(results[0][0].values)
        # Equal weights: exactly the plain sum divided by the number of ranks.
        np.testing.assert_array_equal(equal.rows, plain.rows)
        assert bits(equal.values) == bits((plain.values / dtype(world)).astype(dtype))


# Mismatches.


@pytest.mark.parametrize("sharded", [False, True], ids=["one_aggregator", "two_shards"])
def test_mismatched_rows_fail_on_every_rank(aggregator: Aggregator, two_shards: list[str], sharded: bool) -> None:
    def rows(num_rows: int, width: int, dtype: Any = np.float32, shape: tuple[int, ...] | None = None) -> SparseRows:
        return SparseRows(_rows(0, num_rows - 1), np.ones((2, width), dtype), num_rows, shape)

    pairs = [
        ("num_rows", rows(10, 3), rows(11, 3)),
        # As many rows of the same width in tensors of other shapes: gloo refuses these too.
        ("shape", rows(6, 1, shape=(2, 3)), rows(6, 1, shape=(3, 2))),
        ("sparse_dims", rows(6, 1, shape=(6,)), rows(6, 1, shape=(2, 3))),
        ("dense_dims", rows(4, 6, shape=(4, 6)), rows(4, 6, shape=(4, 2, 3))),
        ("width", rows(10, 3), rows(10, 4)),
        ("same_length_other_width", rows(10, 6), rows(20, 3)),
        ("dtype", rows(10, 3), rows(10, 3, np.float64)),
        ("int_vs_float", rows(10, 3, np.int32), rows(10, 3, np.float32)),
    ]
    good = SparseRows(_rows(2), np.ones((1, 3), np.float32), 10)
    address = two_shards if sharded else aggregator.address

    def rank(r: int) -> list[str]:
        with connect(address, rank=r, world_size=2, job="mismatch", **OPTS) as w:
            msgs = []
            for name, a, b in pairs:
                with pytest.raises(MismatchError) as info:
                    w.allreduce([a, b][r])
                msgs.append(f"{name}: {info.value}")
                # The ranks stay in step: the next op succeeds.
                assert_rows(w.allreduce(good), good, _rows(2), np.full((1, 3), 2.0, np.float32))
            return msgs

    for msgs in run_ranks(2, rank):
        assert len(msgs) == len(pairs)
        assert "job='mismatch'" in msgs[0]
        assert "shape: (2, 3) vs (3, 2)" in msgs[1], msgs[1]


# What the op sends.


@pytest.mark.parametrize("mode", ["sparse", "dense", "auto"])
def test_op_sends_only_the_given_rows(aggregator: Aggregator, mode: str) -> None:
    rng = np.random.default_rng(21)
    num_rows, width = 300, 3
    given = [random_rows(rng, num_rows, d) for d in (0.05, 0.5)] + [np.empty(0, np.int64)]
    inputs = [make_rows(rng, num_rows, g, (width,), np.float32) for g in given]
    # A given row of zeros is still sent (and summed); a row not given is never read.
    inputs[0].values[0] = 0
    union = functools.reduce(np.union1d, given)

    def rank(r: int) -> Any:
        with Worker(aggregator.address, rank=r, world_size=3, job=f"sent-{mode}", block_size=16, mode=mode,
                    **OPTS) as w:
            res = w.allreduce(inputs[r])
            s = w.stats.last
            return res, (s.blocks_sent, s.blocks_received, s.blocks, s.elements, s.dense_bytes, s.path)

    rows, values = expected_sum(inputs)
    for r, (res, stats) in enumerate(run_ranks(3, rank)):
        assert_rows(res, inputs[r], rows, values)
        # A rank is not sent back the rows only it gave (they sum to themselves).
        alone = np.setdiff1d(given[r], functools.reduce(np.union1d, [g for q, g in enumerate(given) if q != r]))
        assert len(alone) > 0 or r == 2
        received = len(union) - len(alone)
        assert stats == (len(given[r]), received, num_rows, num_rows * width, num_rows * width * 4, "sparse")


@pytest.mark.parametrize(("num_rows", "width", "dtype", "streams"), [
    (102_400, 256, np.float32, 4), (25_600, 256, np.float32, 1), (1000, 3, np.float64, 1), (0, 8, np.float32, 1),
    (200_000, 64, np.float16, 1), (2_000_000, 256, np.float32, 62),
])
def test_a_rows_op_lays_one_row_per_column_in_few_streams(num_rows: int, width: int, dtype: Any, streams: int) -> None:
    from worker.rows import ROWS_MESSAGE_BYTES, RowsOpData

    # The layout depends on the row count and width only, not on which rows a rank has.
    for rows in (np.empty(0, np.int64), np.arange(min(num_rows, 5), dtype=np.int64)):
        layout = RowsOpData(SparseRows(rows, np.ones((len(rows), width), dtype), num_rows)).layout()
        assert layout.block_size == width and layout.length == num_rows * width
        assert layout.num_columns == max(num_rows, 0) and layout.num_streams == streams
        assert layout.message_blocks * width * np.dtype(dtype).itemsize <= ROWS_MESSAGE_BYTES
    from worker.rows import ROWS_MAX_STREAMS, rows_layout

    # More rows than ROWS_MAX_STREAMS messages hold: longer streams, never more of them.
    layout = rows_layout(100_000_000, 128, DType.FLOAT32)
    assert layout.num_streams == ROWS_MAX_STREAMS and layout.num_columns >= 100_000_000


def test_a_table_of_more_rows_than_the_streams_hold_sums_in_longer_streams(aggregator: Aggregator) -> None:
    """nn.Embedding(100_000_000, 128, sparse=True): 1526 streams of 32 MB each exceeded the
    aggregator's limit of 1024 streams per op (a LimitError on every rank)."""
    n, width = 100_000_000, 128
    xs = [torch.sparse_coo_tensor(torch.tensor([[r, n - 1]]), torch.ones(2, width), (n, width)) for r in range(2)]

    def rank(r: int) -> Any:
        with connect(aggregator.address, rank=r, world_size=2, job="long-streams", timeout=20) as w:
            return w.allreduce(xs[r])

    for y in run_ranks(2, rank):
        assert y.indices().tolist() == [[0, 1, n - 1]]
        assert torch.equal(y.values(), torch.tensor([[1.0] * width, [1.0] * width, [2.0] * width]))


def test_an_inproc_rank_may_change_its_rows_once_its_op_returned() -> None:
    # Both ranks send the same rows, so the union is every rank's pointers: the aggregator
    # must not send rank 0's own index memory (handed over inproc, without a copy, for
    # frames of 64 kB and more) to rank 1, whose result may still wait in its socket when
    # rank 0 reuses its index buffer.
    import threading
    import time

    import zmq

    n = 20_000
    ctx = zmq.Context()
    inproc = "inproc://rows-reuse"
    step = threading.Barrier(2, timeout=30)
    with Aggregator(listen=["tcp://127.0.0.1:0", inproc], context=ctx, timeout=20).start() as agg:

        def rank(r: int) -> list[bool]:
            seen = []
            with Worker(inproc if r == 0 else agg.address, r, 2, job="reuse", timeout=20,
                        context=ctx if r == 0 else None) as w:
                for _ in range(5):
                    rows = np.arange(n, dtype=np.int64) * 2
                    x = SparseRows(rows, np.ones((n, 4), np.float32), 2 * n)
                    step.wait()
                    if r == 0:
                        time.sleep(0.02)  # rank 1's START first: rank 0's completes the op
                    y = w.allreduce(x)
                    if r == 0:
                        rows[:] += 1
                    else:
                        seen.append(bool(np.array_equal(y.rows, np.arange(n) * 2) and (y.values == 2).all()))
                    step.wait()
            return seen

        assert run_ranks(2, rank)[1] == [True] * 5
    ctx.term()
