from __future__ import annotations

from dataclasses import MISSING, fields

import msgpack
import numpy as np
import pytest

from omnireduce.dtypes import DType
from omnireduce.errors import ProtocolError
from omnireduce.protocol import (
    MAX_REASON,
    PROTOCOL_VERSION,
    Abort,
    Blocks,
    Bye,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    MsgType,
    Result,
    Start,
    decode,
    encode,
    index_array,
)

WEIGHTED = Start("job-a", 2, 5, 9, 12, int(DType.BFLOAT16), 3, 1, 2, weight=12.5, compute=0.25)
RECOMMENDS = Result("j", 0, 0, 0, batches=[19.0, 38.5, 38.5], stream_count=3)
# Every message type, with distinct values in its fields (a field decoded into another
# would show), and every optional field both set and unset.
MESSAGES = [
    Hello("job-a", 1, 3, 2, "s3cret-token"),
    Hello("j", 0, 1, 0, ""),  # no token
    Bye("job-a", 2),
    Start("job-a", 1, 3, 7, 1000, int(DType.FLOAT32), 256, 64, 4),  # weight and compute unset
    WEIGHTED,
    Start("j", 0, 2, 1, 33, int(DType.INT64), 8, 4, 3, weight=7, compute=0.0),  # an int weight; compute 0
    Start("j", 0, 2, 1, 33, int(DType.FLOAT64), 8, 4, 3, weight=None, compute=1.5),
    Start("j", 0, 2, 1, 33, int(DType.FLOAT64), 8, 4, 3, weight=1.0, compute=1.5, eager=True, stream=2,
          stream_count=5, shape=[11, 3], part=[1, 4]),
    Blocks("job-a", 2, 7, 3, 12),
    Result("j", 4, 1, 6),  # batches unset
    RECOMMENDS,
    Result("j", 0, 0, 0, batches=[]),
    Error("j", None, int(ErrorCode.TIMEOUT), "late", [1, 2]),
    Error("j", 5, int(ErrorCode.MISMATCH), "length differs", []),
    Error("job-b", 3, int(ErrorCode.STALE), "generation 1 < 2", [0]),
    Error("?", None, int(ErrorCode.DROPPED), "silent for 5 s", []),
    Heartbeat("job-a"),
    Heartbeat("?", reply=True),
    Abort("job-a", 2, 11, "ConfigError: weight must be positive"),
    Abort("j", 0, 0, ""),
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


def test_round_trips_cover_every_type_and_field() -> None:
    types = {type(m) for m in MESSAGES}
    assert {t.TYPE for t in types} == set(MsgType)
    for cls in types:
        for f in fields(cls):
            values = [getattr(m, f.name) for m in MESSAGES if type(m) is cls]
            if f.default is not MISSING:  # optional: set in one message, unset in another
                assert None in values and any(v is not None for v in values), (cls.__name__, f.name)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_header_holds_exactly_the_fields(msg) -> None:
    header = msgpack.unpackb(encode(msg)[0])
    assert header.pop("v") == PROTOCOL_VERSION and header.pop("t") == int(msg.TYPE)
    assert header == {f.name: getattr(msg, f.name) for f in fields(msg)}


@pytest.mark.parametrize("cls", [Start, Result], ids=lambda c: c.__name__)
def test_optional_fields_may_be_left_out_of_the_header(cls) -> None:
    # An encoder that never sets them may omit them: they decode as unset (None).
    msg = next(m for m in MESSAGES if type(m) is cls and all(
        getattr(m, f.name) is not None for f in fields(m) if f.default is not MISSING))
    header = msgpack.unpackb(encode(msg)[0])
    optional = [f.name for f in fields(cls) if f.default is not MISSING]
    got, data = decode([msgpack.packb({k: v for k, v in header.items() if k not in optional})])
    assert data == []
    assert got == cls(**{f.name: None if f.name in optional else getattr(msg, f.name) for f in fields(cls)})


def test_header_carries_version_and_type() -> None:
    header = msgpack.unpackb(encode(Result("j", 1, 2, 3))[0])
    assert header["v"] == PROTOCOL_VERSION
    assert header["t"] == MsgType.RESULT


def _start(**fields) -> bytes:
    header = msgpack.unpackb(encode(Start("j", 0, 2, 1, 33, int(DType.FLOAT32), 8, 4, 3))[0])
    return msgpack.packb({**header, **fields})


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
        ([msgpack.packb({"v": PROTOCOL_VERSION, "t": int(MsgType.HEARTBEAT), "job": "j", "reply": 1})], "reply"),
        *[([_start(shape=v)], "shape") for v in ([-1], [1.5], "3", [1] * 65, [1 << 62])],
        *[([_start(part=v)], "part") for v in ([1, 1], [0], [-1, 2], [0, 1.0], "0", [0, (1 << 16) + 1])],
        ([msgpack.packb({"v": PROTOCOL_VERSION, "t": int(MsgType.ABORT), "job": "j", "rank": 0, "op": 0,
                         "reason": 5})], "reason"),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "t": int(MsgType.ABORT), "job": "j", "rank": 0, "op": 0,
                         "reason": "x" * (MAX_REASON + 1)})], "reason"),
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


def _encoded(msg, **fields) -> list[bytes]:
    header = msgpack.unpackb(encode(msg)[0])
    header.update(fields)
    return [msgpack.packb(header)]


@pytest.mark.parametrize(
    "msg, fields, match",
    [
        (Hello("j", 0, 2, 0, ""), dict(token=7), "token"),
        (Hello("j", 0, 2, 0, ""), dict(token="x" * 257), "token"),
        (Hello("j", 2, 2, 0, ""), {}, "not in a world"),
        (Hello("j", 0, 2, 0, ""), dict(generation=-1), "generation"),
        (Bye("j", 0), dict(rank="0"), "rank"),
        (WEIGHTED, dict(weight=0.0), "weight"),
        (WEIGHTED, dict(weight=float("nan")), "weight"),
        (WEIGHTED, dict(weight="1"), "weight"),
        (WEIGHTED, dict(compute=-0.5), "compute"),
        (WEIGHTED, dict(compute=float("inf")), "compute"),
        (RECOMMENDS, dict(batches=[1.0, -2.0]), "batches"),
        (RECOMMENDS, dict(batches=["1"]), "batches"),
        (RECOMMENDS, dict(batches=3.0), "batches"),
    ],
)
def test_bad_hello_bye_and_version_3_fields_raise_protocol_error(msg, fields, match) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(_encoded(msg, **fields))


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


def test_a_stream_count_must_be_positive() -> None:
    with pytest.raises(ProtocolError, match="stream_count"):
        decode(_bytes(encode(Result("j", 0, 0, 0, None, 0))))
