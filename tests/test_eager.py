"""Eager ops: a layout of one row of blocks moves its blocks with the START, in one round trip."""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Any

import numpy as np
import pytest

import worker
from aggregator import Aggregator
from aggregator.engine import Engine
from aggregator.limits import Limits
from omnireduce.dtypes import DType
from omnireduce.errors import ConnectionLostError, ProtocolError
from omnireduce.layout import Layout
from omnireduce.protocol import ErrorCode, Result, Start, decode, encode
from tests.helpers import errors_by_peer, peer_of, run_allreduce, wire
from worker.op import WorkerOp


def _sparse(rng: np.random.Generator, n: int, block: int, density: float, dtype: np.dtype) -> np.ndarray:
    x = np.zeros(n, dtype)
    nb = -(-n // block)
    for b in np.flatnonzero(rng.random(nb) < density):
        seg = slice(b * block, min(n, (b + 1) * block))
        x[seg] = rng.integers(-50, 50, seg.stop - seg.start).astype(dtype)
    return x


@pytest.mark.parametrize("seed", range(6))
def test_a_one_row_op_is_summed_in_one_round_trip(seed: int) -> None:
    rng = np.random.default_rng(seed)
    # 997 elements in blocks of 8: 125 blocks, the last one short, in 2 streams of up to 64 columns.
    xs = [_sparse(rng, 997, 8, d, np.float32) for d in (0.05, 0.3, 0.0, 1.0)[: 2 + seed % 3]]
    xs[0][-3:] = 1.5  # the short last block is in the union
    outs, ops, engine = run_allreduce(xs, DType.FLOAT32, block_size=8, message_blocks=64, streams=2,
                                      shuffle=random.Random(seed))
    for out in outs:
        np.testing.assert_array_equal(out, np.sum(xs, axis=0))
    for w in ops:
        assert w.eager
        # Its STARTs (with the blocks) are all a rank sends: one if its blocks fit in one
        # stream's message (64), else one per stream; the streams' RESULTs come back, in
        # one message where both streams complete on the same START.
        assert w.stats.messages_sent == (1 if w.stats.blocks_sent <= 64 else 2) and w.stats.rounds == 1
        assert w.stats.messages_received in (1, 2)
        assert w.stats.blocks_sent == np.count_nonzero(np.add.reduceat(xs[w.rank] != 0, np.arange(0, 997, 8)))
    assert engine.counters.rounds == 2 and engine.ops_completed == 1 and engine.held_bytes == 0


def test_an_op_of_two_rows_is_not_eager_and_takes_its_rounds() -> None:
    x = np.ones(16 * 8, np.float32)
    _, ops, _ = run_allreduce([x, x], DType.FLOAT32, block_size=8, message_blocks=4, streams=2)
    assert not ops[0].eager and ops[0].stats.messages_sent > 1 and ops[0].stats.rounds > 1


@pytest.mark.parametrize("dtype", [DType.INT32, DType.FLOAT16, DType.FLOAT64])
def test_eager_ops_weighted_and_integer(dtype: DType) -> None:
    rng = np.random.default_rng(3)
    xs = [_sparse(rng, 200, 16, 0.4, np.dtype(dtype.storage)) for _ in range(3)]
    weights = None if dtype.is_integer else [1.0, 2.0, 5.0]
    outs, ops, _ = run_allreduce(xs, dtype, block_size=16, message_blocks=16, streams=1, weights=weights)
    assert all(w.eager for w in ops)
    ref = np.sum(xs, axis=0, dtype=np.int64).astype(xs[0].dtype) if weights is None else (
        sum(w * x.astype(np.float64) for w, x in zip(weights, xs, strict=True)) / sum(weights)
    ).astype(xs[0].dtype)
    for out in outs:
        np.testing.assert_allclose(out.astype(np.float64), ref.astype(np.float64), rtol=1e-3 if weights else 0)


def test_eager_op_where_no_rank_has_a_block() -> None:
    outs, ops, engine = run_allreduce([np.zeros(40, np.float32)] * 2, DType.FLOAT32, block_size=8, message_blocks=8)
    assert all(w.eager and w.done for w in ops)
    np.testing.assert_array_equal(outs[0], np.zeros(40, np.float32))
    assert engine.held_bytes == 0


def _eager_start(rank: int, world: int, x: np.ndarray, layout: Layout) -> list[bytes]:
    return wire(WorkerOp("j", rank, world, 0, x, DType.FLOAT32, layout).start()[0])


def test_the_engine_refuses_an_eager_start_of_two_rows() -> None:
    # 8 blocks of 4 in 2 columns: a column holds two blocks.
    bad = encode(Start("j", 0, 2, 0, 32, int(DType.FLOAT32), 4, 2, 1, eager=True, stream=0),
                 np.array([0, 1], np.int64), np.zeros(8, np.float32))
    errs = errors_by_peer(Engine().handle(peer_of(0), wire(bad)))
    assert errs[peer_of(0)].code == ErrorCode.PROTOCOL and "more than one row" in errs[peer_of(0)].message


def test_the_engine_refuses_an_eager_payload_of_the_wrong_size() -> None:
    bad = encode(Start("j", 0, 2, 0, 32, int(DType.FLOAT32), 4, 8, 1, eager=True, stream=0),
                 np.array([0, 5], np.int64), np.zeros(7, np.float32))
    errs = errors_by_peer(Engine().handle(peer_of(0), wire(bad)))
    assert errs[peer_of(0)].code == ErrorCode.PROTOCOL and "eager payload of 28 bytes, expected 32" in (
        errs[peer_of(0)].message)


def test_a_start_of_a_stream_already_summed_fails_the_op_on_every_rank() -> None:
    # Two eager streams; stream 0 is summed once both ranks sent it. Sent again, it would
    # otherwise count as a new stream START: with every rank repeating it, the op would
    # "complete" with stream 1 never summed.
    engine = Engine()
    layout = Layout(64, 8, 4, 2)  # 8 blocks in 8 columns: eager, 2 streams of 4
    starts = [[wire(f) for f in WorkerOp("j", r, 2, 0, np.ones(64, np.float32), DType.FLOAT32, layout,
                                         pieces=8).start()] for r in range(2)]
    assert all(len(s) == 2 for s in starts)  # a START per stream
    for r in range(2):
        engine.handle(peer_of(r), starts[r][0])  # stream 0 summed (results out)
    errs = errors_by_peer(engine.handle(peer_of(0), starts[0][0]))
    assert set(errs) == {peer_of(0), peer_of(1)}
    assert all(e.code == ErrorCode.PROTOCOL and "START twice" in e.message for e in errs.values())
    assert engine.active_ops == 0 and engine.held_bytes == 0 and engine.ops_completed == 0


def test_blocks_with_a_pointer_frame_of_odd_length_are_a_protocol_error() -> None:
    engine = Engine()
    layout = Layout(64, 4, 2, 1)  # 16 blocks in 2 columns: rounds
    ops = [WorkerOp("j", r, 2, 0, np.ones(64, np.float32), DType.FLOAT32, layout) for r in range(2)]
    results = []
    for r in range(2):
        results += engine.handle(peer_of(r), wire(ops[r].start()[0]))
    (peer, frames), = [(p, f) for p, f in results if p == peer_of(0)]
    msg, body = decode(wire(frames))
    reply = wire(ops[0].on_result(msg, body))  # rank 0's BLOCKS of round 1
    reply[1] = reply[1][:7]  # its pointer frame cut to 7 bytes
    errs = errors_by_peer(engine.handle(peer_of(0), reply))
    assert errs and all(e.code == ErrorCode.PROTOCOL and e.ranks == [0] for e in errs.values()), errs


def test_eager_and_plain_ranks_of_one_op_are_a_mismatch() -> None:
    engine = Engine()
    layout = Layout(32, 4, 8, 1)
    assert engine.handle(peer_of(0), _eager_start(0, 2, np.ones(32, np.float32), layout)) == []
    plain = encode(Start("j", 1, 2, 0, 32, int(DType.FLOAT32), 4, 8, 1), np.arange(8, dtype=np.int64))
    errs = errors_by_peer(engine.handle(peer_of(1), wire(plain)))
    assert set(errs) == {peer_of(0), peer_of(1)}
    assert all(e.code == ErrorCode.MISMATCH and "eager: True vs False" in e.message for e in errs.values())
    assert engine.held_bytes == 0


def test_eager_payloads_count_against_the_job_cap() -> None:
    engine = Engine(limits=Limits(max_job_bytes=64 << 10))
    layout = Layout(30_000, 100, 1000, 1)  # 300 blocks, one row: 120 kB of payload per rank
    errs = errors_by_peer(engine.handle(peer_of(0), _eager_start(0, 2, np.ones(30_000, np.float32), layout)))
    assert errs[peer_of(0)].code == ErrorCode.LIMIT and "bytes in flight" in errs[peer_of(0)].message
    assert engine.held_bytes == 0


def _started(x: np.ndarray, message_blocks: int = 8) -> WorkerOp:
    """Rank 0 of 2's eager op of ``x`` in blocks of 4, its START sent."""
    w = WorkerOp("j", 0, 2, 0, x, DType.FLOAT32, Layout(len(x), 4, message_blocks, 1))
    w.start()
    return w


def _result(data: list[np.ndarray], rnd: int = 0) -> tuple[Result, list[bytes]]:
    if len(data) == 2:
        # In the instruction's order, no group: every sum in the second part.
        cur, sums = data
        data = [cur, np.zeros(0, np.int64), np.zeros(3, np.int64), sums[:0], sums]
    msg, frames = decode(wire(encode(Result("j", 0, 0, rnd), *data)))
    assert isinstance(msg, Result)
    return msg, frames


def test_the_worker_takes_one_result_per_eager_stream() -> None:
    x = np.zeros(32, np.float32)
    x[4:8] = 1.0
    w = _started(x)
    assert w.on_result(*_result([np.array([1, 3], np.int64), np.arange(8, dtype=np.float32)])) is None
    assert w.done
    np.testing.assert_array_equal(w.out[4:8], [0, 1, 2, 3])
    np.testing.assert_array_equal(w.out[12:16], [4, 5, 6, 7])
    with pytest.raises(ProtocolError, match="out of order"):
        w.on_result(*_result([np.zeros(0, np.int64), np.zeros(0, np.float32)], rnd=1))


def test_an_eager_result_leaves_out_the_blocks_only_the_receiver_sent() -> None:
    # 2 ranks: rank 0 has blocks 1 and 5, rank 1 has blocks 5 and 6 (of 8 blocks of 4, one row).
    x0, x1 = np.zeros(32, np.float32), np.zeros(32, np.float32)
    x0[4:8], x0[20:24] = 1.0, 2.0
    x1[20:24], x1[24:28] = 3.0, 4.0
    for inplace in (False, True):
        outs, ops, engine = run_allreduce([x0.copy(), x1.copy()], DType.FLOAT32, block_size=4, message_blocks=8,
                                          streams=1, inplace=inplace)
        for out in outs:
            np.testing.assert_array_equal(out, x0 + x1)
        # Each receives the shared block 5 and the other's block, not its own.
        assert [w.stats.blocks_received for w in ops] == [2, 2]
        assert engine.counters.blocks_out == 4
        # The union (blocks 1, 5, 6) is what each measures: auto mode's density, alike on every rank.
        assert [w.stats.union_blocks for w in ops] == [3, 3]
        assert [w.stats.union_density for w in ops] == [3 / 8, 3 / 8]


@pytest.mark.parametrize("length", [32, 30], ids=["whole_blocks", "short_last_block"])
def test_a_stream_only_one_rank_sent_is_not_sent_back_to_it(length: int) -> None:
    # A point-to-point message: rank 1 sends every block, ranks 0 and 2 none. Only they receive
    # the blocks (a short last block goes to every rank, as always).
    xs = [np.zeros(length, np.float32) for _ in range(3)]
    xs[1][:] = np.arange(length) + 1.0
    for inplace in (False, True):
        outs, ops, engine = run_allreduce([x.copy() for x in xs], DType.FLOAT32, block_size=4, message_blocks=8,
                                          streams=1, inplace=inplace)
        for out in outs:
            np.testing.assert_array_equal(out, xs[1])
        short = int(length % 4 != 0)
        assert [w.stats.blocks_received for w in ops] == [8, short, 8]
        assert engine.counters.blocks_out == 16 + short


def test_weighted_eager_ops_send_every_sum() -> None:
    x0, x1 = np.zeros(32, np.float32), np.zeros(32, np.float32)
    x0[4:8], x1[24:28] = 1.0, 4.0
    outs, ops, _ = run_allreduce([x0, x1], DType.FLOAT32, block_size=4, message_blocks=8, streams=1,
                                 weights=[1.0, 3.0])
    np.testing.assert_array_equal(outs[0], (x0 + 3 * x1) / 4)
    assert [w.stats.blocks_received for w in ops] == [2, 2]


def test_the_short_last_block_is_always_sent() -> None:
    x0, x1 = np.zeros(30, np.float32), np.zeros(30, np.float32)
    x0[28:30] = 7.0  # block 7 (2 elements), only rank 0's
    x1[0:4] = 1.0
    outs, ops, _ = run_allreduce([x0, x1], DType.FLOAT32, block_size=4, message_blocks=8, streams=1)
    np.testing.assert_array_equal(outs[1], x0 + x1)
    assert [w.stats.blocks_received for w in ops] == [2, 1]
    assert [w.stats.union_density for w in ops] == [2 / 8, 2 / 8]  # blocks 0 and 7


def _own_result(cur: list[int], order: list[int], groups: list[int], before: int, after: int) -> tuple[Result, list]:
    return _result([np.array(cur, np.int64), np.array(order, np.int64), np.array(groups, np.int64),
                    np.zeros(before, np.float32), np.zeros(after, np.float32)])


@pytest.mark.parametrize("order, groups, match", [
    ([1, 1], [0, 1, 1], "repeats"),
    ([0, 2], [0, 1, 1], "orders 2 sums of 2"),
    ([1, 0], [0, 1, 3], "group starts"),
    ([1, 0], [1, 1, 1], "group starts"),
    ([0, 1], [0, 1, 1], "did not send"),  # block 0 is not rank 0's
])
def test_the_worker_refuses_to_keep_blocks_that_are_not_its_own(order: list[int], groups: list[int],
                                                                 match: str) -> None:
    x = np.zeros(32, np.float32)
    x[4:8] = 1.0
    w = _started(x)
    with pytest.raises(ProtocolError, match=match):
        w.on_result(*_own_result([0, 1], order, groups, 0, 4))


def test_the_worker_keeps_its_own_group_from_its_input() -> None:
    x = np.zeros(32, np.float32)
    x[4:8] = 1.0
    w = _started(x)
    # Union: blocks 1 (rank 0's alone) and 6 (rank 1's alone); rank 0's group first.
    msg, frames = _result([np.array([1, 6], np.int64), np.array([0, 1], np.int64), np.array([0, 1, 2], np.int64),
                           np.zeros(0, np.float32), np.full(4, 5.0, np.float32)])
    assert w.on_result(msg, frames) is None and w.done
    np.testing.assert_array_equal(w.out[4:8], 1.0)
    np.testing.assert_array_equal(w.out[24:28], 5.0)
    assert w.stats.blocks_received == 1
    with pytest.raises(ProtocolError, match="elements for 1 blocks"):
        _started(x).on_result(*_own_result([1, 6], [0, 1], [0, 1, 2], 0, 8))


def test_the_worker_refuses_to_keep_its_short_last_block() -> None:
    x = np.zeros(30, np.float32)
    x[28:30] = 1.0
    w = _started(x)
    with pytest.raises(ProtocolError, match="did not send in full"):
        w.on_result(*_own_result([7], [0], [0, 1, 1], 0, 0))


def test_the_worker_refuses_an_eager_result_without_its_block() -> None:
    x = np.zeros(32, np.float32)
    x[4:8] = 1.0
    w = _started(x)
    with pytest.raises(ProtocolError, match="skips a nonzero block"):
        w.on_result(*_result([np.array([3], np.int64), np.arange(4, dtype=np.float32)]))
    with pytest.raises(ProtocolError, match="expected 8"):
        w.on_result(*_result([np.array([1, 3], np.int64), np.arange(4, dtype=np.float32)]))


@pytest.mark.parametrize("seed", range(40))
def test_random_eager_ops_equal_the_dense_sum(seed: int) -> None:
    # Worlds of 2-5 ranks, overlapping and disjoint blocks, short last blocks, several
    # streams, in place or not, weighted or not, messages delivered in random order.
    rng = np.random.default_rng(100 + seed)
    world = int(rng.integers(2, 6))
    block = int(rng.choice([1, 3, 8]))
    n = int(rng.integers(1, 400))
    nb = -(-n // block)
    streams = int(rng.integers(1, 4))
    message_blocks = -(-nb // streams) + int(rng.integers(0, 3))  # one row: every column holds a block at most
    shared = rng.random(nb) < rng.random() * 0.5
    xs = []
    for _ in range(world):
        mine = shared | (rng.random(nb) < rng.random())
        x = np.zeros(nb * block, np.float32)
        x.reshape(nb, block)[mine] = rng.integers(-9, 10, (int(mine.sum()), block))
        xs.append(x[:n].copy())
    weights = [float(w) for w in rng.integers(1, 5, world)] if seed % 4 == 0 else None
    inplace = seed % 3 == 0
    want = np.sum(xs, axis=0) if weights is None else sum(w * x for w, x in zip(weights, xs, strict=True)) / sum(
        weights)
    outs, ops, engine = run_allreduce([x.copy() for x in xs], DType.FLOAT32, block_size=block,
                                      message_blocks=message_blocks, streams=streams, weights=weights,
                                      inplace=inplace, shuffle=random.Random(seed))
    assert all(w.eager for w in ops)
    for out in outs:
        np.testing.assert_allclose(out, want, rtol=1e-6, atol=0)
    assert engine.held_bytes == 0 and engine.ops_completed == 1


def _stream_starts(rank: int, x: np.ndarray, layout: Layout, world: int = 2) -> list[list[bytes]]:
    return [wire(f) for f in WorkerOp("j", rank, world, 0, x, DType.FLOAT32, layout).start()]


def test_an_eager_op_sends_one_start_per_stream_within_a_message() -> None:
    # 40 blocks of 4 in 3 streams of at most 16 columns: no START carries more than 16 blocks.
    layout = Layout(160, 4, 16, 3)
    messages = _stream_starts(0, np.ones(160, np.float32), layout)
    assert len(messages) == layout.num_streams == 3
    for k, frames in enumerate(messages):
        msg, body = decode(frames)
        span = layout.stream_columns(k)
        assert isinstance(msg, Start) and msg.eager and msg.stream == k
        np.testing.assert_array_equal(np.frombuffer(body[0], np.int64), np.arange(span.start, span.stop))
        assert len(body[1]) == (span.stop - span.start) * 4 * 4 <= 16 * 4 * 4


def test_the_engine_sums_a_stream_as_soon_as_every_rank_sent_it() -> None:
    engine = Engine()
    layout = Layout(160, 4, 16, 3)
    xs = [np.arange(160, dtype=np.float32), np.ones(160, np.float32)]
    starts = [_stream_starts(r, x, layout) for r, x in enumerate(xs)]
    assert engine.handle(peer_of(0), starts[0][1]) == []
    assert engine.handle(peer_of(0), starts[0][0]) == []
    out = engine.handle(peer_of(1), starts[1][1])  # stream 1 complete; streams 0 and 2 wait
    assert sorted(p for p, _ in out) == [peer_of(0), peer_of(1)]
    for _, frames in out:
        msg, body = decode(wire(frames))
        assert isinstance(msg, Result) and msg.stream == 1 and msg.round == 0
        np.testing.assert_array_equal(np.frombuffer(body[-1], np.float32), (xs[0] + xs[1])[13 * 4 : 26 * 4])
    assert engine.active_ops == 1 and engine.held_bytes > 0
    assert len(engine.handle(peer_of(1), starts[1][0])) == 2
    assert engine.handle(peer_of(1), starts[1][2]) == []
    assert len(engine.handle(peer_of(0), starts[0][2])) == 2
    assert engine.active_ops == 0 and engine.ops_completed == 1 and engine.held_bytes == 0


def _eager_header(stream: int | None, eager: bool | None = True) -> Start:
    return Start("j", 0, 2, 0, 160, int(DType.FLOAT32), 4, 16, 3, eager=eager, stream=stream)


@pytest.mark.parametrize("header, frames, match", [
    (_eager_header(None), [np.zeros(0, np.int64), np.zeros(0, np.float32)], "eager START of streams None\\+1"),
    (_eager_header(3), [np.zeros(0, np.int64), np.zeros(0, np.float32)], "eager START of streams 3\\+1, not among"),
    (Start("j", 0, 2, 0, 640, int(DType.FLOAT32), 4, 16, 3, stream=0), [np.zeros(0, np.int64)],
     "START of given streams \\(0\\) for an op that is not eager"),
    # Stream 0 of 3 holds columns 0-12.
    (_eager_header(0), [np.arange(12, 14, dtype=np.int64), np.zeros(8, np.float32)],
     "outside the columns of streams 0-0"),
    (_eager_header(0), [np.arange(13, dtype=np.int64)], "does not carry at most 13 column pointers"),
    (_eager_header(0), [np.arange(14, dtype=np.int64), np.zeros(56, np.float32)], "at most 13 column pointers"),
])
def test_the_engine_refuses_an_eager_start_that_is_not_one_streams(header: Start, frames: list, match: str) -> None:
    errs = errors_by_peer(Engine().handle(peer_of(0), wire(encode(header, *frames))))
    assert errs[peer_of(0)].code == ErrorCode.PROTOCOL
    assert re.search(match, errs[peer_of(0)].message), errs[peer_of(0)].message


def test_a_streams_start_twice_or_from_another_connection_fails_the_op() -> None:
    layout = Layout(160, 4, 16, 3)
    starts = _stream_starts(0, np.ones(160, np.float32), layout)
    engine = Engine()
    assert engine.handle(peer_of(0), starts[0]) == []
    errs = errors_by_peer(engine.handle(peer_of(0), starts[0]))
    assert "sent stream 0's START twice" in errs[peer_of(0)].message and engine.held_bytes == 0
    engine = Engine()
    assert engine.handle(peer_of(0), starts[0]) == []
    errs = errors_by_peer(engine.handle(b"intruder", starts[1]))
    assert "from two connections" in errs[peer_of(0)].message and engine.held_bytes == 0


def test_an_eager_op_larger_than_a_frame_limit_is_sent_stream_by_stream() -> None:
    # 100 kB per rank in 4 streams of 25 kB: the aggregator takes frames of at most 32 kB.
    # Before protocol 5 the whole payload went in one START, and the aggregator dropped the connection.
    agg = Aggregator(listen="tcp://127.0.0.1:0", timeout=20.0, limits=Limits(max_message_bytes=32 << 10)).start()
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(25_600).astype(np.float32) for _ in range(2)]
    ws = [worker.connect(agg.address, rank=r, world_size=2, job="big", block_size=64, message_blocks=100,
                         streams=4, timeout=20) for r in range(2)]
    try:
        futs = [w.allreduce_async(x) for w, x in zip(ws, xs, strict=True)]
        for f in futs:
            np.testing.assert_array_equal(f.result(timeout=30), xs[0] + xs[1])
        assert ws[0].stats.last is not None and ws[0].stats.last.messages_sent == 4
    finally:
        for w in ws:
            w.close()
        agg.close()


def test_a_frame_above_the_aggregators_limit_fails_naming_the_ops_message_size() -> None:
    # ZeroMQ cuts the connection before the engine could refuse the op: the error says how
    # large the op's messages are, next to the limit that cuts them.
    agg = Aggregator(listen="tcp://127.0.0.1:0", timeout=20.0, limits=Limits(max_message_bytes=32 << 10)).start()
    ws = [worker.connect(agg.address, rank=r, world_size=2, job="too-big", block_size=64, message_blocks=1000,
                         streams=1, timeout=20) for r in range(2)]
    try:
        futs = [w.allreduce_async(np.ones(25_600, np.float32)) for w in ws]
        for f in futs:
            with pytest.raises(ConnectionLostError, match="carry up to 102400 bytes: an aggregator cuts the "
                                                          "connection of a message above its --max-message-bytes"):
                f.result(timeout=30)
    finally:
        for w in ws:
            w.close()
        agg.close()


def test_a_worker_told_the_frame_limit_refuses_larger_ops_and_the_job_goes_on() -> None:
    # Sent, the rank's START is cut with its connection, the rank counts as lost and every
    # later op of the job fails. Told the limit, every rank refuses the op before sending.
    torch = pytest.importorskip("torch")
    from omnireduce.errors import LimitError

    agg = Aggregator(listen="tcp://127.0.0.1:0", timeout=20.0, limits=Limits(max_message_bytes=32 << 10)).start()
    ws = [worker.connect(agg.address, rank=r, world_size=2, job="told", block_size=64, message_blocks=1000,
                         streams=1, timeout=20, max_message_bytes=32 << 10) for r in range(2)]
    # One row of 64 KiB: rank 0 holds it, rank 1 holds no row.
    rows = [torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1, 16384), (2, 16384)),
            torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.long), torch.ones(0, 16384), (2, 16384))]
    try:
        for xs in ([np.ones(25_600, np.float32)] * 2, rows):
            for w, x in zip(ws, xs, strict=True):
                with pytest.raises(LimitError, match=r"up to \d+ bytes, above the limit of 32768 \(max_message_bytes"):
                    w.allreduce_async(x)  # in the call, as the refusals of other arguments
        for f in [w.allreduce_async(np.ones(1000, np.float32)) for w in ws]:
            np.testing.assert_array_equal(f.result(timeout=30), np.full(1000, 2.0, np.float32))
        assert agg.engine.held_bytes == 0
    finally:
        for w in ws:
            w.close()
        agg.close()


def test_a_colocated_workers_frame_limit_is_its_shards() -> None:
    from worker.colocated import _same_message_limit

    options: dict[str, Any] = {"max_message_bytes": 1 << 20}
    assert _same_message_limit({}, options)["limits"].max_message_bytes == 1 << 20
    options = {}
    assert _same_message_limit({"limits": Limits(max_message_bytes=5 << 20)}, options)["limits"].max_message_bytes == \
        5 << 20
    assert options == {"max_message_bytes": 5 << 20}
    assert _same_message_limit({}, {}) == {}


def test_a_sparse_rank_sends_its_streams_in_one_start_and_hears_back_in_one_result() -> None:
    # 40 blocks of 4 in 3 streams of at most 16 columns; rank 0 holds 5 blocks over all three
    # streams (one START), rank 1 every block (one START per stream).
    layout = Layout(160, 4, 16, 3)
    sparse = np.zeros(160, np.float32)
    sparse[[0, 30, 60, 110, 159]] = [1, 2, 3, 4, 5]
    dense = np.arange(160, dtype=np.float32)
    s0, s1 = _stream_starts(0, sparse, layout), _stream_starts(1, dense, layout)
    assert len(s0) == 1 and len(s1) == 3
    msg, _ = decode(s0[0])
    assert isinstance(msg, Start) and (msg.stream, msg.stream_count) == (0, 3)
    engine = Engine()
    assert engine.handle(peer_of(1), s1[0]) == [] and engine.handle(peer_of(1), s1[2]) == []
    # Rank 0's START completes streams 0 and 2, which do not follow each other: two RESULTs each.
    out = engine.handle(peer_of(0), s0[0])
    assert sorted((p, decode(wire(f))[0].stream, decode(wire(f))[0].stream_count) for p, f in out) == [
        (peer_of(0), 0, None), (peer_of(0), 2, None), (peer_of(1), 0, None), (peer_of(1), 2, None)]
    assert len(engine.handle(peer_of(1), s1[1])) == 2 and engine.ops_completed == 1 and engine.held_bytes == 0


def test_streams_completed_together_come_back_in_one_result() -> None:
    layout = Layout(160, 4, 16, 3)
    xs = [np.zeros(160, np.float32) for _ in range(2)]
    xs[0][[0, 70, 150]] = 1.0
    xs[1][[4, 70, 155]] = 2.0
    ops = [WorkerOp("j", r, 2, 0, x, DType.FLOAT32, layout) for r, x in enumerate(xs)]
    engine = Engine()
    assert engine.handle(peer_of(0), wire(ops[0].start()[0])) == []
    out = engine.handle(peer_of(1), wire(ops[1].start()[0]))
    assert len(out) == 2
    for peer, frames in out:
        msg, body = decode(wire(frames))
        assert isinstance(msg, Result) and (msg.stream, msg.stream_count) == (0, 3) and len(body) == 15
        w = ops[0 if peer == peer_of(0) else 1]
        assert w.on_result(msg, body) is None and w.done and w.stats.messages_received == 1
        np.testing.assert_array_equal(w.out, xs[0] + xs[1])
    assert engine.ops_completed == 1 and engine.held_bytes == 0


def test_a_start_that_repeats_a_stream_of_an_earlier_one_fails_the_op() -> None:
    layout = Layout(160, 4, 16, 3)
    x = np.zeros(160, np.float32)
    x[[0, 70]] = 1.0
    engine = Engine()
    assert engine.handle(peer_of(0), _stream_starts(0, np.ones(160, np.float32), layout)[1]) == []
    errs = errors_by_peer(engine.handle(peer_of(0), _stream_starts(0, x, layout)[0]))
    assert "sent stream 1's START twice" in errs[peer_of(0)].message and engine.held_bytes == 0


def test_the_engine_refuses_a_start_of_streams_past_the_last() -> None:
    bad = encode(Start("j", 0, 2, 0, 160, int(DType.FLOAT32), 4, 16, 3, eager=True, stream=1, stream_count=3),
                 np.zeros(0, np.int64), np.zeros(0, np.float32))
    errs = errors_by_peer(Engine().handle(peer_of(0), wire(bad)))
    assert "eager START of streams 1+3, not among the op's 3" in errs[peer_of(0)].message


@pytest.mark.parametrize("stream, count, frames, match", [
    (2, 2, 10, "result for 2 streams from stream 2 out of order"),
    (0, 2, 9, "with 9 frames; expected 10"),
])
def test_the_worker_refuses_a_result_of_streams_it_cannot_hold(stream: int, count: int, frames: int,
                                                                match: str) -> None:
    w = WorkerOp("j", 0, 2, 0, np.ones(160, np.float32), DType.FLOAT32, Layout(160, 4, 16, 3))
    w.start()
    msg, body = decode(wire(encode(Result("j", 0, stream, 0, None, count), *[np.zeros(0, np.int64)] * frames)))
    assert isinstance(msg, Result)
    with pytest.raises(ProtocolError, match=match):
        w.on_result(msg, body)


def _dense_round_trip(
    dtype: DType, owned: bool, world: int = 3
) -> tuple[list[bytearray], list[list[Any]], list[np.ndarray]]:
    """Every rank's STARTs of a dense eager op as writeable received copies, handed to an engine."""
    rng = np.random.default_rng(7)
    n = 4 * 60 + 3  # two streams of one row, the second with a short last block
    xs = [rng.integers(-8, 8, n).astype(dtype.storage) for _ in range(world)]
    ops = [WorkerOp("j", r, world, 0, xs[r], dtype, Layout(n, 4, 32, 2)) for r in range(world)]
    assert all(w.eager for w in ops)
    engine = Engine()
    received: list[bytearray] = []
    results: list[list[Any]] = []
    for r, w in enumerate(ops):
        for frames in w.start():
            copies = [bytearray(f) for f in wire(frames)]
            received += copies
            for peer, out in engine.handle(peer_of(r), copies, owned=owned):
                results.append(out)
                msg, data = decode(wire(out))
                assert isinstance(msg, Result)
                ops[int(peer.decode().split("-")[1])].on_result(msg, data)
    for w in ops:
        assert w.done
        np.testing.assert_array_equal(w.out, np.sum(xs, axis=0, dtype=dtype.accumulator).astype(dtype.storage))
    return received, results, xs


@pytest.mark.parametrize("dtype", [DType.FLOAT32, DType.FLOAT16, DType.INT32])
def test_the_engine_sums_into_a_received_copy_only_when_the_message_owns_it(dtype: DType) -> None:
    for owned in (True, False):
        received, results, xs = _dense_round_trip(dtype, owned)
        before = [bytes(b) for b in received]
        # A stream's part of a RESULT: the union, the order, the groups, the sums before and after the group.
        payloads = [np.asarray(out[1 + i + j]) for out in results for i in range(0, len(out) - 1, 5) for j in (3, 4)]
        assert sum(p.size for p in payloads) == len(xs) * len(xs[0])  # every rank, every sum
        shares = any(np.shares_memory(p, np.frombuffer(b, np.uint8)) for p in payloads for b in received)
        # Float32 sums need no widening, so with owned frames they go into one of them; a
        # widened type (float16 in float32, int32 in int64) is summed into its widened copy.
        assert shares == (owned and dtype is DType.FLOAT32)
        if not owned:
            # Inproc payloads are a co-located worker's tensor: never written.
            assert [bytes(b) for b in received] == before


@pytest.mark.parametrize("dtype", [DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16, DType.FLOAT64])
@pytest.mark.parametrize("inplace", [False, True])
def test_every_rank_gets_the_same_bits_of_a_block_only_one_rank_sent(dtype: DType, inplace: bool) -> None:
    # Rank 0 alone has block 0, with a -0.0 in it; rank 1 alone has block 2; both have block 1.
    # The owner keeps its own block from its input, the others get the aggregator's sum:
    # that sum must be the block's bits, -0.0 included.
    def block(values: list[float]) -> np.ndarray:
        f = np.array(values, np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16) if dtype is DType.BFLOAT16 else f.astype(dtype.storage)

    zero = block([0.0] * 4)
    xs = [np.concatenate([block([-0.0, 1.0, -0.0, 2.0]), block([1.0, -0.0, 3.0, 0.0]), zero]),
          np.concatenate([zero, block([-0.0, -0.0, 1.0, 0.0]), block([4.0, -0.0, 0.0, 5.0])])]
    outs, ops, _ = run_allreduce([x.copy() for x in xs], dtype, block_size=4, message_blocks=8, streams=1,
                                 inplace=inplace)
    assert ops[0].eager
    assert outs[0].tobytes() == outs[1].tobytes()
    signs = np.signbit(outs[0].view(np.int16) if dtype is DType.BFLOAT16 else outs[0])
    # Blocks 0 and 2 keep their -0.0s; in block 1, -0.0 + -0.0 is -0.0 and -0.0 + 0.0 is 0.0.
    assert signs[[0, 2, 5, 9]].all() and not signs[[4, 7]].any()


def test_a_finished_stream_refuses_another_result() -> None:
    """A repeated last RESULT of a stream must not count as another stream's end: the op
    would then be done with a stream still unsummed."""
    x = np.arange(1, 65, dtype=np.float32)  # 16 blocks of 4 in 2 columns: several rounds per stream
    w = WorkerOp("j", 0, 1, 0, x, DType.FLOAT32, Layout(len(x), 4, 1, 2))
    assert not w.eager
    engine = Engine()
    to_agg = [wire(f) for f in w.start()]
    to_worker: list[list[bytes]] = []
    repeated = False
    while to_agg or to_worker:
        if to_agg:
            to_worker += [wire(out) for _, out in engine.handle(peer_of(0), to_agg.pop(0))]
            continue
        frames = to_worker.pop(0)
        msg, data = decode(frames)
        assert isinstance(msg, Result)
        reply = w.on_result(msg, data)
        if reply is not None:
            to_agg.append(wire(reply))
        elif not repeated:  # this stream's last result: again, as its next round
            repeated = True
            assert not w.done
            again = dataclasses.replace(msg, round=msg.round + 1)
            with pytest.raises(ProtocolError, match="finished"):
                w.on_result(*decode(wire(encode(again, np.zeros(0, np.int64), np.zeros(0, np.float32)))))
    assert repeated and w.done
    np.testing.assert_array_equal(w.out, x)


def test_a_large_eager_payload_goes_in_pieces_that_the_aggregator_answers_as_they_complete() -> None:
    from omnireduce.layout import EAGER_PIECE_BYTES, EAGER_PIECES, eager_start_blocks

    # Small payloads stay in one message's worth; large ones are cut for pipelining, but
    # never below EAGER_PIECE_BYTES a piece.
    assert eager_start_blocks(100, 1024, 8192) >= 100  # one piece
    assert eager_start_blocks(1024, 1024, 8192) == EAGER_PIECE_BYTES // 1024
    assert eager_start_blocks(40 * 1024, 1024, 8192) == 40 * 1024 // EAGER_PIECES
    assert eager_start_blocks(10**6, 1024, 8192) == 8192
    rng = np.random.default_rng(5)
    n, bs = 1 << 20, 256  # 4 MiB of float32: 4096 blocks in 8 streams of 512 columns
    inputs = []
    for _ in range(3):
        x = np.zeros(n, np.float32)
        for b in rng.choice(n // bs, 1600, replace=False):  # ~1.6 MB each, overlapping
            x[b * bs : (b + 1) * bs] = rng.standard_normal(bs)
        inputs.append(x)
    outs, ops, _ = run_allreduce(inputs, DType.FLOAT32, block_size=bs, message_blocks=512, streams=8,
                                 shuffle=random.Random(2))
    assert all(w.eager for w in ops)
    starts = [w.stats.messages_sent for w in ops]
    # ~200 blocks (200 KiB) per stream: a START per stream, where one message's worth
    # (512 blocks) would take two streams.
    assert starts == [8, 8, 8], starts
    for out in outs:
        np.testing.assert_array_equal(out, inputs[0] + inputs[1] + inputs[2])


def test_fewer_pieces_mean_fewer_starts() -> None:
    x = np.zeros(1 << 22, np.float32)
    x.reshape(-1, 256)[::8] = 1.0  # 2048 of 16384 blocks (2 MiB), 128 in each of 16 streams
    counts = {}
    for pieces in (8, 2, 1):
        w = WorkerOp("j", 0, 2, 0, x, DType.FLOAT32, Layout(len(x), 256, 1024, 16), pieces=pieces)
        counts[pieces] = len(w.start())
    # 8 pieces of 256 blocks (two streams each); 2 of 1024, one message's worth, as with 1.
    assert counts == {8: 8, 2: 2, 1: 2}, counts


@pytest.mark.parametrize("weights", [[1e-50, 1e-50], [1e-40, 3e-40], [1e36, 1e36], [3e38, 1e38]])
@pytest.mark.parametrize("n", [64, 640])  # one row (eager) and rounds
def test_a_weighted_mean_with_extreme_weights_is_a_mean(weights: list[float], n: int) -> None:
    # Weights the workers accept (finite, positive) whose products would underflow or overflow
    # a float32 accumulator (0/0 gave NaN, inf/inf too).
    xs = [np.full(n, 3.0, np.float32), np.full(n, 7.0, np.float32)]
    want = (weights[0] * 3.0 + weights[1] * 7.0) / (weights[0] + weights[1])
    outs, _, _ = run_allreduce([x.copy() for x in xs], DType.FLOAT32, block_size=8, message_blocks=4, streams=2,
                               weights=weights)
    for out in outs:
        np.testing.assert_allclose(out, np.full(n, want, np.float32), rtol=1e-6)
