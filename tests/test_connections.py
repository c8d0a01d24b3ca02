"""The aggregator's book of routing ids and connections (aggregator/connections.py),
driven by hand: the orders of monitor events and messages that once had a live rank
declared lost, and the ones around them. tests/test_reliability.py runs the case
end to end over sockets."""

from __future__ import annotations

from aggregator.connections import Connections, is_generated, issued_before


def gen(n: int) -> bytes:
    """A routing id as the ROUTER generates them: a zero byte and a 32-bit counter."""
    return b"\x00" + (n % (1 << 32)).to_bytes(4, "big")


A, B, C = gen(100), gen(101), gen(102)
FD = 20


def test_issue_order_of_generated_ids_wraps_and_ignores_ids_of_a_peers_own() -> None:
    assert issued_before(A, B) and not issued_before(B, A) and not issued_before(A, A)
    assert issued_before(gen(0xFFFFFFFF), gen(0))  # the counter wrapped between them
    assert not issued_before(gen(0), gen(0xFFFFFFFF))
    assert is_generated(A) and not is_generated(b"worker-7") and not is_generated(b"\x01abcd")
    assert not issued_before(b"worker-7", A) and not issued_before(A, b"worker-7")


def test_a_late_message_read_after_the_new_connection_is_dropped_and_the_live_id_kept() -> None:
    # A's connection on FD closed before any of its messages was read; B now holds FD and
    # was tracked; then A's late message comes.
    c = Connections()
    c.accepted(FD)
    assert c.disconnected(FD) == []  # nothing tracked on it yet
    c.accepted(FD)
    assert c.track(B, FD) == (True, [])
    assert c.track(A, FD) == (False, [])
    assert c.conn_of == {B: (FD, 2)} and c.is_gone(A)
    # B's connection ends: B is departing, A stays gone.
    assert c.disconnected(FD) == [B] and c.departing == {B}


def test_a_late_message_read_first_is_taken_for_gone_once_the_live_id_comes() -> None:
    # The same, A's late message read before B's first: A cannot be told apart until B comes.
    c = Connections()
    c.accepted(FD)
    c.disconnected(FD)
    c.accepted(FD)
    assert c.track(A, FD) == (True, [])
    assert c.track(B, FD) == (True, [A])  # the caller declares A gone
    c.forget(A)
    assert c.is_gone(A) and c.conn_of == {B: (FD, 2)}
    assert c.disconnected(FD) == [B]


def test_a_departing_id_is_not_tracked_again_and_is_dropped_once_gone() -> None:
    c = Connections()
    c.accepted(FD)
    c.track(A, FD)
    assert c.disconnected(FD) == [A] and c.departing == {A} and A not in c.conn_of
    c.accepted(FD)
    c.track(B, FD)
    c.forget(A)  # declared once its last messages were read
    assert c.is_gone(A) and not c.departing and c.conn_of == {B: (FD, 2)}


def test_ids_of_a_peers_own_are_never_evicted_on_a_guess_and_may_come_back() -> None:
    # The order of two ids a peer chose cannot be told: both stay on the connection, and the
    # connection's end takes both.
    c = Connections()
    c.accepted(FD)
    assert c.track(b"live", FD) == (True, [])
    assert c.track(b"late", FD) == (True, [])
    assert c.disconnected(FD) == [b"late", b"live"]
    c.forget(b"live")
    # A peer that chose its id may reconnect with it: never dropped.
    assert not c.is_gone(b"live")
    c.accepted(FD)
    assert c.track(b"live", FD) == (True, [])


def test_ids_without_a_descriptor_and_the_bound_on_gone_ids() -> None:
    c = Connections()
    assert c.track(A, None) == (True, [])
    assert c.conn_of == {A: None}
    c.forget(A)
    assert c.is_gone(A) and not c.conn_of
    for n in range(20_000):
        c.forget(gen(1000 + n))
    assert not c.is_gone(A) and c.is_gone(gen(1000 + 19_999))


_FIRST_ID = """
import time, zmq
from aggregator import Aggregator
from omnireduce.protocol import Hello, encode
agg = Aggregator(listen="tcp://127.0.0.1:0").start()
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 0)
s.connect(agg.address)
s.send_multipart(encode(Hello("j", 0, 2, 0, "t")))
deadline = time.monotonic() + 10
while not agg._conns.conn_of and time.monotonic() < deadline:
    time.sleep(0.01)
print(next(iter(agg._conns.conn_of)).hex())
s.close()
agg.close()
ctx.term()
"""


def test_the_generated_ids_start_where_no_client_can_guess() -> None:
    # libzmq starts its counter at an unseeded rand(): the same ids in every process, so a
    # client could take the next one and make libzmq abort the aggregator when it comes.
    import subprocess
    import sys

    from tests.helpers import ROOT, child_env

    env = child_env()
    firsts = [
        subprocess.run([sys.executable, "-c", _FIRST_ID], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=60).stdout.strip()
        for _ in range(2)
    ]
    assert all(len(f) == 10 and f.startswith("00") for f in firsts), firsts
    assert firsts[0] != firsts[1] and "006b8b4567" not in firsts


def test_an_id_first_read_after_its_connection_ended_is_departing() -> None:
    # A worker that connected, sent its HELLO and died before the aggregator read anything:
    # the end is known before the id is, and the id must still be declared.
    c = Connections()
    c.accepted(FD)
    assert c.disconnected(FD) == []
    assert c.track(A, FD) == (True, [])
    assert c.departing == {A} and A not in c.conn_of
    c.accepted(FD)  # the next connection on the descriptor is open
    assert c.track(B, FD) == (True, []) and c.conn_of == {B: (FD, 2)} and c.departing == {A}


def test_a_late_hello_of_an_older_connection_never_takes_the_rank_back() -> None:
    # A worker's connection died before its HELLO was read; the worker connected again, and
    # the new connection's HELLO was read first. The old HELLO, read late, must not take the
    # rank back: its connection is then declared gone, and the rank would be lost.
    from aggregator import Engine
    from omnireduce.protocol import Error, ErrorCode, Hello, Result, decode, encode
    from tests.helpers import start_frames, wire

    engine = Engine()
    r0, old, new = gen(1), gen(2), gen(3)
    engine.handle(r0, wire(encode(Hello("j", 0, 2, 0, "t"))))
    assert engine.handle(new, wire(encode(Hello("j", 1, 2, 0, "t")))) == []
    [(peer, frames)] = engine.handle(old, wire(encode(Hello("j", 1, 2, 0, "t"))))
    msg = decode(wire(frames))[0]
    assert peer == old and isinstance(msg, Error) and msg.code == ErrorCode.STALE
    assert engine.peer_gone(old) == [] and engine.counters.peers_lost == 0
    out = engine.handle(r0, start_frames(0, 2, op=0, streams=1))
    out += engine.handle(new, start_frames(1, 2, op=0, streams=1))
    assert {p for p, _ in out} == {r0, new}
    assert all(isinstance(decode(wire(f))[0], Result) for _, f in out)
    # The other order (the newer connection's HELLO read last) was always fine: it takes over.
    engine.handle(gen(4), wire(encode(Hello("k", 0, 1, 0, "t"))))
    assert engine.handle(gen(5), wire(encode(Hello("k", 0, 1, 0, "t")))) == []
    assert engine.peer_gone(gen(4)) == []
    assert engine.job_info("k")["ranks"] == [0] and engine.job_info("k")["lost"] == {}


def test_a_context_of_several_io_threads_is_refused() -> None:
    # The book relies on one I/O thread's order of events and messages.
    import pytest
    import zmq

    from aggregator import Aggregator
    from omnireduce.errors import ConfigError

    ctx = zmq.Context(io_threads=2)
    try:
        with pytest.raises(ConfigError, match="one I/O thread"):
            Aggregator(listen="tcp://127.0.0.1:0", context=ctx)
    finally:
        ctx.term()
