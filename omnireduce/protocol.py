"""The wire protocol, imported by both the aggregator and the workers.

Every message is a list of ZeroMQ frames: one msgpack header frame (a map that
always carries the protocol version ``v`` and the message type ``t``) followed by
raw frames of block indices (int64) and block payloads (the op's element type),
sent and received without copies. The aggregator's ROUTER socket prepends the
peer's routing id, which is not part of what this module encodes.

Messages, per op (job id + op number) and stream::

    worker                                   aggregator
      START   (first nonzero block of every column)  ->   round 0: pointers only
              <-  RESULT(round 0: instruction = per-column minimum, no data)
      BLOCKS  (blocks at the instruction, their next pointers)  ->   only if any
              <-  RESULT(round r: sums of round r-1's blocks, next instruction)
      ...                                     until every column's instruction is INF
              <-  ERROR   (whenever an op or job fails; names job, op, ranks)

Block indices and payloads use the host byte order; all supported hosts are
little-endian.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Any, ClassVar, Union

import msgpack
import numpy as np

from omnireduce.dtypes import DType
from omnireduce.errors import ProtocolError

__all__ = [
    "PROTOCOL_VERSION",
    "MsgType",
    "ErrorCode",
    "Start",
    "Blocks",
    "Result",
    "Error",
    "Message",
    "encode",
    "decode",
    "buffer_of",
    "index_array",
    "INDEX_DTYPE",
    "MAX_HEADER_BYTES",
]

assert sys.byteorder == "little", "omnireduce's wire format assumes a little-endian host"

PROTOCOL_VERSION = 1
INDEX_DTYPE = np.dtype(np.int64)
#: A header is a few dozen bytes; anything far larger is hostile or corrupt.
MAX_HEADER_BYTES = 4096
_MAX_STR = 256


class MsgType(IntEnum):
    """Message types; the header field ``t``."""

    START = 1
    BLOCKS = 2
    RESULT = 3
    ERROR = 4


class ErrorCode(IntEnum):
    """Why the aggregator failed an op or a job; carried by ERROR messages."""

    PROTOCOL = 1
    MISMATCH = 2
    TIMEOUT = 3
    UNKNOWN_OP = 4
    INTERNAL = 5


@dataclass(slots=True)
class Start:
    """Round 0 of an op: the worker joins it and reports every column's first nonzero block.

    Frames: the first nonzero block index of every column (int64, INF if none).
    """

    TYPE: ClassVar[MsgType] = MsgType.START
    job: str
    rank: int
    world_size: int
    op: int
    length: int
    dtype: int
    block_size: int
    message_blocks: int
    streams: int


@dataclass(slots=True)
class Blocks:
    """A worker's blocks for one round of one stream.

    Frames: the next nonzero block index after each sent block (int64), then the
    payload (the blocks in column order, the short last block stored short).
    """

    TYPE: ClassVar[MsgType] = MsgType.BLOCKS
    job: str
    rank: int
    op: int
    stream: int
    round: int


@dataclass(slots=True)
class Result:
    """The aggregator's answer to a round of one stream, sent to every worker.

    Frames: the next instruction, one block index per column of the stream
    (int64, INF where the column is finished), then the summed payload of the
    columns instructed in the previous round (empty after round 0).
    """

    TYPE: ClassVar[MsgType] = MsgType.RESULT
    job: str
    op: int
    stream: int
    round: int


@dataclass(slots=True)
class Error:
    """The aggregator failed an op (or, with ``op`` None, the whole job). No frames."""

    TYPE: ClassVar[MsgType] = MsgType.ERROR
    job: str
    op: int | None
    code: int
    message: str
    ranks: list[int]


Message = Union[Start, Blocks, Result, Error]
_CLASSES: dict[int, type] = {c.TYPE: c for c in (Start, Blocks, Result, Error)}
_FIELDS: dict[type, tuple[tuple[str, Any], ...]] = {
    c: tuple((f.name, f.type) for f in fields(c)) for c in _CLASSES.values()
}
_DTYPES = frozenset(int(d) for d in DType)


def encode(msg: Message, *frames: Any) -> list[Any]:
    """Encodes a message: its msgpack header frame followed by ``frames`` untouched.

    Args:
        msg: the message.
        *frames: buffers (NumPy arrays, bytes) sent after the header as they are.
    """
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": int(msg.TYPE)}
    for name, _ in _FIELDS[type(msg)]:
        header[name] = getattr(msg, name)
    return [msgpack.packb(header), *frames]


def buffer_of(frame: Any) -> memoryview:
    """A zero-copy view of a received frame (zmq.Frame, bytes or memoryview)."""
    buf = getattr(frame, "buffer", None)
    return memoryview(frame) if buf is None else buf


def index_array(frame: Any) -> np.ndarray:
    """A read-only int64 view of a frame of block indices.

    Raises:
        ProtocolError: the frame's size is not a whole number of indices.
    """
    buf = buffer_of(frame)
    if buf.nbytes % INDEX_DTYPE.itemsize:
        raise ProtocolError(f"index frame of {buf.nbytes} bytes is not a multiple of 8")
    return np.frombuffer(buf, dtype=INDEX_DTYPE)


def _check_int(name: str, v: Any, optional: bool = False) -> None:
    if v is None and optional:
        return
    if type(v) is not int or v < 0 or v >= 1 << 62:
        raise ProtocolError(f"header field {name!r} must be a non-negative integer, got {v!r}")


def decode(frames: list[Any]) -> tuple[Message, list[Any]]:
    """Decodes and checks the header of a message.

    Args:
        frames: the message's frames, header first (without any routing id).

    Returns:
        The message and the frames after the header, untouched.

    Raises:
        ProtocolError: no header, not msgpack, wrong version, unknown type,
            missing, extra or ill-typed fields.
    """
    if not frames:
        raise ProtocolError("empty message")
    raw = buffer_of(frames[0])
    if raw.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {raw.nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(
            raw, raw=False, strict_map_key=True, max_str_len=_MAX_STR, max_bin_len=0,
            max_array_len=_MAX_STR, max_map_len=32, max_ext_len=0,
        )
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"header is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}")
    version = header.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not supported (expected {PROTOCOL_VERSION})")
    kind = header.pop("t", None)
    cls = _CLASSES.get(kind) if type(kind) is int else None
    if cls is None:
        raise ProtocolError(f"unknown message type {kind!r}")
    names = [name for name, _ in _FIELDS[cls]]
    if set(header) != set(names):
        missing = sorted(set(names) - set(header))
        extra = sorted(map(str, set(header) - set(names)))
        raise ProtocolError(f"{cls.__name__} header: missing fields {missing}, unexpected fields {extra}")
    job = header["job"]
    if not isinstance(job, str) or not job:
        raise ProtocolError(f"header field 'job' must be a non-empty string, got {job!r}")
    for name in names:
        if name in ("job", "message", "ranks"):
            continue
        _check_int(name, header[name], optional=(cls is Error and name == "op"))
    if cls is Start:
        if header["dtype"] not in _DTYPES:
            raise ProtocolError(f"unknown dtype code {header['dtype']!r}")
        if header["world_size"] < 1 or header["rank"] >= header["world_size"]:
            raise ProtocolError(f"rank {header['rank']} is not in a world of size {header['world_size']}")
        for name in ("block_size", "message_blocks", "streams"):
            if header[name] < 1:
                raise ProtocolError(f"header field {name!r} must be positive")
    if cls is Error:
        if not isinstance(header["message"], str) or not isinstance(header["ranks"], list):
            raise ProtocolError("ERROR header has an ill-typed message or ranks")
    return cls(**header), list(frames[1:])
