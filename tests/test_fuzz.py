"""Hostile input: >10,000 generated malformed messages and a flood, then a legitimate job must still be right.

The bulk of the fuzzing drives the engine in-process (fast, with a fake clock so
ops also expire); a second part sends generated messages over a real socket to an
aggregator daemon process, whose memory is measured. The flood has many peers
sending as fast as they can to a job that never completes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from aggregator import Engine
from aggregator.limits import Limits
from omnireduce.dtypes import DType
from omnireduce.layout import INF, Layout
from omnireduce.protocol import PROTOCOL_VERSION, Error, ErrorCode, Hello, MsgType, Result, Start, decode, encode
from tests.helpers import run_allreduce, sparse, wire
from worker import Worker

SMALL = Limits(
    max_jobs=8, max_world_size=16, max_ops_per_job=4, max_job_bytes=1 << 20, max_bytes=4 << 20,
    max_message_bytes=1 << 18, max_streams=16, max_jobs_per_connection=4,
)
FUZZ_SETTINGS = settings(
    deadline=None, database=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
FIELDS = [
    "v", "t", "job", "rank", "world_size", "op", "length", "dtype", "block_size", "message_blocks", "streams",
    "stream", "round", "generation", "token", "code", "message", "ranks",
]
# Jobs with their world sizes (a mismatching world size is drawn now and then too).
JOBS = {"j0": 1, "j1": 2, "j2": 3, "tok": 2}

odd_values = st.one_of(
    st.integers(-(2**70), 2**70), st.sampled_from([-1, 0, 1, 2**31, 2**62, 2**63 - 1, 2**64]), st.none(),
    st.booleans(), st.floats(allow_nan=True), st.text(max_size=300), st.binary(max_size=16),
    st.lists(st.integers(-3, 3), max_size=4), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
small = st.integers(0, 5)


@st.composite
def plausible_header(draw: Any) -> dict[str, Any]:
    """A header of a real type with plausible (small) values: these reach deep into the engine."""
    t = draw(st.sampled_from(list(MsgType)))
    job = draw(st.sampled_from(sorted(JOBS)))
    h: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": int(t), "job": job}
    world = JOBS[job] if draw(st.integers(0, 9)) else draw(st.integers(1, 4))
    if t in (MsgType.HELLO, MsgType.START, MsgType.BLOCKS):
        h["rank"] = draw(st.integers(0, world - 1))
    if t in (MsgType.HELLO, MsgType.START):
        h["world_size"] = world
    if t == MsgType.HELLO:
        h["generation"] = 0 if draw(st.integers(0, 9)) else draw(st.integers(1, 2))
        h["token"] = ("secret" if job == "tok" else "") if draw(st.integers(0, 4)) else "wrong"
    if t in (MsgType.START, MsgType.BLOCKS, MsgType.RESULT, MsgType.ERROR):
        h["op"] = draw(small)
    if t == MsgType.START:
        h.update(
            length=draw(st.integers(0, 4000)), dtype=draw(st.integers(1, 4)), block_size=draw(st.integers(1, 64)),
            message_blocks=draw(st.integers(1, 16)), streams=draw(st.integers(1, 4)),
        )
    if t in (MsgType.BLOCKS, MsgType.RESULT):
        h.update(stream=draw(st.integers(0, 3)), round=draw(st.integers(0, 3)))
    if t == MsgType.ERROR:
        h.update(code=draw(st.integers(0, 12)), message="x", ranks=[])
    return h


@st.composite
def message(draw: Any) -> list[bytes]:
    """One malformed (or, rarely, accidentally valid) message as raw frames."""
    kind = draw(st.sampled_from(["raw", "mutated", "plausible", "plausible", "plausible"]))
    if kind == "raw":
        return draw(st.lists(st.binary(max_size=80), min_size=int(draw(st.integers(0, 9)) > 0), max_size=4))
    header = draw(plausible_header())
    if kind == "mutated":
        for _ in range(draw(st.integers(1, 3))):
            op = draw(st.sampled_from(["drop", "set", "add"]))
            name = draw(st.sampled_from(FIELDS))
            if op == "drop":
                header.pop(name, None)
            else:
                header[name if op == "set" else name + "_x"] = draw(odd_values)
    try:
        head = msgpack.packb(header)
    except (TypeError, ValueError, OverflowError):
        head = draw(st.binary(max_size=40))
    if draw(st.integers(0, 9)) == 0:
        head = head[: draw(st.integers(0, len(head)))]  # truncated header
    frames = [head]
    if kind == "plausible" and header["t"] == MsgType.START and draw(st.booleans()):
        # Pointers that fit the layout: the op is created, and with no pointers it may complete.
        layout = Layout(header["length"], header["block_size"], header["message_blocks"], header["streams"])
        ptrs = np.arange(layout.num_columns, dtype=np.int64)
        if draw(st.booleans()):
            ptrs = ptrs[:0]  # no nonzero block at all
        return [head, ptrs.tobytes()]
    for _ in range(draw(st.integers(0, 3))):
        choice = draw(st.integers(0, 3))
        if choice == 0:
            frames.append(draw(st.binary(max_size=200)))
        elif choice == 1:  # plausible block pointers (some valid, some INF, some outside)
            n = draw(st.integers(0, 70))
            ptrs = draw(st.lists(st.sampled_from([0, 1, 2, 3, 7, 64, 100, int(INF), -5]), min_size=n, max_size=n))
            frames.append(np.array(ptrs, np.int64).tobytes())
        elif choice == 2:  # an index frame that is a column range: valid START pointers for many layouts
            frames.append(np.arange(draw(st.integers(0, 70)), dtype=np.int64).tobytes())
        else:
            frames.append(bytes(draw(st.integers(0, 5000))))
    return frames


def _check_replies(out: list[tuple[bytes, list[Any]]]) -> None:
    for _, frames in out:
        msg, _ = decode(wire(frames), max_header_bytes=1 << 17)
        # A heartbeat is answered with one that asks for no answer.
        assert isinstance(msg, (Error, Result)) or (msg.TYPE == MsgType.HEARTBEAT and msg.reply), msg


def test_fuzz_engine_then_a_legitimate_job() -> None:
    now = [0.0]
    engine = Engine(timeout=3.0, clock=lambda: now[0], limits=SMALL)
    peers = [b"p0", b"p1", b"p2", b"p3", b"p4"]
    sent = [0]

    @settings(FUZZ_SETTINGS, max_examples=200)
    @given(st.lists(st.tuples(st.sampled_from(peers), message()), min_size=40, max_size=40))
    def batch(msgs: list[tuple[bytes, list[bytes]]]) -> None:
        for peer, frames in msgs:
            _check_replies(engine.handle(peer, frames))
            sent[0] += 1
            assert engine.held_bytes <= SMALL.max_bytes
            assert engine.active_jobs <= SMALL.max_jobs
            assert engine.active_ops <= SMALL.max_jobs * SMALL.max_ops_per_job
        now[0] += 1.0
        _check_replies(engine.expire())
        if now[0] % 5 == 0:  # connections come and go; jobs nobody is connected to are forgotten
            for p in peers:
                _check_replies(engine.peer_gone(p))

    batch()
    c = engine.counters
    print(f"\nengine fuzz: {sent[0]} messages; ops started {c.ops_started}, completed {engine.ops_completed}, "
          f"rounds {c.rounds}; errors {dict(sorted(c.errors.items()))}")
    assert sent[0] >= 8000
    # The fuzz reaches deep: ops are created and some even complete.
    assert c.ops_started > 50 and c.rounds > 0
    assert engine.counters.errors.get("internal", 0) == 0, "the fuzz hit an internal error (a bug)"
    assert engine.peak_held_bytes <= SMALL.max_bytes
    # Everything held is given back: ops time out, connections go.
    now[0] += 10
    _check_replies(engine.expire())
    for p in peers:
        _check_replies(engine.peer_gone(p))
    assert (engine.active_ops, engine.held_bytes, engine.active_jobs) == (0, 0, 0)
    # And the engine still sums right.
    rng = np.random.default_rng(0)
    xs = [sparse(rng, 3000, 0.3, block=1, low=-9, high=9) for _ in range(3)]
    outs, _, _ = run_allreduce(xs, DType.FLOAT32, block_size=16, job="legit", engine=engine)
    for out in outs:
        np.testing.assert_array_equal(out, xs[0] + xs[1] + xs[2])


# Against a live daemon process.


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024  # type: ignore[union-attr]


class Daemon:
    def __init__(self, *args: str) -> None:
        exe = shutil.which("omnireduce-aggregator", path=os.path.dirname(sys.executable))
        assert exe, "the omnireduce-aggregator console script is not installed"
        self.proc = subprocess.Popen(
            [exe, "--listen", "tcp://127.0.0.1:0", "--metrics-port", "0", "--log-level", "info", *args],
            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.log: list[str] = []
        self.address = self.metrics = ""
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            if m := re.search(r"metrics on (http://\S+)", line):
                self.metrics = m.group(1)
            if m := re.search(r"listening on (tcp://127\.0\.0\.1:\d+)", line):
                self.address = m.group(1)
                break
        assert self.address and self.metrics, "".join(self.log)
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()  # type: ignore

    def metric(self, name: str, **labels: str) -> float:
        text = urllib.request.urlopen(self.metrics, timeout=5).read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "omnireduce_aggregator_" + name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0

    def close(self) -> None:
        alive = self.proc.poll() is None
        self.proc.terminate()
        self.proc.wait(10)
        assert alive, "daemon died: " + "".join(self.log[-50:])


@pytest.fixture
def small_daemon() -> Iterator[Daemon]:
    d = Daemon(
        "--timeout", "2", "--max-jobs", "8", "--max-world-size", "16", "--max-ops-per-job", "4",
        "--max-job-bytes", str(1 << 20), "--max-bytes", str(4 << 20), "--max-message-bytes", str(1 << 18),
        "--max-queued-messages", "64",
    )
    yield d
    d.close()


def _legit_job(address: str, job: str) -> None:
    rng = np.random.default_rng(1)
    xs = [sparse(rng, 50_000, 0.2, block=1, low=-9, high=9) for _ in range(2)]
    ws = [
        Worker(address, rank=r, world_size=2, job=job, timeout=30, block_size=64, message_blocks=64) for r in range(2)
    ]
    try:
        futs = [w.allreduce_async(x) for w, x in zip(ws, xs, strict=True)]
        for f in futs:
            np.testing.assert_array_equal(f.result(30), xs[0] + xs[1])
    finally:
        for w in ws:
            w.close()


def test_fuzz_live_daemon_then_a_legitimate_job(small_daemon: Daemon) -> None:
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.DEALER) for _ in range(3)]
    for s in socks:
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.connect(small_daemon.address)
    sent, replies = [0], [0]

    def drain() -> None:
        for s in socks:
            while s.poll(0):
                msg, _ = decode(s.recv_multipart(), max_header_bytes=1 << 17)
                # Heartbeats: the daemon's own, and its answers to the fuzz's.
                assert isinstance(msg, (Error, Result)) or msg.TYPE == MsgType.HEARTBEAT, msg
                replies[0] += 1

    # Warm up (imports, first allocations) before the baseline.
    _legit_job(small_daemon.address, "warmup")
    base = _rss(small_daemon.proc.pid)

    @settings(FUZZ_SETTINGS, max_examples=50)
    @given(st.lists(st.tuples(st.integers(0, 2), message()), min_size=50, max_size=50))
    def batch(msgs: list[tuple[int, list[bytes]]]) -> None:
        for i, frames in msgs:
            if frames:  # ZeroMQ cannot send a message of no frames
                socks[i].send_multipart(frames)
                sent[0] += 1
        drain()

    try:
        batch()
        # A frame over --max-message-bytes: ZeroMQ drops that connection, the daemon goes on.
        socks[0].send_multipart([encode(Hello("big", 0, 1, 0, ""))[0], bytes((1 << 18) + 1)])
        time.sleep(0.5)
        drain()
    finally:
        for s in socks:
            s.close()
        ctx.term()
    grown = _rss(small_daemon.proc.pid) - base
    print(f"\nlive fuzz: {sent[0]} messages, {replies[0]} replies, daemon RSS grew {grown / 2**20:.1f} MiB")
    assert sent[0] >= 2000
    assert replies[0] > sent[0] // 2  # bad messages are answered, not dropped
    assert grown < 64 << 20
    assert small_daemon.metric("errors_total", kind="internal") == 0
    assert small_daemon.metric("peak_held_bytes") <= 4 << 20
    _legit_job(small_daemon.address, "after-fuzz")


def test_flood_stays_under_the_caps_and_times_out_cleanly(small_daemon: Daemon) -> None:
    job, world, missing = "flood", 8, 7
    ctx = zmq.Context()
    counts = [0] * missing
    # 8192 columns: every op holds about 8 x 8192 x 9 bytes of tables, so the 1 MiB job cap
    # admits one op and refuses the next ones.
    length, block, mblocks, streams = 8192 * 16, 16, 1024, 8
    pointers = np.arange(8192, dtype=np.int64)
    errors: list[Error] = []
    timed_out = threading.Event()

    def flooder(rank: int) -> None:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.connect(small_daemon.address)
        s.send_multipart(encode(Hello(job, rank, world, 0, "flood-token")))
        op, deadline = 0, time.monotonic() + 2.5
        while time.monotonic() < deadline and counts[rank] < 4000:
            try:
                s.send_multipart(
                    encode(Start(job, rank, world, op, length, int(DType.FLOAT32), block, mblocks, streams), pointers),
                    flags=zmq.NOBLOCK,
                )
            except zmq.Again:
                time.sleep(0.001)  # back-pressure: the daemon reads no faster
                continue
            counts[rank] += 1
            op += 1
        if rank == 0:  # an op that was admitted times out, naming the rank that never came
            end = time.monotonic() + 8
            while time.monotonic() < end and not timed_out.is_set():
                if s.poll(200):
                    msg, _ = decode(s.recv_multipart(), max_header_bytes=1 << 17)
                    if isinstance(msg, Error) and msg.code == ErrorCode.TIMEOUT:
                        errors.append(msg)
                        timed_out.set()
            timed_out.set()
        else:
            # Stay connected: a peer that leaves fails the job's ops (PEER_LOST) before they time out.
            timed_out.wait(10)
        s.close()

    base = _rss(small_daemon.proc.pid)
    peak = [base]
    threads = [threading.Thread(target=flooder, args=(r,)) for r in range(missing)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak[0] = max(peak[0], _rss(small_daemon.proc.pid))
        time.sleep(0.05)
    for t in threads:
        t.join()
    ctx.term()
    grown = (peak[0] - base) / 2**20
    print(f"\nflood: {sum(counts)} STARTs of {8 * 8192} bytes from {missing} peers; daemon RSS peak +{grown:.1f} MiB; "
          f"peak held {small_daemon.metric('peak_held_bytes') / 2**20:.2f} MiB")
    assert sum(counts) >= 1000
    assert small_daemon.metric("peak_held_bytes") <= 1 << 20
    assert small_daemon.metric("errors_total", kind="limit") > 0
    assert errors and errors[0].ranks == [missing] and "waiting for ranks [7]" in errors[0].message
    assert grown < 128
    deadline = time.monotonic() + 10
    while small_daemon.metric("active_ops") or small_daemon.metric("held_bytes"):
        assert time.monotonic() < deadline, "ops of the flood were not freed"
        time.sleep(0.1)
    try:
        _legit_job(small_daemon.address, "after-flood")
    except Exception as e:
        # Seen once in CI (a live rank declared lost): the daemon's own account is the evidence,
        # read from its stderr by a thread.
        time.sleep(0.3)
        raise AssertionError(f"the job after the flood failed: {e!r}; the daemon's log ends:\n"
                             + "".join(small_daemon.log[-60:])) from e
