"""The aggregator's state machine, free of sockets so it can be driven by tests.

:class:`Engine` takes one decoded-or-not message at a time from a peer and
returns the messages to send. Per op it keeps every worker's next nonzero block
per active column (``Stream.nextp``, ranks x the stream's columns that some worker
still has a block in: built from the STARTs' pointers, so an op costs what its
nonzero blocks do, not what its columns do); per stream and round it knows from that
table exactly which workers must send, sums their blocks in rank order once all
have, and answers every worker with the sums and the next instruction: the
per-column minimum of the workers' next pointers.

Around the ops it keeps, per job, the token fixed by the job's first worker, the
generation (a restarted job fails the ops of the older one), the connection bound
to each rank (bound by HELLO, or implicitly by START for a job without a token)
and the ranks that went away (:meth:`Engine.peer_gone`). Every resource a peer can
make it hold is capped (:class:`aggregator.limits.Limits`); past a cap a peer gets
an ERROR, never unbounded memory.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from aggregator.jobs import Job, Jobs, Refused
from aggregator.limits import Counters, Limits, RateLimitedLog
from aggregator.opstate import (
    EMPTY_INDEX,
    OpState,
    Stream,
    accumulable,
    check_start_shape,
    op_params,
    payload_values,
    positions,
    ranks_text,
    union_sorted,
)
from omnireduce import blocks, config
from omnireduce.dtypes import DType, from_accumulator
from omnireduce.errors import ConfigError, OmniReduceError, ProtocolError
from omnireduce.layout import INF, Layout
from omnireduce.protocol import (
    Abort,
    Blocks,
    Bye,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Result,
    Start,
    buffer_of,
    decode,
    encode,
    index_array,
    pointer_columns,
)

logger = logging.getLogger(__name__)

# Every heartbeat the engine answers gets the same answer.
_HEARTBEAT_REPLY = encode(Heartbeat("?", reply=True))

__all__ = ["Engine", "Outgoing"]

#: A message to send: the peer's routing id and the frames.
Outgoing = tuple[bytes, list[Any]]
# Failed ops remembered, to answer a rank that starts one late: per job (one job's failures
# do not push out another's) and in all (a memory bound: about 250 bytes each).
_TOMBSTONES_PER_JOB = 1024
_TOMBSTONES = 65536
_TOMBSTONE_RANKS = 64
# Python objects of one stream and one op beyond their arrays: an estimate for the byte caps.
_STREAM_OVERHEAD = 512
_OP_OVERHEAD = 2048
_RANK_OVERHEAD = 16
# Batch recommendations are sent to jobs of at most this many ranks (they ride in a header).
_MAX_BALANCE_WORLD = 4096


class Engine:
    """Coordinates the ops of every job; one instance per aggregator.

    Args:
        timeout: seconds after an op's first message at which it is failed with
            TIMEOUT, naming the ranks it still waits for; None waits forever.
        clock: monotonic time source (tests substitute their own).
        limits: caps on what peers can make the engine hold; defaults otherwise.
        balance_smoothing: the fraction of a job's smoothed worker speeds kept at
            each weighted op (0: use only the latest op's speeds).
    """

    def __init__(
        self,
        timeout: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        limits: Limits | None = None,
        balance_smoothing: float = 0.5,
    ) -> None:
        if not 0.0 <= balance_smoothing < 1.0:
            raise ConfigError(f"balance_smoothing must be in [0, 1), got {balance_smoothing}")
        # A zero, negative or NaN timeout would fail every op at its first expiry check.
        if timeout is not None:
            config.check_number("timeout", timeout)
        self.balance_smoothing = balance_smoothing
        self.timeout = timeout
        self._clock = clock
        self.limits = limits or Limits()
        self.counters = Counters()
        self._ops: dict[tuple[str, int], OpState] = {}
        self._jobs = Jobs(self.limits)
        self._failed: OrderedDict[tuple[str, int], tuple[int, ErrorCode, str, list[int]]] = OrderedDict()
        # Each job's tombstones' ops, oldest first (the same keys as _failed).
        self._failed_of: dict[str, OrderedDict[int, None]] = {}
        # Per job, the generation and the highest op whose tombstone was let go of: a rank that
        # starts an op up to it late is told at once (see handle), as a tombstone would.
        self._forgotten: dict[str, tuple[int, int]] = {}
        self._log = RateLimitedLog(logger, clock=clock)

    # Read-only views of the counters, for callers that ask the engine.

    @property
    def ops_completed(self) -> int:
        return self.counters.ops_completed

    @property
    def ops_failed(self) -> int:
        return self.counters.ops_failed

    @property
    def held_bytes(self) -> int:
        return self.counters.held_bytes

    @property
    def peak_held_bytes(self) -> int:
        return self.counters.peak_held_bytes

    @property
    def active_ops(self) -> int:
        return len(self._ops)

    @property
    def active_jobs(self) -> int:
        return len(self._jobs)

    def job_info(self, name: str) -> dict[str, Any] | None:
        """What the engine knows of a job (for logs, tests and debugging), or None.

        Returns:
            ``generation``, ``world_size``, ``ranks`` (connected), ``lost`` (rank ->
            why), ``ops`` (in flight) and ``held_bytes``.
        """
        j = self._jobs.get(name)
        if j is None:
            return None
        return {
            "generation": j.generation, "world_size": j.world_size, "ranks": sorted(j.members),
            "lost": dict(j.lost), "ops": sorted(j.ops), "held_bytes": j.held,
        }

    def handle(self, peer: bytes, frames: list[Any], owned: bool = False) -> list[Outgoing]:
        """Processes one message from ``peer`` and returns what to send.

        Never raises for bad input: a message that cannot be decoded or is not
        allowed gets an ERROR reply; one that breaks an op fails that op on every
        worker.

        Args:
            peer: the sender's routing id.
            frames: the message's frames (zmq frames, bytes or memoryviews).
            owned: the frames' memory belongs to this message alone (received from a
                socket, as over TCP or IPC), so sums may be written into a writeable
                payload instead of a new array. False for a co-located worker's message
                handed over ``inproc://``: its payload is the worker's own tensor.
        """
        self.counters.messages_in += 1
        try:
            msg, body = decode(frames)
        except ProtocolError as e:
            return self._refuse(peer, "?", None, Refused(ErrorCode.PROTOCOL, str(e)))
        if isinstance(msg, Bye):
            return self._on_bye(peer, msg)
        if isinstance(msg, Heartbeat):  # answered whatever the aggregator's own heartbeats
            return [] if msg.reply else [(peer, _HEARTBEAT_REPLY)]
        if not isinstance(msg, (Hello, Start, Blocks, Abort)):
            err = Refused(ErrorCode.PROTOCOL, f"{msg.TYPE.name} is not a message a worker may send")
            return self._refuse(peer, msg.job, None, err)
        try:
            if isinstance(msg, Hello):
                return self._on_hello(peer, msg)
            job = self._jobs.admit(peer, msg)
        except Refused as e:
            return self._refuse(peer, msg.job, msg.rank, e)
        key = (msg.job, msg.op)
        failed = self._failed.get(key)
        if failed is not None and failed[0] == job.generation:
            if isinstance(msg, Abort):
                return []  # every rank refused it, or it failed otherwise: nothing more to tell
            _, code, message, ranks = failed
            return [(peer, encode(Error(key[0], key[1], code, message, ranks)))]
        if key not in self._ops and self._forgot(job, msg.op):
            # Every rank numbers its ops in order: the fastest one started every op up to the
            # mark, and none of them can have completed without this rank. It failed.
            if isinstance(msg, Abort):
                return []
            return [(peer, encode(Error(
                key[0], key[1], ErrorCode.UNKNOWN_OP, f"op {msg.op} failed earlier on the job's other ranks; its "
                f"record is gone (more than {_TOMBSTONES_PER_JOB} of the job's ops failed since)", [],
            )))]
        if isinstance(msg, Abort):
            return self._on_abort(key, msg)
        try:
            if isinstance(msg, Start):
                return self._on_start(peer, job, msg, body, owned)
            return self._on_blocks(peer, msg, body, owned)
        except Refused as e:
            if e.fails_op:
                return self._fail_op(key, e.code, e.message, e.ranks, extra_peer=peer)
            return self._refuse(peer, msg.job, msg.rank, e)
        except Exception as e:  # a bug must fail the op, not kill the daemon
            logger.exception(
                "internal error handling %s (job=%r op=%d rank=%d)", msg.TYPE.name, key[0], key[1], msg.rank
            )
            return self._fail_op(key, ErrorCode.INTERNAL, f"internal aggregator error: {e!r}", [], extra_peer=peer)

    def expire(self) -> list[Outgoing]:
        """Fails every op older than the timeout; call it periodically."""
        if self.timeout is None:
            return []
        now = self._clock()
        out: list[Outgoing] = []
        for key, op in list(self._ops.items()):
            if now - op.started <= self.timeout:
                continue
            missing = [r for r, p in enumerate(op.peers) if p is None]
            if not missing:
                # An eager stream waits for every rank (no expected set is kept for it: at thousands
                # of ranks and streams, sets of every rank would cost far more than the op is charged).
                missing = sorted({r for s in op.streams if not s.done
                                  for r in (range(op.world_size) if op.eager else s.expected) if r not in s.received})
            j = self._jobs.get(key[0])
            why = [f"rank {r} was refused when it joined ({j.refused[r]})" for r in missing if j and r in j.refused]
            out += self._fail_op(
                key, ErrorCode.TIMEOUT,
                f"op did not complete within {self.timeout:g} s; waiting for ranks {ranks_text(missing)}"
                + "".join(f"; {w}" for w in why[:3]), missing,
            )
        return out

    def peer_gone(self, peer: bytes, reason: str = "disconnected") -> list[Outgoing]:
        """Forgets a connection that closed or stopped answering; fails the ops that needed it.

        A rank whose connection goes fails every op of its job in flight, naming it,
        and the job's new ops fail fast until that rank connects again or the job
        restarts with a new generation.

        Args:
            peer: the connection's routing id.
            reason: how it went, for the error text (e.g. "disconnected").
        """
        gone = self._jobs.unbind(peer, reason)
        if any(lost is not None for _, _, lost in gone):
            self.counters.peers_lost += 1
        out: list[Outgoing] = []
        for j, rank, lost in gone:
            if lost is None:
                doomed = []
            elif lost:
                doomed = sorted(j.ops)
                logger.warning(
                    "job=%r gen=%d rank=%d: connection %s %s; failing the job's %d ops in flight",
                    j.name, j.generation, rank, peer.hex(), reason, len(doomed),
                )
            else:
                doomed = sorted(o for o in j.ops if peer in self._ops[(j.name, o)].peers)
            for o in doomed:
                out += self._fail_op((j.name, o), ErrorCode.PEER_LOST, f"rank {rank} {reason}", [rank])
            self._drop_if_idle(j)
        return out

    def _on_abort(self, key: tuple[str, int], msg: Abort) -> list[Outgoing]:
        # The op may not have begun here yet: its tombstone answers the other ranks' STARTs.
        # One line in the logs and in the other ranks' errors, whatever the worker sent.
        reason = " ".join(msg.reason.split()) or "no reason given"
        op = self._ops.get(key)
        missing = [r for r, p in enumerate(op.peers) if p is None and r != msg.rank] if op is not None else []
        if missing:
            # Mostly a rank's own timeout: the other ranks' errors then say whom the op waited for.
            reason += f" (the op still waited for ranks {ranks_text(missing)} here)"
        return self._fail_op(key, ErrorCode.REFUSED, f"rank {msg.rank} refused the op: {reason}", [msg.rank])

    def _on_hello(self, peer: bytes, msg: Hello) -> list[Outgoing]:
        j, stale = self._jobs.hello(peer, msg)
        out: list[Outgoing] = []
        for o in stale:
            out += self._fail_op(
                (j.name, o), ErrorCode.STALE, f"the job was restarted with generation {j.generation}", []
            )
        if stale:
            self._forget_failures(j.name)
        return out

    def _on_bye(self, peer: bytes, msg: Bye) -> list[Outgoing]:
        left = self._jobs.leave(peer, msg.job, msg.rank)
        if left is None:
            return []
        j, held = left
        out: list[Outgoing] = []
        # No op in flight can complete: not those it joined, nor, where it held its rank, those
        # it never will join now (they would wait for their timeout). A connection whose rank
        # another one took over leaves that one's ops alone.
        for o in sorted(o for o in j.ops if held or peer in self._ops[(j.name, o)].peers):
            out += self._fail_op((j.name, o), ErrorCode.PEER_LOST, f"rank {msg.rank} left (its worker was closed)",
                                 [msg.rank])
        self._drop_if_idle(j)
        return out

    def _drop_if_idle(self, j: Job) -> None:
        if self._jobs.drop_if_idle(j):
            self._forget_failures(j.name)

    def _forgot(self, j: Job, op: int) -> bool:
        mark = self._forgotten.get(j.name)
        return mark is not None and mark[0] == j.generation and op <= mark[1]

    def _let_go(self, job: str, op: int) -> None:
        """Drops one tombstone (the caller keeps _failed_of in step), marking how far they went."""
        generation = self._failed.pop((job, op))[0]
        mark = self._forgotten.get(job)
        if mark is None or mark[0] != generation or mark[1] < op:
            self._forgotten[job] = (generation, op)

    def _forget_failures(self, job: str) -> None:
        self._forgotten.pop(job, None)
        for op in self._failed_of.pop(job, ()):
            del self._failed[(job, op)]

    def _refuse(self, peer: bytes, job: str, rank: int | None, e: Refused) -> list[Outgoing]:
        self.counters.error(e.code.name.lower())
        self._log(
            logging.WARNING, "refused a message of connection %s (job=%r rank=%s op=%s): %s: %s",
            peer.hex(), job, rank, e.op, e.code.name, e.message,
        )
        return [(peer, encode(Error(job, e.op, e.code, e.message, e.ranks)))]

    def _fail_op(
        self, key: tuple[str, int], code: ErrorCode, message: str, ranks: list[int], extra_peer: bytes | None = None
    ) -> list[Outgoing]:
        self._log(logging.ERROR, "job=%r op=%d failed (%s): %s", key[0], key[1], code.name, message)
        op = self._ops.pop(key, None)
        job = self._jobs.get(key[0])
        generation = op.generation if op is not None else job.generation if job is not None else 0
        self._remember_failure(key, (generation, code, message, ranks))
        # Every failed op counts, also one refused before any of its STARTs came (a rank's
        # ABORT, a lost rank): an alert on failures must see a job whose every op is refused.
        self.counters.ops_failed += 1
        self.counters.error(code.name.lower())
        if op is not None:
            self._release(op)
        peers = {p for p in (op.peers if op else []) if p is not None}
        if extra_peer is not None:
            peers.add(extra_peer)
        frames = encode(Error(key[0], key[1], code, message, ranks))
        return [(p, frames) for p in peers]

    def _remember_failure(self, key: tuple[str, int], tombstone: tuple[int, ErrorCode, str, list[int]]) -> None:
        # The ranks an error names, as remembered for late ranks: at most the first _TOMBSTONE_RANKS
        # (the error's text says how many there were), so that tombstones stay small at any world size.
        generation, code, message, ranks = tombstone
        if len(ranks) > _TOMBSTONE_RANKS:
            tombstone = (generation, code, message, ranks[:_TOMBSTONE_RANKS])
        self._failed[key] = tombstone
        self._failed.move_to_end(key)
        mine = self._failed_of.setdefault(key[0], OrderedDict())
        mine[key[1]] = None
        mine.move_to_end(key[1])
        if len(mine) > _TOMBSTONES_PER_JOB:
            self._let_go(key[0], mine.popitem(last=False)[0])
        if len(self._failed) > _TOMBSTONES:
            job, op = next(iter(self._failed))
            self._let_go(job, op)
            ops = self._failed_of[job]
            del ops[op]
            if not ops:
                del self._failed_of[job]

    # Bytes held, against the limits.

    def _hold(self, op: OpState, s: Stream | None, nbytes: int) -> None:
        j = self._jobs[op.job]
        lim = self.limits
        c = self.counters
        if j.held + nbytes > lim.max_job_bytes:
            raise Refused.op_failure(ErrorCode.LIMIT, f"the job would hold {j.held + nbytes} bytes in flight, above "
                                     f"the limit of {lim.max_job_bytes}")
        if c.held_bytes + nbytes > lim.max_bytes:
            raise Refused.op_failure(ErrorCode.LIMIT, f"the aggregator would hold {c.held_bytes + nbytes} bytes in "
                                     f"flight, above its limit of {lim.max_bytes}")
        if s is not None:
            s.held += nbytes
        op.held += nbytes
        j.held += nbytes
        c.held_bytes += nbytes
        c.peak_held_bytes = max(c.peak_held_bytes, c.held_bytes)

    def _unhold(self, op: OpState, s: Stream) -> None:
        nbytes, s.held = s.held, 0
        op.held -= nbytes
        self._jobs[op.job].held -= nbytes
        self.counters.held_bytes -= nbytes

    def _release(self, op: OpState) -> None:
        """Gives back everything an op held; it is no longer in flight."""
        j = self._jobs.get(op.job)
        self.counters.held_bytes -= op.held
        if j is not None:
            j.held -= op.held
            j.ops.discard(op.op)
        op.held = 0
        for s in op.streams:
            s.held = 0
            s.received = {}
        if j is not None:
            self._drop_if_idle(j)

    def _retire(self, op: OpState) -> None:
        """Books a completed op, the one place that does: counted, timed, no longer in flight."""
        del self._ops[(op.job, op.op)]
        self.counters.ops_completed += 1
        self.counters.observe_latency(self._clock() - op.started)
        self._release(op)

    # Ops.

    def _new_op(self, j: Job, msg: Start, body: list[Any]) -> OpState:
        lim = self.limits
        if msg.world_size != j.world_size:
            raise Refused.op_failure(
                ErrorCode.MISMATCH, f"rank {msg.rank} says the job has {msg.world_size} workers, the job has "
                f"{j.world_size}", [msg.rank],
            )
        if j.lost:
            lost = sorted(j.lost)
            raise Refused.op_failure(
                ErrorCode.PEER_LOST, f"rank {lost[0]} {j.lost[lost[0]]}"
                + (f" (ranks {ranks_text(lost)} are gone)" if len(lost) > 1 else "")
                + "; restart the job with a new generation", lost,
            )
        left = sorted(r for r, mark in j.left.items() if msg.op > mark)
        if left:
            # Past the ops its worker had begun: it never joins them (a new worker of the rank
            # numbers from 0), so they would wait for the timeout.
            raise Refused.op_failure(
                ErrorCode.PEER_LOST, f"rank {left[0]} left (its worker was closed)"
                + (f" (ranks {ranks_text(left)} left)" if len(left) > 1 else ""), left,
            )
        if len(j.ops) >= lim.max_ops_per_job:
            raise Refused.op_failure(ErrorCode.LIMIT, f"the job has {len(j.ops)} ops in flight, its limit")
        if msg.streams > lim.max_streams:
            raise Refused.op_failure(ErrorCode.LIMIT, f"{msg.streams} streams exceed the limit of {lim.max_streams}")
        try:
            layout = Layout(msg.length, msg.block_size, msg.message_blocks, msg.streams)
        except OmniReduceError as e:
            raise Refused.op_failure(ErrorCode.PROTOCOL, f"rank {msg.rank}: {e}") from None
        dtype = DType(msg.dtype)
        if dtype.is_integer and msg.weight is not None:
            # A weighted mean of integers has no integer result; the worker refuses it
            # first, so only a foreign or broken worker gets here. Later STARTs of the op
            # then fail on its tombstone, so every rank hears of it.
            raise Refused.op_failure(
                ErrorCode.MISMATCH, f"rank {msg.rank} asked for a weighted mean of {dtype.name.lower()} elements: "
                "integer ops are plain sums, without weights", [msg.rank],
            )
        message = layout.message_bytes(dtype.itemsize)
        if message > lim.max_message_bytes:
            raise Refused.op_failure(ErrorCode.LIMIT, f"messages of this op would carry up to {message} bytes, above "
                                     f"the limit of {lim.max_message_bytes}; use smaller blocks or fewer blocks per "
                                     "message")
        check_start_shape(layout, msg, body)  # before anything is allocated for the op
        op = OpState(
            job=msg.job, op=msg.op, world_size=msg.world_size, layout=layout, dtype=dtype,
            params=op_params(msg), started=self._clock(), peers=[None] * msg.world_size,
            starts=[None] * msg.world_size, streams=[], streams_left=layout.num_streams, generation=j.generation,
        )
        # Charged with its per-rank slots (peers, starts): thousands of ranks make them the op's bulk.
        self._hold(op, None, layout.num_streams * _STREAM_OVERHEAD + _OP_OVERHEAD + op.world_size * _RANK_OVERHEAD)
        j.ops.add(msg.op)
        j.high = max(j.high, msg.op)
        self._ops[(msg.job, msg.op)] = op
        op.streams = [Stream(s, layout.stream_columns(s)) for s in range(layout.num_streams)]
        self.counters.ops_started += 1
        return op

    def _on_start(self, peer: bytes, j: Job, msg: Start, body: list[Any], owned: bool) -> list[Outgoing]:
        key = (msg.job, msg.op)
        params = op_params(msg)
        op = self._ops.get(key)
        if op is None:
            op = self._new_op(j, msg, body)  # checks the START's shape before allocating
        elif params != op.params:
            names = ("world_size", "length", "dtype", "block_size", "message_blocks", "streams", "weighted", "shape",
                     "part", "eager")
            joined = [r for r, p in enumerate(op.peers) if p is not None]
            # Lower ranks' values first, so the text does not depend on who arrived first.
            groups = [joined, [msg.rank]]
            pairs = [op.params, params]
            if joined and msg.rank < joined[0]:
                groups.reverse()
                pairs.reverse()
            diff = ", ".join(
                f"{n}: {a} vs {b}" for n, a, b in zip(names, pairs[0], pairs[1], strict=True) if a != b
            )
            raise Refused.op_failure(
                ErrorCode.MISMATCH,
                f"workers disagree on the op: {diff} (ranks {ranks_text(groups[0])} vs {ranks_text(groups[1])})",
                sorted({*joined, msg.rank}),
            )
        else:
            check_start_shape(op.layout, msg, body)
        if msg.eager:
            return self._on_eager_start(peer, j, op, msg, body, owned)
        if op.peers[msg.rank] is not None:
            raise Refused.op_failure(ErrorCode.PROTOCOL, f"rank {msg.rank} joined the op twice", [msg.rank])
        lay = op.layout
        try:
            first = index_array(body[0])
            cols = pointer_columns(first, 0, lay.num_columns, lay.num_columns, lay.num_blocks)
        except ProtocolError as e:
            raise Refused.op_failure(
                ErrorCode.PROTOCOL, f"rank {msg.rank} sent block pointers outside its columns: {e}", [msg.rank]
            ) from None
        # The tables (world rows over the union of the STARTs' columns, 9 bytes a cell) are
        # reserved as the STARTs come, for the most columns any START named so far, and
        # the rest once the union is known (_build_tables): a tensor whose ranks' blocks
        # coincide holds what one rank's do, as the dense tables did; a START's own
        # pointers (at most 8 bytes a column) are held by its frame until then.
        grow = len(first) - op.reserved_columns
        if grow > 0:
            self._hold(op, None, grow * 9 * op.world_size)
            op.reserved_columns = len(first)
        op.starts[msg.rank] = (first, cols)
        op.peers[msg.rank] = peer
        self._note_weight(op, msg)
        if any(p is None for p in op.peers):
            return []
        batches = self._balance(j, op)
        self._build_tables(op)
        out: list[Outgoing] = []
        for s in op.streams:
            out += self._advance(op, s, np.empty(0, dtype=op.dtype.storage), batches if s.index == 0 else None)
        self.counters.rounds += len(op.streams)
        return out

    @staticmethod
    def _note_weight(op: OpState, msg: Start) -> None:
        if msg.weight is not None:
            if op.weights is None:
                op.weights = np.zeros(op.world_size)
            op.weights[msg.rank] = msg.weight
        if msg.compute is not None:
            if op.compute is None:
                op.compute = np.full(op.world_size, np.nan)
            op.compute[msg.rank] = msg.compute

    def _build_tables(self, op: OpState) -> None:
        """Every stream's table of next pointers over its active columns, from the STARTs.

        Pointers come in column order, and every stream is a contiguous run of columns.
        """
        starts = [p for p in op.starts if p is not None]
        op.starts = [None] * op.world_size
        union = union_sorted([c for _, c in starts])
        spans = [s.span.start for s in op.streams] + [op.layout.num_columns]
        lo = np.searchsorted(union, spans)
        bounds = [np.searchsorted(c, spans) for _, c in starts]
        if len(union) > op.reserved_columns:
            self._hold(op, None, (len(union) - op.reserved_columns) * 9 * op.world_size)
            op.reserved_columns = len(union)
        for k, s in enumerate(op.streams):
            s.cols = union[lo[k] : lo[k + 1]]
            s.nextp = np.full((op.world_size, len(s.cols)), INF, dtype=np.int64)
            for rank, (ptrs, c) in enumerate(starts):
                a, b = bounds[rank][k], bounds[rank][k + 1]
                if a < b:
                    s.nextp[rank, np.searchsorted(s.cols, c[a:b])] = ptrs[a:b]

    def _on_eager_start(
        self, peer: bytes, j: Job, op: OpState, msg: Start, body: list[Any], owned: bool
    ) -> list[Outgoing]:
        """A START of an eager op: the rank's pointers in a run of streams and the blocks at them.

        A rank sends its streams in as few STARTs as keep each within one message's
        worth of blocks (a sparse tensor: one), and the aggregator sums a stream as
        soon as every rank's START of it is in, while later streams still arrive. The
        first START joins the rank to the op.
        """
        lay = op.layout
        rank = msg.rank
        assert msg.stream is not None  # check_start_shape
        first = msg.stream
        streams = op.streams[first : first + (msg.stream_count or 1)]
        if op.peers[rank] is not None and op.peers[rank] != peer:
            raise Refused.op_failure(ErrorCode.PROTOCOL, f"rank {rank} sent STARTs of the op from two connections",
                                     [rank])
        for s in streams:
            # A stream already summed has forgotten who sent it: a START of it again is a repeat too.
            if rank in s.received or s.done:
                raise Refused.op_failure(ErrorCode.PROTOCOL, f"rank {rank} sent stream {s.index}'s START twice",
                                         [rank])
        lo_col, hi_col = streams[0].span.start, streams[-1].span.stop
        try:
            ptrs = index_array(body[0])
            pointer_columns(ptrs, lo_col, hi_col - lo_col, lay.num_columns, lay.num_blocks)
        except ProtocolError as e:
            raise Refused.op_failure(
                ErrorCode.PROTOCOL, f"rank {rank} sent block pointers outside the columns of streams {first}-"
                f"{streams[-1].index}: {e}", [rank]
            ) from None
        buf = buffer_of(body[1])
        want = lay.payload_elements(ptrs) * op.dtype.itemsize
        if buf.nbytes != want:
            raise Refused.op_failure(ErrorCode.PROTOCOL, f"rank {rank} sent an eager payload of {buf.nbytes} "
                                     f"bytes, expected {want}", [rank])
        payload = payload_values(buf, op.dtype, owned)
        # In a one-row layout a pointer is its column: each stream's run of them, by its span.
        cuts = np.searchsorted(ptrs, [s.span.start for s in streams] + [hi_col])
        bs = lay.block_size
        complete: list[Stream] = []
        for i, s in enumerate(streams):
            a, b = int(cuts[i]), int(cuts[i + 1])
            mine = ptrs[a:b]
            # Only the tensor's short last block, in the last column, is stored short.
            part = payload[a * bs : a * bs + lay.payload_elements(mine)]
            # The frames stay referenced until the stream is summed.
            self._hold(op, s, part.nbytes + mine.nbytes)
            s.received[rank] = (mine, part)
            if len(s.received) == op.world_size:
                complete.append(s)
        self.counters.blocks_in += len(ptrs)
        op.peers[rank] = peer
        self._note_weight(op, msg)
        if not complete:
            return []
        # Every rank has sent stream 0's START, so every weight and compute time is in.
        batches = self._balance(j, op) if complete[0].index == 0 else None
        return self._finish_eager(op, complete, batches)

    def _finish_eager(self, op: OpState, complete: list[Stream], batches: list[float] | None) -> list[Outgoing]:
        """Sums the eager streams that every rank has sent and ends them: one RESULT per run of streams.

        In a one-row layout block ``c`` is column ``c``'s only block: round 0's
        instruction is the union of the ranks' pointers, and a rank's payload holds
        exactly its blocks of that instruction, in column order. Streams completed by
        the same START that follow each other go to every rank in one message.
        """
        bs = op.layout.block_size
        # Per rank, per completed stream: the five frames of its part of the RESULT.
        parts: list[list[list[Any]]] = [[] for _ in range(op.world_size)]
        for s in complete:
            starts, s.received = s.received, {}
            cur = s.cur = union_sorted([starts[r][0] for r in range(op.world_size)])
            received = {r: (positions(cur, ptrs), p) for r, (ptrs, p) in starts.items() if len(ptrs)}
            order, groups = self._eager_order(op, received, cur)
            ids = cur
            if order is not None:
                # Sum straight into the grouped order (each rank's payload rows to their new rows).
                inv = np.empty(len(order), dtype=np.int64)
                inv[order] = np.arange(len(order))
                received = {r: (inv[sel], p) for r, (sel, p) in received.items()}
                ids = cur[order]
            summed = self._sum_round(op, received, ids)
            shared = [cur, EMPTY_INDEX if order is None else order, groups]
            for rank in range(op.world_size):
                # Every block before the shared group is whole: positions times the block size.
                lo_r, hi_r = int(groups[rank]), int(groups[rank + 1])
                parts[rank].append([*shared, summed[: lo_r * bs], summed[hi_r * bs :]])
                self.counters.blocks_out += len(cur) - (hi_r - lo_r)
            s.round = 1
            s.done = True
            self._unhold(op, s)
            self.counters.rounds += 1
        out: list[Outgoing] = []
        # A stream completes once every rank has sent it, so every rank has joined.
        peers = [p for p in op.peers if p is not None]
        i = 0
        while i < len(complete):
            # A run of consecutive streams: one message (a handful of runs per START at most).
            end = i + 1
            while end < len(complete) and complete[end].index == complete[end - 1].index + 1:
                end += 1
            first = complete[i].index
            header = encode(Result(op.job, op.op, first, 0, batches if first == 0 else None,
                                   end - i if end - i > 1 else None))[0]
            for rank, peer in enumerate(peers):
                out.append((peer, [header, *(f for part in parts[rank][i:end] for f in part)]))
            i = end
        op.streams_left -= len(complete)
        if op.streams_left == 0:
            self._retire(op)
        return out

    def _eager_order(
        self, op: OpState, received: dict[int, tuple[np.ndarray, np.ndarray]], cur: np.ndarray
    ) -> tuple[np.ndarray | None, np.ndarray]:
        """The order an eager stream's sums are sent in, so that no rank is sent its own blocks back.

        A block that only one rank sent sums to that rank's block itself (``0 + x`` is
        ``x``, also widened and rounded back). The sums are laid out as rank 0's such
        blocks, rank 1's, ..., then the blocks several ranks sent; rank ``r`` is sent
        two zero-copy slices of that one array, everything but its own group. With rows
        that seldom coincide a rank then receives the others' rows, as from an
        allgather, not the whole union (half as much at two ranks).

        Returns:
            The permutation of ``cur`` in that layout (None: as it is; every sum is
            sent), and the W + 1 group starts (rank ``r``'s group is ``[g[r], g[r+1])``;
            the shared group starts at ``g[W]``).
        """
        lay = op.layout
        world = op.world_size
        k = len(cur)
        none = np.zeros(world + 1, dtype=np.int64)
        # The short last block stays last, among the shared.
        short_last = k and lay.tail_length != lay.block_size and int(cur[-1]) == lay.num_blocks - 1
        # A weighted op's sums are not the blocks.
        if op.weights is not None or world < 2:
            return None, none
        if len(received) == 1:
            # One rank sent every block of the stream (a point-to-point message; a tensor that
            # only one rank holds there): its group is all of them, in their order, and it is
            # sent none of them back.
            (rank, _), = received.items()
            groups = np.zeros(world + 1, dtype=np.int64)
            groups[rank + 1 :] = k - 1 if short_last else k
            return None, groups
        # A rank holding every block (and others some of them) is summed aligned.
        if any(len(sel) == k for sel, _ in received.values()):
            return None, none
        cover = np.zeros(k, dtype=np.int32)
        for sel, _ in received.values():
            cover[sel] += 1
        owner = np.full(k, world, dtype=np.int64)
        for rank, (sel, _) in received.items():
            owner[sel[cover[sel] == 1]] = rank
        if short_last:
            owner[-1] = world
        if not (owner < world).any():
            return None, none
        order = np.argsort(owner, kind="stable")
        return order, np.searchsorted(owner[order], np.arange(world + 1))

    def _check_pointers(
        self, op: OpState, ptrs: np.ndarray, cols: np.ndarray, after: np.ndarray, rank: int
    ) -> None:
        c = op.layout.num_columns
        finite = ptrs != INF
        ok = (ptrs[finite] < op.layout.num_blocks) & (ptrs[finite] % c == cols[finite])
        if len(after):
            ok &= ptrs[finite] > after[finite]
        if not ok.all():
            raise Refused.op_failure(ErrorCode.PROTOCOL, f"rank {rank} sent block pointers outside its columns", [rank])

    def _balance(self, j: Job, op: OpState) -> list[float] | None:
        """The recommended batch per rank, once every rank of a weighted op reported its compute time.

        A rank's speed is its samples over its compute seconds; speeds are smoothed
        over ops (exponentially, ``balance_smoothing`` of the old value kept) so one
        noisy step does not swing the batches, and the op's total weight (the global
        batch) is split in proportion to them.
        """
        if op.weights is None or op.compute is None or op.world_size > _MAX_BALANCE_WORLD:
            return None
        if not (np.isfinite(op.compute).all() and (op.compute > 0).all()):
            return None
        with np.errstate(over="ignore", invalid="ignore"):
            speed = op.weights / op.compute
            if j.speeds is None or len(j.speeds) != op.world_size:
                speeds = speed
            else:
                speeds = self.balance_smoothing * j.speeds + (1.0 - self.balance_smoothing) * speed
            batches = speeds / speeds.sum() * op.weights.sum()
        if not np.isfinite(batches).all():
            # Weights near float64's end (1e308) overflow the speeds or their totals: no
            # recommendation (a RESULT whose batches are not finite is refused by every worker,
            # which would then time the op out), and the speeds start afresh at the next op.
            j.speeds = None
            return None
        j.speeds = speeds
        return batches.tolist()

    def _advance(
        self, op: OpState, s: Stream, payload: np.ndarray, batches: list[float] | None = None
    ) -> list[Outgoing]:
        """Sends the last round's sums and the next instruction, and sets up the next round.

        The last round of the op's last stream completes the op (:meth:`_retire`).
        """
        table = s.nextp
        cur = table.min(axis=0) if len(table) else EMPTY_INDEX
        active = cur != INF
        if not active.all():
            keep = np.flatnonzero(active)
            s.cols = s.cols[keep]
            s.nextp = table = table[:, keep]
            cur = cur[keep]
        s.match = table == cur
        s.expected = set(np.flatnonzero(s.match.any(axis=1)).tolist())
        if s.held:
            self._unhold(op, s)  # the last round's frames, let go of below
        s.received = {}
        frames = encode(Result(op.job, op.op, s.index, s.round, batches), cur, payload)
        s.cur = cur
        if not len(cur):
            s.done = True
            op.streams_left -= 1
            if op.streams_left == 0:
                self._retire(op)
        return [(p, frames) for p in op.peers if p is not None]

    def _on_blocks(self, peer: bytes, msg: Blocks, body: list[Any], owned: bool) -> list[Outgoing]:
        key = (msg.job, msg.op)
        op = self._ops.get(key)
        if op is None:
            raise Refused(ErrorCode.UNKNOWN_OP, "no such op in flight", msg.op, [msg.rank])
        if msg.stream >= len(op.streams):
            raise Refused.op_failure(
                ErrorCode.PROTOCOL, f"rank {msg.rank} sent stream {msg.stream} out of range", [msg.rank]
            )
        if op.peers[msg.rank] != peer:
            # Only the connection that joined the op may send its blocks.
            raise Refused(ErrorCode.PROTOCOL, f"rank {msg.rank} did not join op {msg.op} on this connection",
                           msg.op, [msg.rank])
        s = op.streams[msg.stream]
        if s.done or msg.round != s.round or msg.rank not in s.expected or msg.rank in s.received:
            raise Refused.op_failure(
                ErrorCode.PROTOCOL,
                f"rank {msg.rank} sent stream {msg.stream} round {msg.round} unexpectedly "
                f"(stream at round {s.round}, done={s.done})",
                [msg.rank],
            )
        if len(body) != 2:
            raise Refused.op_failure(
                ErrorCode.PROTOCOL, f"BLOCKS from rank {msg.rank} has {len(body)} frames, expected 2", [msg.rank]
            )
        sel = np.flatnonzero(s.match[msg.rank])
        try:
            ptrs = index_array(body[0])
        except ProtocolError as e:
            raise Refused.op_failure(ErrorCode.PROTOCOL, f"rank {msg.rank} sent bad block pointers: {e}",
                                     [msg.rank]) from None
        if len(ptrs) != len(sel):
            raise Refused.op_failure(
                ErrorCode.PROTOCOL, f"rank {msg.rank} sent {len(ptrs)} pointers, expected {len(sel)}", [msg.rank]
            )
        ids = s.cur[sel]
        self._check_pointers(op, ptrs, s.columns(sel), ids, msg.rank)
        buf = buffer_of(body[1])
        want = op.layout.payload_elements(ids) * op.dtype.itemsize
        if buf.nbytes != want:
            raise Refused.op_failure(
                ErrorCode.PROTOCOL, f"rank {msg.rank} sent a payload of {buf.nbytes} bytes, expected {want}", [msg.rank]
            )
        # The frames stay referenced until the round completes (_advance): count them against the caps.
        self._hold(op, s, buf.nbytes + ptrs.nbytes)
        # Read only once the round completes (_advance), after every rank's blocks are in.
        s.nextp[msg.rank, sel] = ptrs
        s.received[msg.rank] = (sel, payload_values(buf, op.dtype, owned))
        self.counters.blocks_in += len(sel)
        if len(s.received) < len(s.expected):
            return []
        summed = len(s.cur)
        out = self._complete_round(op, s)
        self.counters.rounds += 1
        self.counters.blocks_out += summed * op.world_size
        return out

    def _complete_round(self, op: OpState, s: Stream) -> list[Outgoing]:
        out = self._sum_round(op, s.received, s.cur)
        s.round += 1
        return self._advance(op, s, out)

    def _sum_round(
        self, op: OpState, received: dict[int, tuple[np.ndarray, np.ndarray]], ids: np.ndarray
    ) -> np.ndarray:
        """The payload of the sums of the blocks ``ids``.

        Args:
            received: per rank, the positions (in ``ids``) of the blocks it sent and their payload.
            ids: the blocks summed, in the order of the sums.
        """
        layout = op.layout
        b = layout.block_size
        k = len(ids)
        n_out = layout.payload_elements(ids)
        # Without the short last block, a rank that sent every instructed block (every
        # round of a dense tensor) has a payload that lines up with the sums row for
        # row: it is added as one contiguous array, with no zeroing and no fancy index.
        aligned = n_out == k * b
        acc_type = op.dtype.accumulator
        acc: np.ndarray | None = None
        weights = None if op.weights is None else _sane_weights(op.weights)
        # The first whole payload waits for the second, so that the two are summed in
        # one pass (no zeroing, no copy of the first), into a payload that may be
        # written (a received copy, or one widened here) rather than a new array,
        # whose fresh pages cost more than the sum itself.
        first: np.ndarray | None = None
        # A fixed rank order makes the sums identical from run to run and on every worker.
        for rank in sorted(received):
            sel, payload = received[rank]
            # A weighted op sums weight * blocks (a weight of 1 is skipped: plain sums stay bit-identical).
            w = 1.0 if weights is None else float(weights[rank])
            if aligned and len(sel) == k:
                vals = accumulable(payload.reshape(k, b), op.dtype, w)
                if acc is not None:
                    acc += vals
                elif first is None:
                    first = vals
                else:
                    into = first if first.flags.writeable else vals if vals.flags.writeable else None
                    # IEEE addition commutes: summing into either gives the same bits.
                    acc = np.add(first, vals, out=into)
                continue
            if acc is None:
                # -0.0, not 0.0, for floats: the additive identity, so a block only one rank
                # sent sums to that block's bits (0.0 + -0.0 would be 0.0), as the rank that
                # keeps its own blocks from its input has them: every rank gets the same bits.
                acc = np.full((k, b), -0.0 if acc_type.kind == "f" else 0, dtype=acc_type)
                if first is not None:
                    acc += first
            # Row j of the sums is active column j: a rank's blocks go to the rows it was asked for.
            for sl, view in blocks.split_payload(payload, ids[sel], layout):
                blocks.add_rows(acc, sel[sl], accumulable(view, op.dtype, w))
        if acc is None:
            # One whole payload is its own sum. One that may not be written is copied: from
            # an inproc peer (a co-located worker) it is the worker's own input memory, which
            # the worker may change as soon as its own result arrives, while the copies to
            # the other ranks may still be waiting in their sockets.
            if first is None:
                acc = np.zeros((k, b), dtype=acc_type)
            else:
                acc = first if first.flags.writeable else first.copy()
        if weights is not None:
            # Divided, not multiplied by the inverse: equal weights give the plain mean's bits.
            acc = np.divide(acc, acc_type.type(weights.sum()), dtype=acc_type)
        summed = from_accumulator(acc, op.dtype)
        if aligned:
            return summed.reshape(-1)
        out = np.empty(n_out, dtype=op.dtype.storage)
        for sl, view in blocks.split_payload(out, ids, layout):
            view[:] = summed[sl, : view.shape[1]]
        return out


def _sane_weights(weights: np.ndarray) -> np.ndarray:
    """An op's weights as the sum multiplies by them: as given (sample counts stay exact), or,
    beyond 2**+-60, scaled by a power of two (exactly, in float64) so that the largest is near 1:
    weights of 1e-50 (or 1e36) each are a mean all the same, where in a float32 accumulator
    they would be 0/0 (or inf/inf)."""
    top = float(weights.max())
    if 2.0**-60 <= float(weights.min()) and top <= 2.0**60:
        return weights
    return np.ldexp(weights, -math.frexp(top)[1])
