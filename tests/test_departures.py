"""Connections that end while their messages still wait in the aggregator's socket.

The aggregator is stepped by hand (``Aggregator.serve_sockets`` / ``serve_step``), so
that nothing is read until the test has set the scene: which messages are queued,
which connections have closed, which descriptor a new connection got. The book of
ids and connections itself is unit-tested in tests/test_connections.py.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import zmq

from aggregator import Aggregator
from omnireduce.protocol import Bye, Error, ErrorCode, Hello, Result, decode, encode
from tests.helpers import ROOT, child_env, start_frames


@dataclass
class HandServed:
    agg: Aggregator
    poller: zmq.Poller
    ctx: zmq.Context

    def step(self, seconds: float, until: Callable[[], bool] = lambda: False) -> None:
        """Serves for ``seconds``, or until ``until()``."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and not until():
            self.agg.serve_step(dict(self.poller.poll(20)))

    def dealer(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        return s


@contextmanager
def hand_served(timeout: float = 10) -> Iterator[HandServed]:
    agg = Aggregator(listen="tcp://127.0.0.1:0", timeout=timeout)
    poller = zmq.Poller()
    for s in agg.serve_sockets():
        poller.register(s, zmq.POLLIN)
    ctx = zmq.Context()
    try:
        yield HandServed(agg, poller, ctx)
    finally:
        ctx.destroy(linger=0)
        agg.serve_end()
        agg.close()


# The clients of the test below, in a process of their own, so that their own sockets take no
# descriptor of the aggregator's process between A's end and B's connection (Linux hands out
# the lowest free one, so B's connection gets A's).
_LATE_CLIENTS = """
import json, sys, time
import zmq
from omnireduce.protocol import Hello, Result, decode, encode
from tests.helpers import start_frames

address = sys.argv[1]
ctx = zmq.Context()
a, b, c = (ctx.socket(zmq.DEALER) for _ in range(3))
for s in (a, b, c):
    s.setsockopt(zmq.LINGER, 0)
a.connect(address)
for _ in range(6):
    a.send_multipart(encode(Hello("old", 0, 2, 0, "t")))
time.sleep(0.3)
a.close()
time.sleep(0.3)
for rank, s in ((1, b), (0, c)):
    s.connect(address)
    s.send_multipart(encode(Hello("new", rank, 2, 0, "t")))
    s.send_multipart(start_frames(rank, 2, job="new", streams=1))
    time.sleep(0.2)
print("sent", flush=True)
got = {"b": [], "c": []}
deadline = time.monotonic() + 10
while time.monotonic() < deadline and not all("RESULT" in v for v in got.values()):
    for name, s in (("b", b), ("c", c)):
        if s.poll(20):
            m = decode(s.recv_multipart())[0]
            got[name].append("RESULT" if isinstance(m, Result) else f"{type(m).__name__}: {getattr(m, 'message', '')}")
print(json.dumps(got), flush=True)
"""


def test_late_messages_of_a_closed_connection_do_not_evict_the_live_one_on_its_descriptor() -> None:
    # Seen in CI after a flood: a live rank was declared lost. A connection's messages can
    # still be read after it closed, and by then a new connection may hold its descriptor
    # number. Here connection A queues messages and closes before any is read; B and C (a
    # job of 2 ranks) connect, B on A's old descriptor, and do an op while A's late
    # messages are read in between. B must not be taken for gone.
    env = child_env()
    with hand_served() as h:
        clients = subprocess.Popen([sys.executable, "-c", _LATE_CLIENTS, h.agg.address], stdout=subprocess.PIPE,
                                   text=True, env=env, cwd=ROOT)
        try:
            assert clients.stdout is not None
            assert clients.stdout.readline().strip() == "sent"
            stop = threading.Event()
            server = threading.Thread(target=h.step, args=(30, stop.is_set))
            server.start()
            try:
                got = json.loads(clients.stdout.readline())
            finally:
                stop.set()
                server.join(10)
                assert not server.is_alive()
        finally:
            clients.kill()
            clients.wait(10)
        # The scenario happened: A's late messages were read after B had taken A's
        # descriptor (and were dropped).
        assert h.agg.counters.late_dropped >= 1, "no late message was read: the test tests nothing"
        # Each has its op's sum; with the old tracking, C got PEER_LOST naming rank 1 (B).
        assert all(v and set(v) == {"RESULT"} for v in got.values()), got


def test_a_reply_that_cannot_reach_a_closed_connection_does_not_cut_its_bye_short() -> None:
    # Rank 1 sends its last START and a BYE, and closes; its op completes before the BYE is
    # read, and the RESULT to rank 1 fails (no route). Rank 1 left on purpose: it must not
    # count as lost (it did when the failed send declared it gone before its BYE was read).
    with hand_served() as h:
        r0, r1 = h.dealer(), h.dealer()
        for s in (r0, r1):
            s.connect(h.agg.address)
        r1.send_multipart(encode(Hello("j", 1, 2, 0, "t")))
        r0.send_multipart(encode(Hello("j", 0, 2, 0, "t")))
        r0.send_multipart(start_frames(0, 2, streams=1))
        h.step(0.3)  # both bound, the op waits for rank 1
        r1.send_multipart(start_frames(1, 2, streams=1))
        r1.send_multipart(encode(Bye("j", 1)))
        time.sleep(0.2)
        r1.close()
        time.sleep(0.3)
        h.step(1.5)  # past the departure's grace
        assert r0.poll(1000)
        assert isinstance(decode(r0.recv_multipart())[0], Result)
        assert h.agg.counters.send_failures >= 1, "the RESULT to rank 1 did not fail: the test tests nothing"
        assert h.agg.counters.peers_lost == 0


def test_a_worker_that_died_before_its_hello_was_read_fails_the_job_fast(caplog: pytest.LogCaptureFixture) -> None:
    # Its connection's end is read before its first message: the rank is still declared
    # lost (PEER_LOST), rather than the job's op waiting for its timeout.
    caplog.set_level(logging.DEBUG, logger="aggregator.server")
    with hand_served(timeout=30) as h:
        r0, r1 = h.dealer(), h.dealer()
        r0.connect(h.agg.address)
        r0.send_multipart(encode(Hello("j", 0, 2, 0, "t")))
        h.step(5, until=lambda: bool(h.agg._conns.conn_of))
        r1.setsockopt(zmq.LINGER, 2000)  # its HELLO goes out even though it closes at once
        mon = r1.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        r1.connect(h.agg.address)
        assert mon.poll(5000), "rank 1 never connected"
        r1.send_multipart(encode(Hello("j", 1, 2, 0, "t")))
        r1.disable_monitor()
        mon.close()
        r1.close()
        time.sleep(0.5)  # nothing of rank 1 read yet: the monitor's DISCONNECTED comes first
        r0.send_multipart(start_frames(0, 2, op=0))
        h.step(5, until=lambda: bool(r0.poll(0)))
        assert r0.poll(0), "rank 0's op got no answer: it waits for the dead rank 1"
        got = decode(r0.recv_multipart())[0]
        assert isinstance(got, Error) and got.code == ErrorCode.PEER_LOST, got
        assert "rank 1" in got.message
        # The new path ran (else the end was read after the HELLO, as it always could be).
        assert "closed before its first message was read" in caplog.text


def test_a_rank_that_closes_fails_the_ops_it_never_joined_at_once() -> None:
    """An op another rank started that the closing rank had not joined waited for its timeout."""
    import numpy as np

    from omnireduce import PeerLostError
    from worker import Worker

    with Aggregator(listen="tcp://127.0.0.1:0", timeout=30.0).start() as agg:
        ws = [Worker(agg.address, rank=r, world_size=2, job="left-behind", timeout=30) for r in range(2)]
        try:
            x = np.ones(1000, np.float32)
            futs = [w.allreduce_async(x) for w in ws]
            for f in futs:
                assert (f.result(10) == 2).all()
            pending = ws[1].allreduce_async(x)  # rank 0 never joins it
            time.sleep(0.2)
            t0 = time.monotonic()
            ws[0].close()
            with pytest.raises(PeerLostError, match="rank 0 left"):
                pending.result(10)
            assert time.monotonic() - t0 < 5
        finally:
            for w in ws:
                w.close()
