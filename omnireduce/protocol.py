"""The wire protocol, imported by both the aggregator and the workers.

Every message is a list of ZeroMQ frames: one msgpack header frame (a map that
always carries the protocol version ``v`` and the message type ``t``) followed by
raw frames of block indices (int64) and block payloads (the op's element type),
sent and received without copies. The aggregator's ROUTER socket prepends the
peer's routing id, which is not part of what this module encodes.

A worker's connection first says who it is (HELLO: job, rank, world size,
generation, job token); the aggregator binds the connection to that rank of that
job and answers only if it refuses (ERROR); BYE says it leaves on purpose (a
connection that closes without it counts as lost). Either end sends a HEARTBEAT when
it has heard nothing for a while, and the other answers it; a connection silent for too
long counts as lost (the aggregator tells the worker with an ERROR of code DROPPED).
Then, per op (job id + op number) and stream::

    worker                                   aggregator
      START   (first nonzero block of every column)  ->   round 0: pointers only
              <-  RESULT(round 0: instruction = per-column minimum, no data)
      BLOCKS  (blocks at the instruction, their next pointers)  ->   only if any
              <-  RESULT(round r: sums of round r-1's blocks, next instruction)
      ...                                     until every column's instruction is INF
              <-  ERROR   (whenever an op or job fails; names job, op, ranks)

A worker that numbered an op but refuses to send it (its arguments failed a check on
its side) sends ABORT instead of START: the op fails on every rank (ERROR of code
REFUSED, naming that rank and why), and the op numbers of all ranks stay in step.

An op whose layout has one row of blocks (``num_blocks <= num_columns``: every rows
op, and any tensor of at most ``streams x message_blocks`` blocks) may be *eager*:
every column then holds at most one block, so round 0's instruction is exactly each
worker's own pointers and round 1 would move all of its blocks. A worker then sends
its streams' pointers and blocks in STARTs of consecutive streams, each holding at most
one stream's worth of blocks, and a large payload in a few pieces so that the answers
flow back while the rest goes up (:func:`omnireduce.layout.eager_start_blocks`; a
dense tensor: one START per stream), and the aggregator answers each stream, once
every worker's START of it is in, with a RESULT of round 0 that holds the instruction
(the union of the workers' blocks), their sums, and ends the stream (streams that
complete together share one RESULT): one round trip instead of two. A block that only
one worker sent sums to itself, so that worker is not sent it back (an unweighted op; never the
short last block): the sums are ordered as worker 0's own blocks, worker 1's, ...,
then the blocks several workers sent, and each worker gets all but its own group::

      START   (a run of streams: their pointers + the blocks at them, eager)  ->
              <-  RESULT(round 0, per stream: the union as instruction, the order
                         of the sums, the groups' starts, the sums before and after
                         this worker's own group; stream done)

Block indices and payloads use the host byte order; all supported hosts are
little-endian.
"""

from __future__ import annotations

import math
import sys
from dataclasses import MISSING, dataclass, fields
from enum import IntEnum
from typing import Any, ClassVar

import msgpack
import numpy as np

from omnireduce.dtypes import DType
from omnireduce.errors import ProtocolError
from omnireduce.layout import INF

__all__ = [
    "PROTOCOL_VERSION",
    "MsgType",
    "ErrorCode",
    "Hello",
    "Bye",
    "Start",
    "Blocks",
    "Result",
    "Error",
    "Heartbeat",
    "Abort",
    "MAX_REASON",
    "Message",
    "encode",
    "decode",
    "buffer_of",
    "index_array",
    "INDEX_DTYPE",
    "MAX_HEADER_BYTES",
    "compact_pointers",
    "expand_pointers",
    "pointer_columns",
    "MAX_ERROR_HEADER_BYTES",
    "MAX_NAME",
    "MAX_WORLD_SIZE",
]

assert sys.byteorder == "little", "omnireduce's wire format assumes a little-endian host"

#: 2: HELLO, job tokens and generations, more error codes.
#: 3: weighted ops and compute-time reports in START, batch recommendations in RESULT;
#: START and RESULT carry only the finite column pointers.
#: 4: eager STARTs of one-row layouts (blocks with the pointers; one round trip).
#: 5: an eager op's STARTs carry runs of streams (``Start.stream``, ``stream_count``), each within
#: one message's worth of blocks; RESULTs of eager streams that complete together are merged.
#: 6: a sharded rows op deals rows to the shards round-robin (row r to shard r % S) instead of
#: in ranges: the messages are the same, but a shard of 5 would sum other rows than one of 6.
#: 7: HEARTBEAT messages (instead of ZeroMQ's heartbeats; every one answered, except answers)
#: and the DROPPED error code.
#: 8: ABORT messages and the REFUSED error code.
#: 9: ``Start.shape``, a sparse tensor's shape, and ``Start.part``, which part of a sharded op:
#: ranks that differ fail the op; a sharded op's parts take its number at every shard.
PROTOCOL_VERSION = 9
INDEX_DTYPE = np.dtype(np.int64)
#: A worker's header is a few dozen bytes; anything far larger is hostile or corrupt.
MAX_HEADER_BYTES = 4096
#: An ERROR may name thousands of ranks; only workers decode it, with this limit.
MAX_ERROR_HEADER_BYTES = 1 << 17
#: Longest job id or job token, in characters.
MAX_NAME = 256
#: No job can have more workers than this, whatever the aggregator allows.
MAX_WORLD_SIZE = 1 << 16
_MAX_MESSAGE = 4096
#: Longest reason of an ABORT, in characters (its header stays within MAX_HEADER_BYTES).
MAX_REASON = 512
#: The most dimensions of a START's shape (torch's tensors have at most 64).
MAX_DIMS = 64


class MsgType(IntEnum):
    """Message types; the header field ``t``."""

    START = 1
    BLOCKS = 2
    RESULT = 3
    ERROR = 4
    HELLO = 5
    BYE = 6
    HEARTBEAT = 7
    ABORT = 8


class ErrorCode(IntEnum):
    """Why the aggregator failed an op or a job; carried by ERROR messages."""

    PROTOCOL = 1
    MISMATCH = 2
    TIMEOUT = 3
    UNKNOWN_OP = 4
    INTERNAL = 5
    #: Wrong job token, or a connection that is not bound to the job.
    AUTH = 6
    #: Beyond a limit of the aggregator: jobs, ops in flight, bytes held, world or message size.
    LIMIT = 7
    #: A worker of the job disconnected or stopped answering heartbeats.
    PEER_LOST = 8
    #: The job was restarted with a newer generation.
    STALE = 9
    #: The aggregator heard nothing from this connection for its heartbeat timeout and
    #: dropped it (op None): the worker's ops on it failed; it connects anew for the next ones.
    DROPPED = 10
    #: A rank refused the op before sending any of it (its arguments failed a check there,
    #: see ABORT): the op fails on every rank, naming that rank and why.
    REFUSED = 11


@dataclass(slots=True)
class Hello:
    """The first message of a worker's connection: binds it to one rank of one job.

    The job's first HELLO (or first START, for a job without a token) fixes the job's
    token and world size; a HELLO with a newer generation restarts the job, failing
    the ops of the older one. No frames; the aggregator answers only with an ERROR.
    """

    TYPE: ClassVar[MsgType] = MsgType.HELLO
    job: str
    rank: int
    world_size: int
    generation: int
    token: str


@dataclass(slots=True)
class Start:
    """Round 0 of an op: the worker joins it and reports every column's first nonzero block.

    ``weight`` (the worker's sample count, for a weighted mean; None for a plain sum:
    all workers of an op must agree) and ``compute`` (seconds the worker computed
    since its previous op, for batch balancing; None if not measured) are optional.

    ``eager`` True (all workers of an op must agree; only for a layout of one row of
    blocks) says the START also carries the blocks at its pointers: the op's only
    data round, answered by one RESULT per stream (see the module's docstring). A
    worker then sends its streams in STARTs of ``stream_count`` consecutive streams
    from ``stream`` (None: one), each with those streams' pointers and blocks and no
    more blocks than one stream holds (``message_blocks``): a sparse tensor in one
    message, a dense one stream by stream, so that the aggregator sums a stream
    while the next ones arrive. None (unset, as every optional field) or False: it
    does not, and ``stream`` and ``stream_count`` are None.

    ``shape`` (all workers of an op must agree; None for a flat tensor) is the shape of a
    sparse tensor whose rows the op sums: tensors of other shapes may hold as many rows
    of the same width, and their rows must not be summed together. ``part`` (all
    workers must agree; None for a whole op) is ``[index, parts]`` of an op that is one
    part of a sharded worker's op: parts of one size cut from other places must not be
    summed together either.

    Frames: the first nonzero block of every column (of the streams, if eager) that
    has one (int64, in column order; see :func:`compact_pointers`); if eager, then
    the payload of those blocks.
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
    weight: float | None = None
    compute: float | None = None
    eager: bool | None = None
    stream: int | None = None
    stream_count: int | None = None
    shape: list[int] | None = None
    part: list[int] | None = None


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

    Frames: the next instruction, the block to send of every column of the stream
    that is not finished (int64, in column order; see :func:`compact_pointers`),
    then the summed payload of the columns instructed in the previous round (empty
    after round 0). The round-0 RESULT of an eager op is the exception, and ends the
    stream. Its frames: the instruction (the union); the order of the sums (int64
    positions in the instruction; empty: the instruction's order); the start of each
    worker's group of own blocks in that order and of the shared group (world + 1
    int64); the sums of the blocks before the receiving worker's group; the sums of
    those after it. The worker's own blocks, sent only by it, sum to themselves.
    Eager streams that complete together and follow each other come in one RESULT
    of ``stream_count`` streams from ``stream`` (None: one): five such frames each.

    ``batches``, in round 0 of stream 0 only, is the aggregator's recommended
    batch size per rank (floats summing to the op's total weight), from the ranks'
    measured speeds; None when not every rank reported its weight and compute time.
    """

    TYPE: ClassVar[MsgType] = MsgType.RESULT
    job: str
    op: int
    stream: int
    round: int
    batches: list[float] | None = None
    stream_count: int | None = None


@dataclass(slots=True)
class Error:
    """The aggregator failed an op (or, with ``op`` None, the whole job). No frames."""

    TYPE: ClassVar[MsgType] = MsgType.ERROR
    job: str
    op: int | None
    code: int
    message: str
    ranks: list[int]


@dataclass(slots=True)
class Bye:
    """A worker closing on purpose: its rank leaves the job without counting as lost. No frames."""

    TYPE: ClassVar[MsgType] = MsgType.BYE
    job: str
    rank: int


@dataclass(slots=True)
class Heartbeat:
    """A connection's sign of life, either way, sent when it has heard nothing for a while.

    ZeroMQ's own heartbeats are left off: with them, libzmq 4.3.5 aborts the process when
    a heartbeat falls due on a connection whose reading is paused (back-pressure) and
    whose peer has left. An end with heartbeats on sends one after ``interval`` seconds
    without receiving anything (at most one per interval), and counts its peer as lost
    after ``timeout`` seconds without receiving anything. Every end answers each heartbeat
    that is not itself an answer (``reply`` True), whatever its own settings: each end's
    timeout then rests on its own interval only. ``job`` is the worker's job, or ``"?"`` from the aggregator (a
    heartbeat is about the connection, not a job). No frames.
    """

    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    job: str
    reply: bool | None = None


@dataclass(slots=True)
class Abort:
    """A worker gives up an op it numbered but will not send: its arguments failed a check
    on its side (``reason``, at most MAX_REASON characters).

    The aggregator fails the op on every rank with REFUSED, naming this rank and the
    reason: the other ranks raise at once instead of at their timeout, and every rank's
    op numbers stay in step (the op took its number everywhere). An ABORT of an op that
    already failed changes nothing (each rank of an op that every rank refused sends one).
    No frames; no answer (unless the message itself is refused, as a START would be: an
    ERROR to its sender). The failure is remembered as every failed op's is (the
    aggregator's last 1024 failed ops).
    """

    TYPE: ClassVar[MsgType] = MsgType.ABORT
    job: str
    rank: int
    op: int
    reason: str


Message = Hello | Bye | Start | Blocks | Result | Error | Heartbeat | Abort
_CLASSES: dict[int, type] = {c.TYPE: c for c in (Hello, Bye, Start, Blocks, Result, Error, Heartbeat, Abort)}
_FIELDS: dict[type, tuple[tuple[str, Any], ...]] = {
    c: tuple((f.name, f.type) for f in fields(c)) for c in _CLASSES.values()
}
# Fields with a default may be left out of a header (they were added in a later version).
_OPTIONAL: dict[type, frozenset[str]] = {
    c: frozenset(f.name for f in fields(c) if f.default is not MISSING) for c in _CLASSES.values()
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


def compact_pointers(ptrs: np.ndarray) -> np.ndarray:
    """The wire form of a run of column pointers: the finite ones, in column order.

    A column's pointer is a block of that column (block ``b`` is in column
    ``b mod C``), so the block says which column it is for, and columns that are
    finished (INF) need not be sent: a sparse tensor's pointers cost what its
    nonzero blocks do, not what its columns do.
    """
    return ptrs[ptrs != INF]


def expand_pointers(ids: np.ndarray, first: int, count: int, num_columns: int, num_blocks: int) -> np.ndarray:
    """The column pointers of columns ``first .. first + count - 1`` from their wire form.

    Args:
        ids: the finite pointers, in column order (from :func:`compact_pointers`).
        first: the first column of the run.
        count: columns in the run.
        num_columns: columns of the layout.
        num_blocks: blocks of the tensor.

    Returns:
        One pointer per column of the run, INF where none was sent.

    Raises:
        ProtocolError: a pointer outside the tensor or the run, or two for one column,
            or not in column order.
    """
    out = np.full(count, INF, dtype=INDEX_DTYPE)
    if len(ids):
        out[pointer_columns(ids, first, count, num_columns, num_blocks) - first] = ids
    return out


def pointer_columns(ids: np.ndarray, first: int, count: int, num_columns: int, num_blocks: int) -> np.ndarray:
    """The column of each pointer of a run's wire form, checked as :func:`expand_pointers` checks them.

    Costs what the pointers do, not what the run's columns do: a worker applies an
    instruction with it without expanding the run.

    Returns:
        The absolute column (``id mod num_columns``) of every pointer, ascending.

    Raises:
        ProtocolError: as :func:`expand_pointers`.
    """
    if len(ids) == 0:
        return ids
    if len(ids) > count or ids.min() < 0 or ids.max() >= num_blocks:
        raise ProtocolError(f"{len(ids)} block pointers for {count} columns, or pointers outside the tensor")
    # In a one-row layout (eager ops) a pointer is its column: no division per block.
    cols = ids if num_blocks <= num_columns else ids % num_columns
    if cols[0] < first or cols[-1] >= first + count or (len(cols) > 1 and not (np.diff(cols) > 0).all()):
        raise ProtocolError("block pointers outside their columns, repeated or not in column order")
    return cols


def _check_int(name: str, v: Any, optional: bool = False) -> None:
    if v is None and optional:
        return
    if type(v) is not int or v < 0 or v >= 1 << 62:
        raise ProtocolError(f"header field {name!r} must be a non-negative integer, got {_short(v)}")


def _is_real(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _check_real(name: str, v: Any, positive: bool) -> None:
    if v is None:
        return
    if not _is_real(v) or v < 0 or (positive and v == 0):
        kind = "positive" if positive else "non-negative"
        raise ProtocolError(f"header field {name!r} must be a finite {kind} number or nil, got {_short(v)}")


def _check_str(name: str, v: Any, limit: int, empty: bool) -> None:
    if not isinstance(v, str) or len(v) > limit or (not v and not empty):
        raise ProtocolError(
            f"header field {name!r} must be a {'' if empty else 'non-empty '}string of at most {limit} characters,"
            f" got {_short(v)}"
        )


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def decode(frames: list[Any], max_header_bytes: int = MAX_HEADER_BYTES) -> tuple[Message, list[Any]]:
    """Decodes and checks the header of a message.

    Args:
        frames: the message's frames, header first (without any routing id).
        max_header_bytes: larger headers are refused before they are parsed; workers
            pass :data:`MAX_ERROR_HEADER_BYTES` for the aggregator's errors.

    Returns:
        The message and the frames after the header, untouched.

    Raises:
        ProtocolError: no header, not msgpack, wrong version, unknown type,
            missing, extra or ill-typed fields.
    """
    if not frames:
        raise ProtocolError("empty message")
    raw = buffer_of(frames[0])
    if raw.nbytes > max_header_bytes:
        raise ProtocolError(f"header of {raw.nbytes} bytes exceeds {max_header_bytes}")
    try:
        header = msgpack.unpackb(
            raw, raw=False, strict_map_key=True, max_str_len=_MAX_MESSAGE, max_bin_len=0,
            max_array_len=MAX_WORLD_SIZE, max_map_len=32, max_ext_len=0,
        )
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"header is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}")
    version = header.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {_short(version)} is not supported (expected {PROTOCOL_VERSION})")
    kind = header.pop("t", None)
    cls = _CLASSES.get(kind) if type(kind) is int else None
    if cls is None:
        raise ProtocolError(f"unknown message type {_short(kind)}")
    names = [name for name, _ in _FIELDS[cls]]
    for name in _OPTIONAL[cls] - set(header):
        header[name] = None
    if set(header) != set(names):
        missing = sorted(set(names) - set(header))
        extra = sorted(map(str, set(header) - set(names)))
        raise ProtocolError(f"{cls.__name__} header: missing fields {missing}, unexpected fields {_short(extra)}")
    _check_str("job", header["job"], MAX_NAME, empty=False)
    for name in names:
        if name in ("job", "message", "ranks", "token", "weight", "compute", "batches", "eager", "reply", "reason",
                    "shape", "part"):
            continue
        optional = (cls is Error and name == "op") or (cls is Start and name == "stream") or name == "stream_count"
        _check_int(name, header[name], optional=optional)
        if name == "stream_count" and header[name] is not None and header[name] < 1:
            raise ProtocolError("header field 'stream_count' must be positive")
    if cls is Hello:
        _check_str("token", header["token"], MAX_NAME, empty=True)
    if cls is Abort:
        _check_str("reason", header["reason"], MAX_REASON, empty=True)
    if cls is Start and header["dtype"] not in _DTYPES:
        raise ProtocolError(f"unknown dtype code {_short(header['dtype'])}")
    if cls in (Start, Hello):
        if not 1 <= header["world_size"] <= MAX_WORLD_SIZE or header["rank"] >= header["world_size"]:
            raise ProtocolError(f"rank {header['rank']} is not in a world of size {header['world_size']}")
    if cls is Start:
        for name in ("block_size", "message_blocks", "streams"):
            if header[name] < 1:
                raise ProtocolError(f"header field {name!r} must be positive")
        _check_real("weight", header["weight"], positive=True)
        _check_real("compute", header["compute"], positive=False)
        if header["eager"] is not None and type(header["eager"]) is not bool:
            raise ProtocolError(f"START header has a non-boolean eager {_short(header['eager'])}")
        shape = header["shape"]
        if shape is not None and (
            not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(type(d) is int and 0 <= d < 1 << 62 for d in shape)
        ):
            raise ProtocolError(f"START header has a bad shape {_short(shape)}")
        part = header["part"]
        if part is not None and not (
            isinstance(part, list) and len(part) == 2 and all(type(v) is int for v in part)
            and 0 <= part[0] < part[1] <= MAX_WORLD_SIZE
        ):
            raise ProtocolError(f"START header has a bad part {_short(part)}")
    if cls is Heartbeat and header["reply"] is not None and type(header["reply"]) is not bool:
        raise ProtocolError(f"HEARTBEAT header has a non-boolean reply {_short(header['reply'])}")
    if cls is Result and header["batches"] is not None:
        b = header["batches"]
        if not isinstance(b, list) or not all(_is_real(v) and v >= 0 for v in b):
            raise ProtocolError(f"RESULT header has bad batches {_short(b)}")
    if cls is Error:
        if not isinstance(header["message"], str) or not isinstance(header["ranks"], list):
            raise ProtocolError("ERROR header has an ill-typed message or ranks")
        if not all(type(r) is int and 0 <= r < MAX_WORLD_SIZE for r in header["ranks"]):
            raise ProtocolError("ERROR header names ranks that are not ranks")
        if type(header["code"]) is not int or header["code"] < 1:
            raise ProtocolError(f"ERROR header has a bad code {header['code']!r}")
    return cls(**header), list(frames[1:])
