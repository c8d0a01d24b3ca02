"""The ZeroMQ plumbing both sides share (omnireduce.transport)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from omnireduce import transport
from omnireduce.errors import ConfigError


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.term()


def test_frames_nbytes_counts_every_kind_of_frame() -> None:
    arr = np.arange(10, dtype=np.float32)
    frames = [b"abc", bytearray(b"de"), zmq.Frame(b"fghi"), arr, memoryview(arr)[2:5], np.empty(0, np.int64)]
    assert transport.frames_nbytes(frames) == 3 + 2 + 4 + 40 + 12 + 0
    assert transport.frames_nbytes([]) == 0


def test_send_and_recv_frames_move_whole_messages(ctx: zmq.Context) -> None:
    a, b = transport.new_socket(ctx, zmq.PAIR), transport.new_socket(ctx, zmq.PAIR)
    try:
        a.bind("inproc://test-frames")
        b.connect("inproc://test-frames")
        assert transport.recv_frames(b) is None  # nothing in: None, not zmq.Again
        big = np.arange(1 << 16, dtype=np.float32)  # above the copy threshold: lent, not copied
        transport.send_frames(a, [b"head", big, memoryview(big)[3:7], zmq.Frame(b"z")])
        transport.send_frames(a, [b"one"])
        got = transport.recv_frames(b)
        assert got is not None and len(got) == 4
        assert got[0].bytes == b"head" and got[3].bytes == b"z"
        np.testing.assert_array_equal(np.frombuffer(got[1].buffer, np.float32), big)
        np.testing.assert_array_equal(np.frombuffer(got[2].buffer, np.float32), big[3:7])
        one = transport.recv_frames(b)
        assert one is not None and [f.bytes for f in one] == [b"one"]
        assert transport.recv_frames(b) is None
    finally:
        a.close()
        b.close()


def test_send_frames_raises_again_and_sends_nothing_when_full(ctx: zmq.Context) -> None:
    a = transport.new_socket(ctx, zmq.DEALER)  # no peer: a DEALER with no pipe has no room
    try:
        with pytest.raises(zmq.Again):
            transport.send_frames(a, [b"x", b"y"])
        a.bind("inproc://test-full")
        b = transport.new_socket(ctx, zmq.DEALER)
        try:
            b.connect("inproc://test-full")
            deadline = time.monotonic() + 5
            got = None
            sent = False
            while got is None and time.monotonic() < deadline:
                if not sent:
                    try:  # the new pipe reaches a's side on its next command pass
                        transport.send_frames(a, [b"after"])
                        sent = True
                    except zmq.Again:
                        time.sleep(0.01)
                got = transport.recv_frames(b)
            assert got is not None and [f.bytes for f in got] == [b"after"]  # the refused message never went
        finally:
            b.close()
    finally:
        a.close()


def test_sockets_linger_zero(ctx: zmq.Context) -> None:
    sock = transport.new_socket(ctx, zmq.ROUTER)
    try:
        assert sock.getsockopt(zmq.LINGER) == 0
    finally:
        sock.close()


def test_curve_off_without_keys(ctx: zmq.Context) -> None:
    sock = transport.new_socket(ctx, zmq.DEALER)
    try:
        assert transport.curve_server(sock, None, None) is None
        transport.curve_client(sock, None, None)
        assert sock.getsockopt(zmq.MECHANISM) == zmq.NULL
    finally:
        sock.close()


def test_curve_server_with_a_bad_key_stops_its_authenticator(
    ctx: zmq.Context, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stopped: list[bool] = []

    class FakeAuthenticator:
        def stop(self) -> None:
            stopped.append(True)

    monkeypatch.setattr(transport.auth, "start_authenticator", lambda ctx, keys: FakeAuthenticator())
    sock = transport.new_socket(ctx, zmq.ROUTER)
    try:
        with pytest.raises(ConfigError):
            transport.curve_server(sock, tmp_path / "missing.key_secret", None)
        assert stopped == [True]
    finally:
        sock.close()


def test_monitor_reports_connections_and_teardown_is_idempotent(ctx: zmq.Context) -> None:
    server = transport.new_socket(ctx, zmq.ROUTER)
    mon = transport.watch(server, zmq.EVENT_ACCEPTED)
    server.bind("tcp://127.0.0.1:*")
    client = transport.new_socket(ctx, zmq.DEALER)
    client.connect(server.getsockopt_string(zmq.LAST_ENDPOINT))
    seen: list[int] = []
    deadline = time.monotonic() + 10
    while zmq.EVENT_ACCEPTED not in seen and time.monotonic() < deadline:
        mon.poll(100)
        seen += [kind for kind, _ in transport.monitor_events(mon)]
    assert zmq.EVENT_ACCEPTED in seen
    client.close()
    while zmq.EVENT_DISCONNECTED not in seen and time.monotonic() < deadline:
        mon.poll(100)
        seen += [kind for kind, _ in transport.monitor_events(mon)]
    assert zmq.EVENT_DISCONNECTED in seen
    assert list(transport.monitor_events(mon)) == []  # drained: returns at once
    transport.close_monitored(server, mon)
    assert server.closed and mon.closed
    transport.close_monitored(server, mon)  # a closed socket is left as it is
    transport.close_monitored(transport.new_socket(ctx, zmq.DEALER), None)


def test_handshake_failures_name_every_refusal_for_both_ends() -> None:
    assert set(transport.HANDSHAKE_FAILURES) == {
        zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    }
    for failure in transport.HANDSHAKE_FAILURES.values():
        assert failure.listener and failure.connector
