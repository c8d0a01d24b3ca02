"""The engine's caps, and how it treats ranks that go away (in-process, no sockets)."""

from __future__ import annotations

import numpy as np
import pytest

from aggregator import Engine
from aggregator.limits import Limits
from omnireduce.dtypes import DType
from omnireduce.errors import ConfigError
from omnireduce.layout import Layout
from omnireduce.protocol import Bye, Error, ErrorCode, Hello, Start, decode, encode
from tests.loopback import peer_of, run_allreduce, wire
from worker.op import WorkerOp


def _start(rank: int, world: int, op: int = 0, job: str = "j", length: int = 64, **kw) -> list[bytes]:
    layout = Layout(length, kw.get("block_size", 8), kw.get("message_blocks", 4), kw.get("streams", 2))
    dtype = kw.get("dtype", DType.FLOAT32)
    return wire(WorkerOp(job, rank, world, op, np.ones(length, dtype.storage), dtype, layout).start())


def _codes(out) -> list[tuple[bytes, ErrorCode, str]]:
    got = []
    for peer, frames in out:
        msg, _ = decode(wire(frames))
        assert isinstance(msg, Error)
        got.append((peer, ErrorCode(msg.code), msg.message))
    return got


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
    (peer, code, message), = _codes(engine.handle(peer_of(0), _start(0, world, **start)))
    assert code == ErrorCode.LIMIT and match in message
    assert engine.active_ops == 0 and engine.held_bytes == 0


def test_ops_in_flight_jobs_and_jobs_per_connection_are_capped() -> None:
    engine = Engine(limits=Limits(max_ops_per_job=2, max_jobs=2, max_jobs_per_connection=1))
    assert engine.handle(peer_of(0), _start(0, 2, op=0)) == []
    assert engine.handle(peer_of(0), _start(0, 2, op=1)) == []
    (_, code, message), = _codes(engine.handle(peer_of(0), _start(0, 2, op=2)))
    assert code == ErrorCode.LIMIT and "ops in flight" in message
    (_, code, message), = _codes(engine.handle(peer_of(0), _start(0, 2, job="other")))
    assert code == ErrorCode.LIMIT and "at most 1 jobs" in message
    assert engine.handle(b"x", _start(0, 1, job="k2", length=0)) != []  # completes at once: a RESULT
    (_, code, message), = _codes(engine.handle(b"y", _start(0, 2, job="k3")))
    assert code == ErrorCode.LIMIT and "limit of 2 jobs" in message


def test_held_bytes_are_counted_and_given_back() -> None:
    engine = Engine()
    rng = np.random.default_rng(2)
    xs = [np.where(rng.random(5000) < 0.5, rng.integers(-5, 6, 5000), 0).astype(np.float32) for _ in range(3)]
    outs, _, _ = run_allreduce(xs, DType.FLOAT32, block_size=16, engine=engine)
    np.testing.assert_array_equal(outs[0], xs[0] + xs[1] + xs[2])
    assert engine.held_bytes == 0 and engine.peak_held_bytes > 3 * 8 * 16  # tables and blocks were held


def test_limits_are_validated() -> None:
    with pytest.raises(ConfigError, match="max_jobs"):
        Limits(max_jobs=0)
    with pytest.raises(ConfigError, match="max_world_size"):
        Limits(max_world_size=1 << 20)


def test_a_lost_rank_fails_ops_now_and_later_until_it_returns() -> None:
    engine = Engine()
    assert engine.handle(peer_of(1), wire(encode(Hello("j", 1, 3, 0, "")))) == []
    engine.handle(peer_of(0), _start(0, 3, op=0))
    errs = _codes(engine.peer_gone(peer_of(1), "disconnected"))
    assert errs == [(peer_of(0), ErrorCode.PEER_LOST, "rank 1 disconnected")]
    assert engine.job_info("j")["lost"] == {1: "disconnected"}
    (_, code, message), = _codes(engine.handle(peer_of(2), _start(2, 3, op=1)))
    assert code == ErrorCode.PEER_LOST and "rank 1 disconnected" in message
    # Rank 1 comes back on a new connection: new ops work again.
    engine.handle(b"rank1-again", wire(encode(Hello("j", 1, 3, 0, ""))))
    assert engine.job_info("j")["lost"] == {}
    assert engine.handle(peer_of(0), _start(0, 3, op=2)) == []


def test_bye_leaves_without_counting_as_lost() -> None:
    engine = Engine()
    for r in range(2):
        engine.handle(peer_of(r), wire(encode(Hello("j", r, 2, 0, ""))))
    engine.handle(peer_of(0), _start(0, 2, op=0))
    # Rank 0 closes its worker on purpose: the op it joined fails; rank 0 is not "lost".
    errs = _codes(engine.handle(peer_of(0), wire(encode(Bye("j", 0)))))
    assert errs == [(peer_of(0), ErrorCode.PEER_LOST, "rank 0 left (its worker was closed)")]
    assert engine.job_info("j")["lost"] == {} and engine.job_info("j")["ranks"] == [1]
    assert engine.peer_gone(peer_of(0)) == []
    engine.handle(peer_of(1), wire(encode(Bye("j", 1))))
    assert engine.job_info("j") is None  # nobody left: the job (and its token) is forgotten


def test_start_for_a_job_of_another_size_is_a_mismatch() -> None:
    engine = Engine()
    engine.handle(peer_of(0), wire(encode(Hello("j", 0, 2, 0, ""))))
    frames = wire(encode(Start("j", 1, 3, 0, 8, int(DType.FLOAT32), 8, 1, 1), np.zeros(1, np.int64)))
    (_, code, message), = _codes(engine.handle(peer_of(1), frames))
    assert code == ErrorCode.MISMATCH and "the job has 2" in message
