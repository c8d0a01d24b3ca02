"""The engine's caps (in-process, no sockets)."""

from __future__ import annotations

import numpy as np
import pytest

from aggregator import Engine
from aggregator.limits import Limits
from omnireduce.dtypes import DType
from omnireduce.errors import ConfigError
from omnireduce.protocol import ErrorCode
from tests.helpers import error_replies, peer_of, run_allreduce, sparse, start_frames


@pytest.mark.parametrize(
    "limits, start, match",
    [
        (Limits(max_world_size=4), dict(world=5), "world size 5 exceeds"),
        (Limits(max_job_bytes=4096), dict(length=100_000, block_size=1, message_blocks=512), "bytes in flight"),
        (Limits(max_bytes=4096), dict(length=100_000, block_size=1, message_blocks=512), "aggregator would hold"),
        (Limits(max_message_bytes=1024), dict(length=10_000, block_size=64, message_blocks=8), "messages of this op"),
        (Limits(max_streams=2), dict(streams=3), "streams exceed"),
    ],
)
def test_a_start_beyond_a_limit_gets_a_limit_error(limits: Limits, start: dict, match: str) -> None:
    engine = Engine(limits=limits)
    world = start.pop("world", 2)
    (peer, code, message), = error_replies(engine.handle(peer_of(0), start_frames(0, world, **start)))
    assert code == ErrorCode.LIMIT and match in message
    assert engine.active_ops == 0 and engine.held_bytes == 0


def test_a_tensor_shorter_than_its_huge_block_is_not_taken_for_a_huge_message() -> None:
    # 10 elements in one block of 2**20: its messages carry 40 bytes, not 4 MiB.
    engine = Engine(limits=Limits(max_message_bytes=1024))
    assert engine.handle(peer_of(0), start_frames(0, 2, length=10, block_size=1 << 20, message_blocks=1)) == []
    assert engine.active_ops == 1


def test_ops_in_flight_jobs_and_jobs_per_connection_are_capped() -> None:
    engine = Engine(limits=Limits(max_ops_per_job=2, max_jobs=2, max_jobs_per_connection=1))
    assert engine.handle(peer_of(0), start_frames(0, 2, op=0)) == []
    assert engine.handle(peer_of(0), start_frames(0, 2, op=1)) == []
    (_, code, message), = error_replies(engine.handle(peer_of(0), start_frames(0, 2, op=2)))
    assert code == ErrorCode.LIMIT and "ops in flight" in message
    (_, code, message), = error_replies(engine.handle(peer_of(0), start_frames(0, 2, job="other")))
    assert code == ErrorCode.LIMIT and "at most 1 jobs" in message
    assert engine.handle(b"x", start_frames(0, 1, job="k2", length=0)) != []  # completes at once: a RESULT
    (_, code, message), = error_replies(engine.handle(b"y", start_frames(0, 2, job="k3")))
    assert code == ErrorCode.LIMIT and "limit of 2 jobs" in message


def test_an_ops_per_rank_state_is_charged_and_an_eager_op_keeps_no_set_of_ranks_per_stream() -> None:
    """An op of thousands of ranks holds per-rank slots that the byte caps must count (else a
    peer that opens many such ops holds memory no cap sees); an eager op's streams keep no set
    of every rank (4096 ranks x 1024 streams of sets was 250 MiB charged as 0.5 MiB)."""
    world = 4096
    engine = Engine(limits=Limits(max_job_bytes=200_000))
    start = dict(length=64, block_size=64, message_blocks=1, streams=1)  # one block: an eager op
    assert engine.handle(peer_of(0), start_frames(0, world, op=0, **start)) == []
    assert engine.held_bytes >= world * 16
    op = engine._ops[("j", 0)]
    assert all(not s.expected for s in op.streams)
    assert engine.handle(peer_of(0), start_frames(0, world, op=1, **start)) == []
    (_, code, message), = error_replies(engine.handle(peer_of(0), start_frames(0, world, op=2, **start)))
    assert code == ErrorCode.LIMIT and "bytes in flight" in message


def test_an_eager_op_that_times_out_names_the_ranks_it_waits_for() -> None:
    clock = [0.0]
    engine = Engine(timeout=5, clock=lambda: clock[0])
    start = dict(length=16, block_size=8, message_blocks=1, streams=2)  # two eager streams
    for r in range(3):
        engine.handle(peer_of(r), start_frames(r, 3, **start))  # each rank's first stream only: it completes
    clock[0] = 10.0
    out = error_replies(engine.expire())
    assert {code for _, code, _ in out} == {ErrorCode.TIMEOUT} and len(out) == 3
    assert all(message.endswith("waiting for ranks [0, 1, 2]") for _, _, message in out)


def test_an_op_that_times_out_waiting_for_a_rank_refused_at_its_hello_says_why() -> None:
    # The refused rank heard why at once; the others waited and were told only whom for.
    from omnireduce.protocol import Hello, encode
    from tests.helpers import wire

    clock = [0.0]
    engine = Engine(timeout=5, clock=lambda: clock[0])
    engine.handle(peer_of(0), wire(encode(Hello("j", 0, 2, 0, ""))))
    (_, code, message), = error_replies(engine.handle(peer_of(1), wire(encode(Hello("j", 1, 3, 0, "")))))
    assert code == ErrorCode.MISMATCH
    engine.handle(peer_of(0), start_frames(0, 2, length=16, block_size=8))
    clock[0] = 10.0
    (_, code, message), = error_replies(engine.expire())
    assert code == ErrorCode.TIMEOUT and message.endswith(
        "waiting for ranks [1]; rank 1 was refused when it joined (MISMATCH: rank 1 says the job has 3 workers, "
        "the job has 2)")
    # Joined since, it is not named again.
    engine.handle(b"rank1-again", wire(encode(Hello("j", 1, 2, 0, ""))))
    engine.handle(peer_of(0), start_frames(0, 2, length=16, block_size=8, op=1))
    clock[0] = 20.0
    (_, _, message), = error_replies(engine.expire())
    assert message.endswith("waiting for ranks [1]")


def test_held_bytes_are_counted_and_given_back() -> None:
    engine = Engine()
    rng = np.random.default_rng(2)
    xs = [sparse(rng, 5000, 0.5, block=1, low=-5, high=5) for _ in range(3)]
    outs, _, _ = run_allreduce(xs, DType.FLOAT32, block_size=16, engine=engine)
    np.testing.assert_array_equal(outs[0], xs[0] + xs[1] + xs[2])
    assert engine.held_bytes == 0 and engine.peak_held_bytes > 3 * 8 * 16  # tables and blocks were held


def test_limits_are_validated() -> None:
    with pytest.raises(ConfigError, match="max_jobs"):
        Limits(max_jobs=0)
    with pytest.raises(ConfigError, match="max_world_size"):
        Limits(max_world_size=1 << 20)


def test_an_op_holds_what_its_nonzero_blocks_need_not_what_its_columns_do() -> None:
    # 1,000,000 columns (one block each), three ranks with a few blocks, partly shared:
    # the tables cover the union of the named columns, not ranks x columns (27 MB here).
    engine = Engine()
    n = 1_000_000
    xs = [np.zeros(n, np.float32) for _ in range(3)]
    for r, x in enumerate(xs):
        x[[5, 77 + r, 999_999 - r, 500_000]] = r + 1.0
    outs, _, _ = run_allreduce(xs, DType.FLOAT32, block_size=1, message_blocks=n // 2, streams=2, engine=engine)
    for out in outs:
        np.testing.assert_array_equal(out, xs[0] + xs[1] + xs[2])
    assert engine.held_bytes == 0
    # 8 distinct columns x 3 ranks x 9 bytes, plus the fixed overheads and the blocks.
    assert engine.peak_held_bytes < 64 << 10
