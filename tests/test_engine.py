"""The aggregator's state machine and the worker's op, through a fake transport that encodes every message."""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest

from aggregator.engine import Engine
from aggregator.opstate import positions, union_sorted
from omnireduce.dtypes import DType, from_accumulator, to_accumulator
from omnireduce.errors import ConfigError, OmniReduceError
from omnireduce.layout import Layout
from omnireduce.protocol import Abort, Blocks, Error, ErrorCode, Hello, Result, Start, decode, encode
from tests.helpers import error_replies, errors_by_peer, peer_of, run_allreduce, sparse, start_frames, wire
from worker.op import WorkerOp, lazy_zeros

#: START frames of this module's small layout (blocks of 4, 2 columns per stream, 2 streams).
_start = functools.partial(start_frames, block_size=4, message_blocks=2, streams=2)


@pytest.mark.parametrize("world", [1, 2, 5])
@pytest.mark.parametrize("length", [0, 1, 33, 1000])
def test_exact_sum_and_only_nonzero_blocks_sent(world: int, length: int) -> None:
    rng = np.random.default_rng(world * 1000 + length)
    inputs = [sparse(rng, length, 0.3, block=4) for _ in range(world)]
    outs, ops, engine = run_allreduce(inputs, DType.FLOAT32, block_size=4, message_blocks=3, streams=2,
                                      shuffle=random.Random(length))
    expected = np.sum(np.stack(inputs).astype(np.float64), axis=0) if length else np.zeros(0)
    for out, op, x in zip(outs, ops, inputs, strict=True):
        np.testing.assert_array_equal(out, expected)
        # Each nonzero block goes on the wire exactly once; zero blocks never do.
        nonzero_blocks = int((np.abs(np.pad(x, (0, -length % 4))).reshape(-1, 4).sum(1) > 0).sum()) if length else 0
        assert op.stats.blocks_sent == nonzero_blocks
    assert engine.active_ops == 0
    assert engine.ops_completed == 1


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_float_sums_match_rank_ordered_reference(dtype) -> None:
    rng = np.random.default_rng(7)
    inputs = [sparse(rng, 999, 0.5, block=1, dtype=dtype, normal=True) for _ in range(4)]
    outs, _, _ = run_allreduce(inputs, DType.of_numpy(np.dtype(dtype)), block_size=8, message_blocks=5, streams=3)
    acc = DType.of_numpy(np.dtype(dtype)).accumulator
    ref = inputs[0].astype(acc)
    for x in inputs[1:]:
        ref = ref + x.astype(acc)
    for out in outs:
        np.testing.assert_array_equal(out, ref.astype(dtype))
        assert out.tobytes() == outs[0].tobytes()


def test_bfloat16_sum() -> None:
    rng = np.random.default_rng(3)
    values = [np.where(rng.random(500) < 0.4, rng.integers(-100, 100, 500), 0).astype(np.float32) for _ in range(3)]
    bits = [(v.view(np.uint32) >> 16).astype(np.uint16) for v in values]  # integers < 256 are exact in bfloat16
    outs, _, _ = run_allreduce(bits, DType.BFLOAT16, block_size=16, message_blocks=4, streams=2)
    np.testing.assert_array_equal(to_accumulator(outs[0], DType.BFLOAT16), sum(values))
    np.testing.assert_array_equal(outs[1], from_accumulator(sum(values), DType.BFLOAT16))


def test_nan_and_inf_propagate() -> None:
    a = np.zeros(64, np.float32)
    b = np.zeros(64, np.float32)
    a[3], b[40], b[41] = np.nan, np.inf, -np.inf
    a[41] = 1.0
    outs, _, _ = run_allreduce([a, b], DType.FLOAT32, block_size=8, message_blocks=2, streams=2)
    assert np.isnan(outs[0][3]) and outs[0][40] == np.inf and outs[0][41] == -np.inf
    assert np.count_nonzero(outs[0]) == 3


def test_ops_and_jobs_interleave_on_one_engine() -> None:
    engine = Engine()
    rng = np.random.default_rng(0)
    for op in range(3):
        for job in ("a", "b"):
            xs = [sparse(rng, 300, 0.5, block=4) for _ in range(2)]
            outs, _, _ = run_allreduce(xs, DType.FLOAT32, block_size=4, job=job, op=op, engine=engine)
            np.testing.assert_array_equal(outs[1], xs[0] + xs[1])
    assert engine.ops_completed == 6 and engine.active_ops == 0


def test_length_mismatch_fails_every_worker_of_the_op() -> None:
    engine = Engine()
    assert engine.handle(peer_of(0), _start(0, 3, 100)) == []
    out = engine.handle(peer_of(1), _start(1, 3, 101))
    errs = errors_by_peer(out)
    assert set(errs) == {peer_of(0), peer_of(1)}
    assert all(e.code == ErrorCode.MISMATCH and "length: 100 vs 101" in e.message for e in errs.values())
    # The third worker arrives late and learns the same.
    late = errors_by_peer(engine.handle(peer_of(2), _start(2, 3, 100)))
    assert late[peer_of(2)].code == ErrorCode.MISMATCH
    assert engine.active_ops == 0
    # The daemon goes on: the next op works.
    outs, _, _ = run_allreduce([np.ones(10, np.float32)] * 3, DType.FLOAT32, op=1, engine=engine)
    np.testing.assert_array_equal(outs[0], np.full(10, 3, np.float32))


def test_abort_fails_the_op_on_every_rank_before_and_after_their_starts() -> None:
    engine = Engine()
    for r in range(3):
        engine.handle(peer_of(r), wire(encode(Hello("j", r, 3, 0, ""))))
    assert engine.handle(peer_of(0), _start(0, 3, 100)) == []
    out = engine.handle(peer_of(1), wire(encode(Abort("j", 1, 0, "ConfigError: bad weight"))))
    # Only the rank already in the op hears it now; the aborting rank needs no answer.
    (peer, code, message), = error_replies(out)
    assert peer == peer_of(0) and code == ErrorCode.REFUSED
    # It names the ranks the op still waited for (rank 2; the aborting rank 1 aside).
    assert message == "rank 1 refused the op: ConfigError: bad weight (the op still waited for ranks [2] here)"
    assert engine.active_ops == 0
    # A rank that starts the op later is told the same; a second ABORT of it changes nothing.
    late = errors_by_peer(engine.handle(peer_of(2), _start(2, 3, 100)))
    assert late[peer_of(2)].code == ErrorCode.REFUSED and late[peer_of(2)].ranks == [1]
    assert engine.handle(peer_of(2), wire(encode(Abort("j", 2, 0, "")))) == []
    assert engine.ops_failed == 1 and engine.counters.errors == {"refused": 1}
    # An ABORT of an op no rank began yet: every START of it is answered with the refusal.
    engine.handle(peer_of(0), wire(encode(Abort("j", 0, 1, ""))))
    errs = errors_by_peer(engine.handle(peer_of(1), _start(1, 3, 10, op=1)))
    assert errs[peer_of(1)].message == "rank 0 refused the op: no reason given"
    # Begun nowhere here, it is still a failed op (an alert on failures must see it).
    assert engine.ops_failed == 2 and engine.counters.ops_started == 1
    # The next op works.
    outs, _, _ = run_allreduce([np.ones(10, np.float32)] * 3, DType.FLOAT32, op=2, engine=engine)
    np.testing.assert_array_equal(outs[0], np.full(10, 3, np.float32))


def test_a_jobs_tombstones_outlive_another_jobs_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    """Failed ops are remembered per job: another job failing more ops than a job keeps does not
    push out this job's refusal, which a slower rank's START must still hear of; a job keeps its
    last ones, and the total is bounded."""
    from aggregator import engine as engine_module

    monkeypatch.setattr(engine_module, "_TOMBSTONES_PER_JOB", 8)
    monkeypatch.setattr(engine_module, "_TOMBSTONES", 20)
    engine = Engine()
    jobs = ["y", "x", "w", "v"]
    for job in jobs:
        for r in range(2):
            engine.handle(b"%s%d" % (job.encode(), r), wire(encode(Hello(job, r, 2, 0, ""))))
    engine.handle(b"y0", wire(encode(Abort("y", 0, 0, "bad"))))
    for op in range(30):  # job x fails many ops: it keeps its last 8
        engine.handle(b"x1", wire(encode(Abort("x", 1, op, "lost"))))
    late = errors_by_peer(engine.handle(b"y1", _start(1, 2, 10, op=0, job="y")))
    assert late[b"y1"].code == ErrorCode.REFUSED and late[b"y1"].message == "rank 0 refused the op: bad"
    assert engine.active_ops == 0
    assert errors_by_peer(engine.handle(b"x0", _start(0, 2, 10, op=29, job="x")))[b"x0"].code == ErrorCode.REFUSED
    # Forgotten, it failed all the same: told at once (it became a new op, which waited for
    # the timeout for a rank that failed it long ago, taking a place of the job's cap).
    late = errors_by_peer(engine.handle(b"x0", _start(0, 2, 10, op=21, job="x")))
    assert late[b"x0"].code == ErrorCode.UNKNOWN_OP and "op 21 failed earlier" in late[b"x0"].message
    assert engine.active_ops == 0 and engine.handle(b"x0", wire(encode(Abort("x", 0, 21, "late")))) == []
    assert engine.handle(b"x0", _start(0, 2, 10, op=30, job="x")) == [] and engine.active_ops == 1
    engine.handle(b"x0", wire(encode(Abort("x", 0, 30, "done"))))
    # In all at most 20: jobs w and v fill them, the oldest (of any job) go first.
    for job in ("w", "v"):
        for op in range(8):
            engine.handle(b"%s1" % job.encode(), wire(encode(Abort(job, 1, op, "lost"))))
    assert len(engine._failed) == 20 and sum(len(v) for v in engine._failed_of.values()) == 20
    assert ("y", 0) not in engine._failed and ("v", 7) in engine._failed


def test_abort_of_a_connection_that_may_not_speak_for_the_rank_is_refused() -> None:
    engine = Engine()
    engine.handle(peer_of(0), wire(encode(Hello("j", 0, 2, 0, "secret"))))
    engine.handle(peer_of(0), _start(0, 2, 10))
    # A stranger cannot fail the job's ops.
    (peer, code, _), = error_replies(engine.handle(b"stranger", wire(encode(Abort("j", 1, 0, "")))))
    assert peer == b"stranger" and code == ErrorCode.AUTH
    # Nor can a bound connection speak for another rank.
    (peer, code, _), = error_replies(engine.handle(peer_of(0), wire(encode(Abort("j", 1, 0, "")))))
    assert code == ErrorCode.PROTOCOL and engine.active_ops == 1


def test_start_for_a_job_of_another_size_is_a_mismatch() -> None:
    engine = Engine()
    engine.handle(peer_of(0), wire(encode(Hello("j", 0, 2, 0, ""))))
    frames = wire(encode(Start("j", 1, 3, 0, 8, int(DType.FLOAT32), 8, 1, 1), np.zeros(1, np.int64)))
    (_, code, message), = error_replies(engine.handle(peer_of(1), frames))
    assert code == ErrorCode.MISMATCH and "the job has 2" in message


def test_timeout_names_missing_ranks() -> None:
    now = [0.0]
    engine = Engine(timeout=5.0, clock=lambda: now[0])
    engine.handle(peer_of(0), _start(0, 3, 10))
    engine.handle(peer_of(2), _start(2, 3, 10))
    now[0] = 4.9
    assert engine.expire() == []
    now[0] = 5.1
    errs = errors_by_peer(engine.expire())
    assert set(errs) == {peer_of(0), peer_of(2)}
    assert errs[peer_of(0)].code == ErrorCode.TIMEOUT and errs[peer_of(0)].ranks == [1]
    assert engine.active_ops == 0


def test_garbage_gets_an_error_reply_and_the_engine_goes_on() -> None:
    engine = Engine()
    for frames in ([b"junk"], [], [encode(Result("j", 0, 0, 0))[0]]):
        (peer, reply), = engine.handle(b"evil", frames)
        msg, _ = decode(wire(reply))
        assert peer == b"evil" and isinstance(msg, Error) and msg.code == ErrorCode.PROTOCOL
    outs, _, _ = run_allreduce([np.ones(5, np.float32)] * 2, DType.FLOAT32, engine=engine)
    np.testing.assert_array_equal(outs[0], [2] * 5)


def test_blocks_for_unknown_op_and_out_of_turn() -> None:
    engine = Engine()
    (_, reply), = engine.handle(b"p", wire(encode(Blocks("j", 0, 9, 0, 0), np.zeros(0, np.int64), b"")))
    assert decode(wire(reply))[0].code == ErrorCode.UNKNOWN_OP
    # 8 blocks in 4 columns: two rows, so the op is not eager and has rounds to break.
    engine.handle(peer_of(0), _start(0, 2, 32))
    engine.handle(peer_of(1), _start(1, 2, 32))
    # Round 1 before round 0 completed is a protocol violation that fails the op on both workers.
    errs = errors_by_peer(engine.handle(peer_of(0), wire(encode(Blocks("j", 0, 0, 0, 1), np.zeros(0, np.int64), b""))))
    assert set(errs) == {peer_of(0), peer_of(1)} and all(e.code == ErrorCode.PROTOCOL for e in errs.values())


def test_pointer_outside_column_fails_op() -> None:
    engine = Engine()
    bad = encode(Start("j", 0, 2, 0, 16, int(DType.FLOAT32), 4, 2, 2), np.array([1, 1, 2, 3], np.int64))
    errs = errors_by_peer(engine.handle(peer_of(0), wire(bad)))
    assert "outside its columns" in errs[peer_of(0)].message


def test_loopback_raises_on_error() -> None:
    with pytest.raises(OmniReduceError):
        run_allreduce([np.ones(4, np.float32), np.ones(5, np.float32)], DType.FLOAT32)


def test_worker_refuses_an_instruction_that_skips_one_of_its_blocks() -> None:
    # 12 blocks of 4 in 3 columns, one stream: rank 0 has blocks 1 (column 1) and 5 (column 2).
    layout = Layout(48, 4, 3, 1)
    x = np.zeros(48, np.float32)
    x[4:8] = 1.0
    x[20:24] = 2.0

    def result(ids: list[int]) -> tuple:
        return decode(wire(encode(Result("j", 0, 0, 0, None), np.array(ids, np.int64), np.zeros(0, np.float32))))

    def op() -> WorkerOp:
        return WorkerOp("j", 0, 2, 0, x, DType.FLOAT32, layout)

    assert op().on_result(*result([0, 1, 2])) is not None  # every column instructed: block 1 goes
    assert op().on_result(*result([1, 5])) is not None  # columns 0 finished for everyone: fine
    with pytest.raises(OmniReduceError, match="skips a nonzero block"):
        op().on_result(*result([1]))  # column 2 left out: block 5 would never be sent
    with pytest.raises(OmniReduceError, match="skips a nonzero block"):
        op().on_result(*result([4, 5]))  # column 1 asked for block 4: block 1 skipped
    with pytest.raises(OmniReduceError, match="column order"):
        op().on_result(*result([5, 1]))


# The worker op's data path: zero-copy dense rounds, one-pass sums, lazy and in-place results.


def test_lazy_zeros() -> None:
    few = lazy_zeros(1 << 21, np.float32, written=0.05)
    dense = lazy_zeros(1 << 21, np.float32, written=0.9)
    small = lazy_zeros(100, np.float64, written=0.0)
    for a, n, dt in ((few, 1 << 21, np.float32), (dense, 1 << 21, np.float32), (small, 100, np.float64)):
        assert a.shape == (n,) and a.dtype == dt and a.flags.writeable and not a.any()
    assert few.base is not None and dense.base is None  # a mapping only where few pages are written
    few[12345] = 1.5
    assert few.sum() == 1.5


@pytest.mark.parametrize("dtype", [DType.FLOAT32, DType.FLOAT64, DType.FLOAT16])
@pytest.mark.parametrize("inplace", [False, True])
def test_dense_and_sparse_workers_mixed_sum_exactly(dtype: DType, inplace: bool) -> None:
    # A dense worker, a sparse one and an empty one: rounds mix whole payloads (summed in
    # one pass) with partial ones (summed by row), and the short last block is in play.
    rng = np.random.default_rng(7)
    layout = Layout(40 * 16 + 5, 16, 8, 2)
    st = dtype.storage
    dense = rng.integers(-9, 10, layout.length).astype(st)
    sparse_x = sparse(rng, layout.length, 0.2, block=16, dtype=st)
    assert 0 < np.count_nonzero(sparse_x) < layout.length // 2
    inputs = [dense, sparse_x, np.zeros(layout.length, st)]
    want = sum(x.astype(np.float64) for x in inputs)
    _, ops, engine = run_allreduce([x.copy() for x in inputs] if inplace else inputs, dtype, layout.block_size,
                                   layout.message_blocks, layout.streams, inplace=inplace)
    assert engine.active_ops == 0
    for op in ops:
        np.testing.assert_array_equal(op.out.astype(np.float64), want)
        assert (op.out is op.flat) == inplace
    assert ops[0].out.tobytes() == ops[1].out.tobytes() == ops[2].out.tobytes()


def test_single_worker_dense_result_is_its_input() -> None:
    layout = Layout(64 * 8, 8, 8, 2)
    x = np.random.default_rng(3).standard_normal(layout.length).astype(np.float32)
    _, (op,), engine = run_allreduce([x], DType.FLOAT32, layout.block_size, layout.message_blocks, layout.streams)
    assert engine.active_ops == 0
    np.testing.assert_array_equal(op.out, x)


def test_inplace_needs_a_writeable_tensor() -> None:
    x = np.ones(64, np.float32)
    x.flags.writeable = False
    with pytest.raises(ConfigError, match="writeable"):
        WorkerOp("j", 0, 1, 0, x, DType.FLOAT32, Layout(64, 8, 8, 1), inplace=True)


@pytest.mark.parametrize("runs", [
    [[0, 1, 2, 5], [0, 1, 2, 5], [0, 1, 2, 5]],  # every rank the same blocks: the compare shortcut
    [[0, 1, 2, 5], [0, 1, 3, 5]],  # as long, not the same
    [[0, 2], [1, 2, 3], []],
    [[4], [4, 5]],
])
def test_the_union_of_ranks_pointers_and_where_each_rank_is_in_it(runs: list[list[int]]) -> None:
    arrays = [np.array(r, np.int64) for r in runs]
    union = union_sorted(arrays)
    np.testing.assert_array_equal(union, sorted(set().union(*runs)))
    for a in arrays:
        np.testing.assert_array_equal(union[positions(union, a)], a)


def test_a_bye_fails_the_ops_in_flight_only_from_the_connection_that_holds_its_rank() -> None:
    """A rank's connection taken over by a newer one (its process restarted) that then says
    BYE must not fail the new holder's and the other ranks' ops."""
    from omnireduce.protocol import Bye

    eng = Engine(timeout=30.0)
    old, new, r1 = b"old-rank0", b"new-rank0", b"rank1"

    def send(peer: bytes, frames: list) -> list:
        return [(p, decode(wire(f))[0]) for p, f in eng.handle(peer, wire(frames))]

    for peer, rank in ((old, 0), (r1, 1), (new, 0)):
        assert send(peer, encode(Hello("j", rank, 2, 0, ""))) == []
    send(new, start_frames(0, 2, op=0))
    assert not [m for _, m in send(old, encode(Bye("j", 0))) if isinstance(m, Error)]
    out = send(r1, start_frames(1, 2, op=0))
    assert out and not [m for _, m in out if isinstance(m, Error)], out
    # The holder's BYE fails its op 0 and also op 1, which rank 1 started and it never will join.
    send(r1, start_frames(1, 2, op=1))
    errors = {(p, m.op, m.code) for p, m in send(new, encode(Bye("j", 0))) if isinstance(m, Error)}
    assert (r1, 1, ErrorCode.PEER_LOST) in errors and (r1, 0, ErrorCode.PEER_LOST) in errors, errors
