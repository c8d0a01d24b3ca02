"""Job tokens and CURVE: the wrong token, key or no key is refused; the right ones work; the wire is encrypted."""

from __future__ import annotations

import logging
import os
import select
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from aggregator import Aggregator, Engine
from aggregator.limits import Limits
from omnireduce import auth
from omnireduce.dtypes import DType
from omnireduce.errors import AuthError, ConfigError, ProtocolError
from omnireduce.layout import Layout
from omnireduce.protocol import MAX_ERROR_HEADER_BYTES, Blocks, Bye, Error, ErrorCode, Hello, decode, encode
from tests.helpers import peer_of, start_frames, wire
from worker import Worker
from worker.op import WorkerOp

# A value whose bytes are easy to find on the wire.
MARK = np.float32(1234.5677)


def _refused_fast(w: Worker, cls: type[Exception] = AuthError, match: str = "") -> float:
    t = time.monotonic()
    with pytest.raises(cls, match=match):
        w.allreduce(np.ones(8, np.float32))
    return time.monotonic() - t


# Job tokens.


def test_wrong_token_is_refused_and_the_job_is_untouched() -> None:
    with Aggregator(timeout=20).start() as agg:
        owner = Worker(agg.address, rank=0, world_size=2, job="tenant-a", token="alpha", timeout=30)
        fut = owner.allreduce_async(np.full(1000, 2.0, np.float32))  # op 0 waits for rank 1
        deadline = time.monotonic() + 10
        while not (agg.engine.job_info("tenant-a") or {}).get("ops") and time.monotonic() < deadline:
            time.sleep(0.02)
        for token in ("beta", ""):
            with Worker(agg.address, rank=1, world_size=2, job="tenant-a", token=token, timeout=30) as intruder:
                assert _refused_fast(intruder, match="wrong job token") < 5
        info = agg.engine.job_info("tenant-a")
        assert info["ranks"] == [0] and info["ops"] == [0] and not fut.done()
        with Worker(agg.address, rank=1, world_size=2, job="tenant-a", token="alpha", timeout=30) as member:
            np.testing.assert_array_equal(member.allreduce(np.full(1000, 3.0, np.float32)), np.full(1000, 5.0))
        np.testing.assert_array_equal(fut.result(10), np.full(1000, 5.0))
        assert agg.counters.errors.get("auth", 0) >= 2
        owner.close()


def test_engine_refuses_connections_without_the_token() -> None:
    engine = Engine()
    assert engine.handle(peer_of(0), wire(encode(Hello("t", 0, 2, 0, "s3cret")))) == []
    layout = Layout(64, 8, 4, 2)
    start1 = WorkerOp("t", 1, 2, 0, np.ones(64, np.float32), DType.FLOAT32, layout).start()[0]
    # No HELLO (an old-style client): the job has a token, so START is refused.
    (peer, reply), = engine.handle(b"intruder", wire(start1))
    msg, _ = decode(wire(reply))
    assert peer == b"intruder" and isinstance(msg, Error) and msg.code == ErrorCode.AUTH
    # A BLOCKS claiming rank 0 from another connection is refused too, and touches nothing.
    (peer, reply), = engine.handle(b"intruder", wire(encode(Blocks("t", 0, 0, 0, 1), np.zeros(0, np.int64), b"")))
    assert decode(wire(reply))[0].code == ErrorCode.AUTH
    assert engine.job_info("t")["ranks"] == [0] and engine.job_info("t")["ops"] == []
    # A bound connection cannot speak for another rank.
    start0 = WorkerOp("t", 1, 2, 0, np.ones(64, np.float32), DType.FLOAT32, layout).start()[0]
    (_, reply), = engine.handle(peer_of(0), wire(start0))
    assert decode(wire(reply))[0].code == ErrorCode.PROTOCOL
    assert engine.ops_failed == 0 and engine.active_ops == 0


def _error_code(out: list[Any]) -> list[Any]:
    return [getattr(decode(wire(frames))[0], "code", None) for _, frames in out]


def test_a_connection_whose_rank_was_taken_over_speaks_for_it_no_more() -> None:
    engine = Engine()
    old, new, r1, victim = b"old", b"new", b"r1", b"victim"
    engine.handle(old, wire(encode(Hello("j", 0, 2, 0, "a"))))
    assert engine.handle(new, wire(encode(Hello("j", 0, 2, 0, "a")))) == []  # takes rank 0 over
    engine.handle(r1, wire(encode(Hello("j", 1, 2, 0, "a"))))
    # The replaced connection's START is refused and joins nothing (before, it was summed, and
    # the rank's holder then waited out its timeout for an op already done).
    assert _error_code(engine.handle(old, start_frames(0, 2, op=0))) == [ErrorCode.STALE]
    assert engine.job_info("j")["ops"] == []
    # Every member leaves: the job is forgotten, and another tenant makes one of that name with
    # another token. The old connection, still open, must not sum into it.
    engine.peer_gone(new)
    engine.peer_gone(r1)
    assert engine.job_info("j") is None
    engine.handle(victim, wire(encode(Hello("j", 1, 2, 0, "b"))))
    assert engine.handle(victim, start_frames(1, 2, op=0)) == []
    assert _error_code(engine.handle(old, start_frames(0, 2, op=0))) == [ErrorCode.STALE]
    assert engine.job_info("j")["ranks"] == [1] and engine.job_info("j")["ops"] == [0]
    assert engine.active_ops == 1 and engine.ops_completed == 0


def test_a_refused_hello_of_a_newer_generation_does_not_restart_the_job() -> None:
    engine = Engine(limits=Limits(max_jobs_per_connection=1))
    a, b = b"a", b"b"
    engine.handle(a, wire(encode(Hello("A", 0, 2, 0, "t"))))
    assert engine.handle(a, start_frames(0, 2, op=0, job="A")) == []
    engine.handle(b, wire(encode(Hello("B", 0, 1, 0, "t"))))
    # b is at its cap of jobs: refused, and job A keeps its generation and its op in flight.
    assert _error_code(engine.handle(b, wire(encode(Hello("A", 1, 2, 1, "t"))))) == [ErrorCode.LIMIT]
    info = engine.job_info("A")
    assert info["generation"] == 0 and info["ranks"] == [0] and info["ops"] == [0]


# CURVE (the key files: the `keys` fixture in tests/conftest.py).


def test_keygen_writes_private_secret_files_and_refuses_to_overwrite(keys: dict[str, Path]) -> None:
    assert stat.S_IMODE(os.stat(keys["w0"]).st_mode) == 0o600
    public, secret = zmq.auth.load_certificate(str(keys["w0"]))
    assert len(public) == 40 and len(secret) == 40
    assert zmq.auth.load_certificate(str(keys["allowed"] / "w0.key"))[1] is None  # public file: no secret
    assert auth.main([str(keys["allowed"]), "w0"]) == 1
    with pytest.raises(ConfigError, match="no secret key"):
        auth.load_key_pair(keys["server_public"])
    # A public key is given as its file or its Z85 text; anything else is a clear error.
    z85 = zmq.auth.load_certificate(str(keys["server_public"]))[0]
    assert auth.load_public_key(keys["server_public"]) == z85
    assert auth.load_public_key(z85.decode()) == z85
    with pytest.raises(ConfigError):
        auth.load_public_key("x" * 39)


def test_keygen_force_makes_an_old_secret_file_private_too(tmp_path: Path) -> None:
    assert auth.main([str(tmp_path), "k"]) == 0
    os.chmod(tmp_path / "k.key_secret", 0o644)
    assert auth.main(["--force", str(tmp_path), "k"]) == 0
    assert stat.S_IMODE(os.stat(tmp_path / "k.key_secret").st_mode) == 0o600


@pytest.fixture
def curve_agg(keys: dict[str, Path]) -> Iterator[Aggregator]:
    with Aggregator(timeout=20, curve_secret_key=keys["server_secret"], curve_client_keys=keys["allowed"]) as agg:
        yield agg.start()


def _pair(address: str, job: str, keys: dict[str, Path], server: Path | str) -> list[np.ndarray]:
    ws = [
        Worker(
            address, rank=r, world_size=2, job=job, timeout=30, curve_server_key=server, curve_client_key=keys[f"w{r}"]
        )
        for r in range(2)
    ]
    try:
        futs = [w.allreduce_async(np.full(4096, MARK * (r + 1), np.float32)) for r, w in enumerate(ws)]
        return [f.result(30) for f in futs]
    finally:
        for w in ws:
            w.close()


def test_curve_right_keys_work(curve_agg: Aggregator, keys: dict[str, Path]) -> None:
    z85 = zmq.auth.load_certificate(str(keys["server_public"]))[0].decode()
    for server in (keys["server_public"], z85):
        for out in _pair(curve_agg.address, "curve-ok", keys, server):
            np.testing.assert_array_equal(out, np.full(4096, MARK * 3, np.float32))


@pytest.mark.parametrize("who", ["stranger key", "no key", "wrong server key"])
def test_curve_refuses_wrong_or_missing_keys(curve_agg: Aggregator, keys: dict[str, Path], who: str) -> None:
    kw: dict = {}
    if who == "stranger key":
        kw = dict(curve_server_key=keys["server_public"], curve_client_key=keys["eve"])
    elif who == "wrong server key":
        kw = dict(curve_server_key=zmq.curve_keypair()[0].decode(), curve_client_key=keys["w0"])
    with Worker(curve_agg.address, rank=0, world_size=1, job=f"curve-{who}", timeout=30, **kw) as w:
        assert _refused_fast(w, match="refused the connection") < 5
    assert curve_agg.engine.job_info(f"curve-{who}") is None  # nothing reached the engine
    # The aggregator refused it, or saw the worker give up first (a worker without CURVE
    # finds the mechanism mismatch itself and closes).
    errors = curve_agg.counters.errors
    assert errors.get("handshake", 0) + errors.get("handshake_aborted", 0) >= 1


def test_a_handshake_broken_off_once_is_retried_not_refused() -> None:
    """A peer that closes during the handshake (an aggregator shutting down or restarting)
    looks like one that could not read a wrong key; it is retried, and the op waits for it."""
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    with Worker(address, rank=0, world_size=1, job="broken-off", timeout=30) as w:
        fut = w.allreduce_async(np.ones(8, np.float32))  # waits for a connection
        listener.settimeout(10)
        conn, _ = listener.accept()
        conn.close()  # the first handshake breaks off
        listener.close()
        agg = Aggregator(listen=address).start()
        try:
            np.testing.assert_array_equal(fut.result(timeout=20), np.ones(8, np.float32))
        finally:
            agg.close()


class Relay:
    """A TCP relay on loopback that records every byte it forwards (a wire tap)."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self.captured = bytearray()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        self._listener.settimeout(0.1)
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            upstream = socket.create_connection(self._target)
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select(list(peers), [], [], 0.1)
                for s in ready:
                    data = s.recv(1 << 16)
                    if not data:
                        return
                    self.captured += data
                    peers[s].sendall(data)
        except OSError:
            return
        finally:
            a.close()
            b.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._listener.close()


@pytest.mark.parametrize("curve", [False, True])
def test_bytes_on_the_wire_are_not_plaintext_with_curve(keys: dict[str, Path], curve: bool) -> None:
    kw = dict(curve_secret_key=keys["server_secret"], curve_client_keys=keys["allowed"]) if curve else {}
    with Aggregator(timeout=20, **kw).start() as agg:
        relay = Relay(agg.address)
        try:
            server = keys["server_public"] if curve else None
            ws = [
                Worker(relay.address, rank=r, world_size=2, job="wiretap-job", token="wiretap-token", timeout=30,
                       curve_server_key=server, curve_client_key=keys[f"w{r}"] if curve else None)
                for r in range(2)
            ]
            futs = [w.allreduce_async(np.full(4096, MARK * (r + 1), np.float32)) for r, w in enumerate(ws)]
            for f in futs:
                np.testing.assert_array_equal(f.result(30), np.full(4096, MARK * 3, np.float32))
            for w in ws:
                w.close()
        finally:
            relay.close()
    wire_bytes = bytes(relay.captured)
    assert len(wire_bytes) > 2 * 4096 * 4  # both payloads went through the tap
    secrets = [b"wiretap-job", b"wiretap-token", MARK.tobytes() * 4, (MARK * 3).tobytes() * 4]
    found = [s for s in secrets if s in wire_bytes]
    # Without CURVE the tap sees everything (so the check can fail); with it, nothing.
    assert found == ([] if curve else secrets)


def test_hello_bye_and_error_headers_are_checked() -> None:
    for msg in (Hello("j", 1, 2, 3, "tok"), Bye("j", 1), Error("j", None, int(ErrorCode.PEER_LOST), "gone", [7])):
        assert decode(wire(encode(msg)), max_header_bytes=1 << 17)[0] == msg
    bad = [
        (Hello("j", 0, 2, 0, "t" * 257), "token"),
        (Hello("j", 2, 2, 0, ""), "not in a world"),
        (Hello("j", 0, 0, 0, ""), "not in a world"),
        (Hello("j" * 257, 0, 1, 0, ""), "job"),
        (Hello("j", 0, 1, -1, ""), "generation"),
        (Error("j", 0, 3, "x", ["1"]), "ranks"),
        (Error("j", 0, 0, "x", []), "code"),
    ]
    for msg, match in bad:
        with pytest.raises(ProtocolError, match=match):
            decode(wire(encode(msg)), max_header_bytes=1 << 17)
    # An error naming thousands of ranks fits the workers' header limit.
    big = Error("j", 0, int(ErrorCode.TIMEOUT), "late", list(range(4096)))
    assert decode(wire(encode(big)), max_header_bytes=MAX_ERROR_HEADER_BYTES)[0] == big


def test_a_bare_tcp_probe_is_no_refused_connection(caplog: pytest.LogCaptureFixture) -> None:
    # A health check's connect-and-close (docker/healthcheck.py) breaks off the handshake: the
    # aggregator refused nothing, so it is counted apart and logged without a warning.
    with Aggregator(timeout=20) as agg:
        agg.start()
        port = int(agg.address.rsplit(":", 1)[1])
        for _ in range(3):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        deadline = time.monotonic() + 5
        while agg.counters.errors.get("handshake_aborted", 0) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert agg.counters.errors.get("handshake_aborted", 0) == 3
        assert agg.counters.errors.get("handshake", 0) == 0
    assert not [r for r in caplog.records if r.name == "aggregator.server" and r.levelno >= logging.WARNING]
