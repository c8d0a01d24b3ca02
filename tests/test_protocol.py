from __future__ import annotations

import msgpack
import numpy as np
import pytest

from omnireduce.errors import ProtocolError
from omnireduce.protocol import (
    PROTOCOL_VERSION,
    Blocks,
    Error,
    ErrorCode,
    MsgType,
    Result,
    Start,
    decode,
    encode,
    index_array,
)

MESSAGES = [
    Start("job-a", 1, 3, 7, 1000, 1, 256, 64, 4),
    Blocks("job-a", 2, 7, 3, 12),
    Result("j", 0, 0, 0),
    Error("j", None, int(ErrorCode.TIMEOUT), "late", [1, 2]),
    Error("j", 5, int(ErrorCode.MISMATCH), "length differs", []),
]


def _bytes(frames: list) -> list[bytes]:
    return [f if isinstance(f, bytes) else np.ascontiguousarray(f).tobytes() for f in frames]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg) -> None:
    ptrs = np.array([3, 9, np.iinfo(np.int64).max], dtype=np.int64)
    payload = np.arange(5, dtype=np.float32)
    frames = _bytes(encode(msg, ptrs, payload))
    got, data = decode(frames)
    assert got == msg
    assert type(got).TYPE == msg.TYPE
    np.testing.assert_array_equal(index_array(data[0]), ptrs)
    np.testing.assert_array_equal(np.frombuffer(data[1], np.float32), payload)


def test_header_carries_version_and_type() -> None:
    header = msgpack.unpackb(encode(Result("j", 1, 2, 3))[0])
    assert header["v"] == PROTOCOL_VERSION
    assert header["t"] == MsgType.RESULT


def _header(**fields) -> bytes:
    base = {"v": PROTOCOL_VERSION, "t": int(MsgType.BLOCKS), "job": "j", "rank": 0, "op": 0, "stream": 0, "round": 0}
    base.update(fields)
    return msgpack.packb({k: v for k, v in base.items() if v is not ...})


@pytest.mark.parametrize(
    "frames, match",
    [
        ([], "empty"),
        ([b"\xc1"], "msgpack"),
        ([msgpack.packb([1, 2])], "map"),
        ([_header(v=99)], "version"),
        ([_header(t=42)], "unknown message type"),
        ([_header(t="BLOCKS")], "unknown message type"),
        ([_header(round=...)], "missing"),
        ([_header(extra=1)], "unexpected"),
        ([_header(rank=-1)], "non-negative"),
        ([_header(rank=True)], "non-negative"),
        ([_header(op=1.5)], "non-negative"),
        ([_header(job="")], "job"),
        ([_header(job=7)], "job"),
        ([b"\x80" * 5000], "exceeds"),
    ],
)
def test_bad_headers_raise_protocol_error(frames, match) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(frames)


def test_start_checks_rank_and_dtype() -> None:
    with pytest.raises(ProtocolError, match="not in a world"):
        decode(_bytes(encode(Start("j", 3, 3, 0, 10, 1, 256, 1, 1))))
    with pytest.raises(ProtocolError, match="dtype"):
        decode(_bytes(encode(Start("j", 0, 3, 0, 10, 99, 256, 1, 1))))
    with pytest.raises(ProtocolError, match="block_size"):
        decode(_bytes(encode(Start("j", 0, 3, 0, 10, 1, 0, 1, 1))))


def test_index_frame_must_be_whole_indices() -> None:
    with pytest.raises(ProtocolError, match="multiple of 8"):
        index_array(b"\x00" * 12)


def test_pointers_travel_compact_and_expand_back() -> None:
    from omnireduce.layout import INF
    from omnireduce.protocol import compact_pointers, expand_pointers

    # 10 columns of a 35-block tensor; columns 2..6 form the run.
    ptrs = np.array([12, INF, 4, INF, 26], dtype=np.int64)
    wire_ids = compact_pointers(ptrs)
    assert wire_ids.tolist() == [12, 4, 26]
    np.testing.assert_array_equal(expand_pointers(wire_ids, 2, 5, 10, 35), ptrs)
    assert (expand_pointers(wire_ids[:0], 2, 5, 10, 35) == INF).all()
    bad = {
        "outside the tensor": [12, 4, 36],
        "negative": [-8, 4],
        "column before the run": [11],
        "column after the run": [17],
        "same column twice": [12, 22],
        "out of column order": [4, 12],
        "more pointers than columns": [2, 3, 4, 5, 6, 12],
    }
    for why, ids in bad.items():
        with pytest.raises(ProtocolError):
            expand_pointers(np.array(ids, dtype=np.int64), 2, 5, 10, 35)
            pytest.fail(f"accepted: {why}")
