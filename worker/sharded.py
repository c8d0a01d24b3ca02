"""Sharded aggregators: one worker spreads every tensor over several aggregators.

One aggregator's link carries every byte of every worker, so it bounds a dense
allreduce. OmniReduce runs several aggregators and stripes its slots over them
(slot ``s`` goes to aggregator ``s % number of aggregators``). Here the striping
is done per contiguous range: a tensor of ``nb`` blocks is cut on block
boundaries into one chunk per shard, chunk ``k`` being blocks
``[k * nb // S, (k + 1) * nb // S)``, and chunk ``k`` is an ordinary op of an
ordinary :class:`worker.client.Worker` connected to shard ``k``. The shards run
their ops in parallel, each with its own connection and streams, all served by
one communication thread (:class:`worker.loop.CommLoop`: an op wakes one thread,
not one per shard), and each aggregator holds only its chunk's state. Contiguous chunks
keep every shard's result a plain slice of the output, so the sums are written
in place with no gather step, and results are bit for bit those of one
aggregator (a block's sum does not depend on which aggregator computes it).

The rows of a row-sparse tensor (:class:`worker.rows.SparseRows`, a sparse COO
tensor) are dealt instead: row ``r`` to shard ``r % S`` (:meth:`SparseRows.deal`),
so that a table whose frequent rows come first does not load one shard and its link.

A small op is not split over every shard: each shard's part costs a message each
way on every rank and on the shard, and below a few hundred KiB per shard those
messages, not the links, bound the op. An op expected to move ``b`` bytes goes to
``ceil(b / shard_bytes)`` shards (at least one, at most all; ``OMNIREDUCE_SHARD_BYTES``),
taken in turn from op to op so that every shard, and every co-located rank's
process, gets its share of the small ops. ``b`` is the tensor's dense size; for
an op given a ``key=`` (the DDP hook gives each bucket one), its dense size times
the union density of the last op of that key (and kind and size), which every
rank measured alike. An op waits for the last op of its key if that one is still
running, so a key must name one tensor, not ops meant to overlap. Every rank makes
the same choice from the same op sequence, so each shard sees the same ops from
every rank; a shard may get an empty chunk (a tensor of fewer blocks than the
shards it goes to).

Every part of the sharded worker's op ``n`` is op ``n`` at its shard (numbered by
the sharded worker, not by the shard's connection), starting at shard ``n % S``,
and its START says which part of how many it is (:class:`worker.op.PartOf`): ranks
that split an op differently (tensors of other sizes, a misconfigured
``shard_bytes``, shards listed in another order) fail it on every rank, where their
parts would otherwise have been summed with other parts, and their next ops are in
step again.

``worker.connect([addr0, addr1], ...)`` or ``worker.connect("tcp://a:5555,tcp://b:5555", ...)``
(or a comma-separated ``OMNIREDUCE_ADDRESS``) returns a :class:`ShardedWorker`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import zmq

from omnireduce import config
from omnireduce.errors import ConfigError, OmniReduceError, OpError, WorkerClosedError
from omnireduce.layout import shard_eager_pieces
from worker.client import Worker
from worker.cuda import check_cuda_torch_dtype, is_cuda_tensor
from worker.knownrows import KnownRows, as_known
from worker.loop import WAITS_FOR_ITSELF, CommLoop, OpFuture
from worker.op import LAZY_ZEROS_BYTES, PartOf, check_destination, lazy_zeros, pages_written
from worker.rows import RowPieces, ShardChunk, SparseRows, is_rows, rows_op_data
from worker.settings import SettingsView, WorkerSettings
from worker.stats import OpStats, Stats, merge_parallel
from worker.tensors import is_torch, shares_memory, to_flat

logger = logging.getLogger(__name__)

__all__ = ["ShardedWorker", "shard_bounds"]

# Blocks sampled to guess a tensor's density, which decides how its result is allocated.
_SAMPLE_BLOCKS = 1024
_WAIT_MARGIN_S = 60.0
# Keys whose last op's density is kept (a DDP model has one per bucket).
_KEYS_KEPT = 4096
# The options a shard's allreduce takes (checked before any shard is handed a part).
_SHARD_OPTIONS = frozenset(inspect.signature(Worker.allreduce_async).parameters) - {"self", "x", "part"}


def shard_bounds(length: int, block_size: int, shards: int) -> list[tuple[int, int]]:
    """The element range ``[lo, hi)`` of every shard's chunk of a tensor.

    Chunk ``k`` holds blocks ``[k * nb // shards, (k + 1) * nb // shards)`` of the
    ``nb`` blocks, so chunk sizes differ by at most one block and only the last
    chunk may end in a partial block. With fewer blocks than shards some chunks
    are empty.

    Args:
        length: elements of the tensor.
        block_size: elements per block.
        shards: number of shards.
    """
    nb = -(-length // block_size)
    edges = [min(k * nb // shards * block_size, length) for k in range(shards + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


class _Gather:
    """Completes one sharded op's future once every shard's future has completed."""

    def __init__(self, owner: ShardedWorker, future: Future, op: int, targets: list[int], finish: Any) -> None:
        self.owner = owner
        self.future: Future | None = future
        self.finish: Any = finish
        # Part i of the op went to shard targets[i].
        self.targets = targets
        self.started = time.monotonic()
        parts = len(targets)
        self.results: list[Any] = [None] * parts
        self.stats: list[OpStats | None] = [None] * parts
        self.left = parts
        #: The sharded worker's number of this op (its shards number their parts their own way).
        self.op = op
        self.settled = False
        self.lock = threading.Lock()
        #: The union's share of the tensor's blocks once every shard's part succeeded (the
        #: same on every rank: what the next op of its key estimates its bytes from), even if
        #: converting the result then failed here; None if a part failed.
        self.density: float | None = None
        #: Set once the op completed (and ``density`` is final), before its future is.
        self.done = threading.Event()

    def on_done(self, i: int, fut: Future) -> None:
        # Runs on the communication thread, right after part i's shard worker recorded
        # the op's stats: its stats.last is this op's.
        error = fut.exception()
        k = self.targets[i]
        with self.lock:
            if self.settled:
                return  # failed already: the first error wins
            if error is None:
                self.results[i] = fut.result()
                self.stats[i] = getattr(fut, "op_stats", None) or self.owner.shards[k].stats.last
                self.left -= 1
                if self.left:
                    return
            self.settled = True
        if error is not None:
            self._end(error=self.owner._shard_error(k, error))
            return
        merged = self.owner._record(self.stats, time.monotonic() - self.started, self.op)
        # A part that went the dense way counts every block in its union (merge_parallel), as
        # the ranks whose part went the sparse way measure it: each rank's parts may take
        # either path (auto mode, each host's own cost file), and all must size the key's next
        # op alike. Recorded before the result is converted: a conversion that fails on this rank alone
        # must not make this rank size the key's next op apart from the others (nor the DDP
        # hook's auto mode miss the density that the other ranks record: the stats go on the
        # future, as a plain Worker's do, whether or not the conversion then fails).
        self.density = merged.union_density
        assert self.future is not None  # ended only below and on a failure, once
        self.future.op_stats = merged  # type: ignore[attr-defined]
        try:
            result = self.finish(self.results)
        except Exception as e:  # a failed conversion fails this op, not a shard's thread
            logger.exception("sharded worker rank %d of job %r: result conversion failed",
                             self.owner.rank, self.owner.job)
            self._end(error=e if isinstance(e, OmniReduceError) else OpError(f"result conversion: {e!r}"))
            return
        self._end(result=result)

    def _end(self, **outcome: Any) -> None:
        # The worker keeps this object for the next op of its key (its density): not what holds
        # the result or the input (the future, the finishing closure), which would keep a second
        # copy of every key's tensor alive (a DDP bucket each) until the key's next op.
        future, self.future, self.finish, self.results = self.future, None, None, []
        self.done.set()
        assert future is not None
        _settle(future, **outcome)


class ShardedWorker(SettingsView):
    """A worker of one rank whose ops are split over several aggregators (shards).

    Usually made by :func:`worker.connect` with several addresses. Every shard's
    :class:`worker.client.Worker` gets the same settings (rank, world size, job,
    token, generation, keys). Every worker of a job must list the same shards in
    the same order.

    Args:
        address: the shards' endpoints: a list or tuple, or one comma-separated
            string; default ``$OMNIREDUCE_ADDRESS``.
        rank: this worker's rank; default ``$RANK``.
        world_size: the number of workers; default ``$WORLD_SIZE``.
        job: the job id; default ``$OMNIREDUCE_JOB``, else "default".
        context: ZeroMQ context shared by the shards' workers; a private one each by default.
        shard_bytes: an op expected to move ``b`` bytes goes to ``ceil(b / shard_bytes)``
            shards (at least one, at most all), in turn; 0 sends every op to every shard. Default
            ``$OMNIREDUCE_SHARD_BYTES``, else :data:`omnireduce.config.DEFAULT_SHARD_BYTES`.
            Every worker of a job must use the same value.
        settings: settings resolved already, instead of ``rank``, ``world_size``, ``job``
            and ``**options``.
        **options: the other settings of :class:`worker.client.Worker` (``block_size``,
            ``timeout``, ``token``, ``mode``, ...).

    Raises:
        ConfigError: no address, an address listed twice, or bad settings.
    """

    def __init__(
        self,
        address: str | Sequence[str] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        job: str | None = None,
        *,
        context: zmq.Context | None = None,
        shard_bytes: int | None = None,
        settings: WorkerSettings | None = None,
        **options: Any,
    ) -> None:
        self.shard_bytes = config.resolve(shard_bytes, config.OMNIREDUCE_SHARD_BYTES, config.DEFAULT_SHARD_BYTES, int)
        if type(self.shard_bytes) is not int or self.shard_bytes < 0:
            raise ConfigError(f"shard_bytes must be a non-negative integer, got {self.shard_bytes!r}")
        addresses = config.split_addresses(config.resolve(address, config.OMNIREDUCE_ADDRESS, None, _identity))
        if not addresses:
            raise ConfigError("no aggregator address given")
        if len(set(addresses)) != len(addresses):
            raise ConfigError(f"an aggregator address is listed twice: {addresses}")
        if settings is None:
            settings = WorkerSettings.resolve(rank, world_size, job, **options)
        elif rank is not None or world_size is not None or job is not None or options:
            raise ConfigError("give either settings or the settings' arguments, not both")
        self.settings = settings
        # Each shard cuts its part of an eager op in its share of the pieces.
        shard_settings = dataclasses.replace(
            settings, eager_pieces=shard_eager_pieces(len(addresses), settings.eager_pieces))
        self.addresses = tuple(addresses)
        self.address = ",".join(addresses)
        self.shards: list[Worker] = []
        # One communication thread for every shard: an op wakes one thread, not one per shard.
        self._loop = CommLoop(context, name=f"omnireduce-worker-r{settings.rank}")
        try:
            for a in addresses:
                self.shards.append(Worker(a, context=context, settings=shard_settings, loop=self._loop))
        except BaseException:
            for w in self.shards:
                w.close()
            self._loop.close()
            raise
        self.stats = Stats()
        self._stats_lock = threading.Lock()
        # Held while one op is handed to every shard, so concurrent callers cannot
        # interleave and give two shards different op numbers for one tensor.
        self._submit_lock = threading.Lock()
        self._closed = False
        self._broken: BaseException | None = None
        # The shard whose aggregator's batch recommendation stands (see recommended_batches).
        self._balanced = 0
        # Ops taken so far: an op's number in its stats (a shard sees only the ops sent to it).
        self._ops = 0
        # Per key (kind, dense bytes, the caller's key), the last op: its union density
        # estimates the next one's bytes.
        self._last_of: OrderedDict[Hashable, _Gather] = OrderedDict()
        logger.info("worker rank %d of job %r: %d aggregator shards: %s", self.rank, self.job, len(addresses),
                    ", ".join(addresses))

    def __enter__(self) -> ShardedWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ShardedWorker(rank={self.rank}, world_size={self.world_size}, job={self.job!r}, "
                f"shards={self.address!r})")

    def allreduce_async(self, x: Any, inplace: bool = False, out: np.ndarray | None = None, **kwargs: Any) -> Future:
        """Starts a sum over all workers of the job, chunk ``k`` on shard ``k``; returns its future.

        Same contract as :meth:`Worker.allreduce_async`. A torch CUDA tensor is
        split into contiguous device views, each shard returns its chunk's sum on
        the device and the chunks are joined with ``torch.cat`` (one device copy);
        other CUDA arrays are not supported. If one shard's op fails, the future
        fails at once with that error (same type, message naming the shard), while
        the other shards may still write into ``out`` or, with ``inplace``, ``x``.

        Args:
            x: a NumPy array, a torch tensor (CPU or CUDA), float32/64, float16 or bfloat16.
            inplace: write the sum into ``x`` itself (contiguous CPU tensors only).
            out: a zero-filled, writeable, flat array of ``x``'s length and storage
                type to write the sum into (CPU tensors only).
            **kwargs: further options of :meth:`Worker.allreduce_async`, passed to every
                shard, except ``rows`` (a dense tensor's given rows, see
                :mod:`worker.knownrows`): the rows are dealt to the shards, each shard's
                part reading and writing its rows of ``x`` (or of the result) in place.

        Returns:
            A future of an array or tensor of ``x``'s type, shape and dtype.

        Raises:
            ConfigError: ``x`` is not supported, or ``inplace``/``out`` do not fit it.
            WorkerClosedError: the worker is closed, or a shard's connection was closed while
                the others took an op (their op numbers no longer agree).
        """
        given = x
        rows, dense = kwargs.pop("rows", None), kwargs.pop("dense", False)
        parts: int | None = None
        key: Hashable | None = None
        shape: tuple[int, ...] | None = None
        try:
            # A misspelt option fails here, on every shard alike, not at the shard it first reaches.
            if not _SHARD_OPTIONS.issuperset(kwargs):
                if "part" in kwargs:
                    raise ConfigError("part is set by the sharded worker itself")
                unknown = sorted(set(kwargs) - _SHARD_OPTIONS)
                raise TypeError(f"allreduce_async() got unexpected keyword arguments {unknown}")
            known = as_known(x, rows, dense, inplace, out, self.world_size)
            if known is not None:
                x = known
            parts, key = self._parts_for(x, kwargs)
            device = False
            if isinstance(x, KnownRows):
                # Each shard's part reads and writes its rows through a strided view: nothing to join.
                chunks = x.deal(parts)
                chunk_kwargs: list[dict[str, Any]] = [{} for _ in chunks]
                finish: Any = lambda _results, x=x: x.result  # noqa: E731
            elif is_rows(x):
                chunks, finish, shape = self._split_rows(x, inplace, out, parts)
                chunk_kwargs = [{} for _ in chunks]
            elif is_cuda_tensor(x):
                device = True
                chunks, finish = self._split_cuda(x, inplace, out, parts)
                chunk_kwargs = [{} for _ in chunks]
            else:
                chunks, chunk_kwargs, finish = self._split_host(x, inplace, out, parts)
        except Exception as e:
            if parts is None:
                # Its history key as the other ranks know it: a tensor of given rows where rows= or dense= was asked.
                self.refuse(e, given, known=rows is not None or bool(dense), **kwargs)
            else:
                self.refuse(e, history=key)
            raise
        fut: Future = OpFuture(self._loop)
        # The thread is woken once every shard's request is queued and every callback set:
        # woken earlier, it would contend with this caller for the GIL. Not for a device
        # tensor, whose shards' parts are prepared on the device one by one: the first
        # may go out while the caller waits on the device for the next.
        with contextlib.nullcontext() if device else self._loop.held_wakes():
            gather, shard_futures = self._submit(fut, parts, chunks, chunk_kwargs, kwargs, finish, key, shape)
            for i, f in enumerate(shard_futures):
                f.add_done_callback(lambda f, i=i: gather.on_done(i, f))
        return fut

    def _submit(self, fut: Future, parts: int, chunks: list[Any], chunk_kwargs: list[dict[str, Any]],
                kwargs: dict[str, Any], finish: Any, key: Hashable | None,
                shape: tuple[int, ...] | None) -> tuple[_Gather, list[Future]]:
        """Hands every part of one op to its shard, each under the op's number; returns the op's
        gather and the shards' futures."""
        with self._submit_lock:
            if self._closed or self._broken is not None:
                raise WorkerClosedError(
                    f"sharded worker rank {self.rank} of job {self.job!r} is closed"
                    + ("" if self._broken is None else f" (a shard failed to take an op: {self._broken})")
                ) from self._broken
            seq = self._ops
            targets = self._targets(seq, parts)
            gather = _Gather(self, fut, seq, targets, finish)
            shard_futures = []
            for i, (k, chunk) in enumerate(zip(targets, chunks, strict=True)):
                try:
                    part = PartOf(seq, i, parts, shape)
                    shard_futures.append(self.shards[k].allreduce_async(chunk, **chunk_kwargs[i], **kwargs, part=part))
                except BaseException as e:
                    if isinstance(e, WorkerClosedError):
                        # A shard closed under this worker: it can no longer sum its parts.
                        self._broken = e
                        logger.error("sharded worker rank %d of job %r: shard %d (%s) refused an op: %s",
                                     self.rank, self.job, k, self.addresses[k], e)
                    else:
                        # Shard k refused its part (its Worker told its aggregator); every shard
                        # that has no part of it yet refuses the op too.
                        self._refuse_at(e, [j for j in range(len(self.shards)) if j != k and j not in targets[:i]])
                        self._advance(key)
                    raise self._shard_error(k, e) from e
            self._advance()
            if kwargs.get("weight") is not None or kwargs.get("compute_time") is not None:
                self._balanced = targets[0]
            if key is not None:
                # Every rank sends the same keyed ops in the same order, so every rank forgets the
                # same keys (a key forgotten sizes its next op as one with no history: density 1).
                self._last_of[key] = gather
                self._last_of.move_to_end(key)
                if len(self._last_of) > _KEYS_KEPT:
                    self._last_of.popitem(last=False)
        return gather, shard_futures

    def _targets(self, seq: int, parts: int) -> list[int]:
        """The shards of op ``seq`` of ``parts`` parts: in turn, from the op's number alone, so
        that ranks that split one op differently (and failed it) agree on the next ones."""
        nshards = len(self.shards)
        return [(seq + i) % nshards for i in range(parts)]

    def _refuse_at(self, error: BaseException, shards: list[int]) -> None:
        """Refuses the next op (``self._ops``) at ``shards`` (under ``_submit_lock``): it then fails on
        every rank wherever the other ranks sent their parts (an ABORT names the op number only)."""
        for k in shards:
            self.shards[k].refuse(error, part=PartOf(self._ops, 0, 1))

    def _advance(self, refused: Hashable | None = None) -> None:
        """Counts an op (under ``_submit_lock``); ``refused``: the history key of an op refused
        here, whose history is forgotten: on the other ranks its op failed, and a failed op's
        density counts as 1, as no history does."""
        self._ops += 1
        if refused is not None:
            self._last_of.pop(refused, None)

    def refuse(self, error: BaseException, x: Any = None, *, history: Hashable | None = None, known: bool = False,
               **options: Any) -> None:
        """Takes the next op's number for an op this rank will not send, and fails it on every
        rank (see :meth:`worker.client.Worker.refuse`): every shard is told, wherever the
        other ranks sent their parts.

        Args:
            error: why (its type and message are sent).
            x: the tensor the op would have summed, whose size (with ``options``, as in
                :meth:`allreduce_async`) gives the key of its history, which is forgotten.
            history: that key, where known already (then without ``x``).
            known: ``x`` was to be summed from given rows (``rows=`` or ``dense=True``): its
                history is that of such ops.
            **options: the op's options (``weight``, ``key``, ...).
        """
        if x is not None:
            try:
                _, history = self._parts_for(x, options, known=known)
            except Exception:  # noqa: BLE001 - x is what was refused: no history to forget, then
                logger.debug("sharded worker rank %d: no history key for a refused op", self.rank, exc_info=True)
        with self._submit_lock:
            if self._closed or self._broken is not None:
                return
            self._refuse_at(error, list(range(len(self.shards))))
            self._advance(history)

    def allreduce(self, x: Any, **options: Any) -> Any:
        """Sums ``x`` over all workers of the job and returns the result (see :meth:`allreduce_async`).

        Raises:
            OmniReduceError: the op failed on a shard (the message names it).
            RuntimeError: called on the communication thread (in an op's callback), which
                would wait for itself: use :meth:`allreduce_async` there.
        """
        if self._loop.on_thread:
            raise RuntimeError(WAITS_FOR_ITSELF)
        return self.allreduce_async(x, **options).result()

    @property
    def recommended_batches(self) -> list[float] | None:
        """The recommended batch size per rank, or None: that of the aggregator of the first
        shard of the last weighted op sent (or one reporting a compute time).

        A small op goes to one shard in turn, so each shard's aggregator smooths the speeds
        of the weighted ops it took; every rank sends the same ops to the same shards, so
        every rank reads the same recommendation.
        """
        return self.shards[self._balanced].recommended_batches

    def set_timeout(self, seconds: float) -> None:
        """Sets the op timeout of every shard's connection (:meth:`Worker.set_timeout`)."""
        self.settings = self.settings.with_timeout(seconds)
        for shard in self.shards:
            shard.set_timeout(self.settings.timeout)

    def close(self) -> None:
        """Closes every shard's worker; pending ops fail with WorkerClosedError."""
        self._close_shards()
        self._loop.close()

    def _close_shards(self) -> None:
        with self._submit_lock:
            self._closed = True
        for w in self.shards:
            w.close()

    # Splitting and joining.

    def _parts_for(self, x: Any, kwargs: dict[str, Any], known: bool = False) -> tuple[int, Hashable | None]:
        """How many shards an op of ``x`` goes to, and the key of its history.

        One per ``shard_bytes`` of its expected bytes (at least one): its dense size, or
        with a ``key=``, that times the union density of the last op of the same key (same
        kind, same dense size), which every rank measured alike. A rank's own nonzero
        count would not do: the ranks must agree.
        """
        nshards = len(self.shards)
        # Nothing a rank gives for itself alone (a weight, a compute time) may count here: a
        # rank that gave one where the others did not would take other shards, and every
        # shard's op numbers after it would pair with the wrong ops (silently wrong sums).
        if self.shard_bytes == 0:
            return nshards, None
        nbytes = _dense_bytes(x)
        if nbytes is None:
            return nshards, None  # not a tensor: the split raises the error naming its type
        # No history without a key: ops of one size may be meant to run at once (DDP
        # buckets of equal size), and the next must not wait for the last.
        kind = "known" if known or isinstance(x, KnownRows) else is_rows(x)
        key = None if kwargs.get("key") is None else (kind, nbytes, kwargs["key"])
        expected = nbytes if key is None else nbytes * self._last_density(key)
        return max(1, min(nshards, math.ceil(expected / self.shard_bytes))), key

    def _last_density(self, key: Hashable) -> float:
        """The union density of the last op of ``key``; 1 if there was none or it failed.

        Waits for that op if it is still running, so that the estimate does not depend on
        timing (every rank must choose the same shards) — except on the communication
        thread (a callback), which cannot wait for itself: such a rare op takes 1 whether
        or not the last one is done here (which depends on timing).
        """
        last = self._last_of.get(key)
        if last is None or self._loop.on_thread:
            return 1.0
        if not last.done.is_set():
            # Every op ends within its timeout (failed if need be); the margin is for safety.
            last.done.wait(self.timeout + _WAIT_MARGIN_S)
        return 1.0 if last.density is None else last.density

    def _split_host(
        self, x: Any, inplace: bool, out: np.ndarray | None, parts: int
    ) -> tuple[list[Any], list[dict[str, Any]], Any]:
        # Chunks are views of a flat tensor of x's own kind (NumPy or torch), so that a
        # bfloat16 torch tensor stays bfloat16 for the shards; the wire array (uint16
        # bits for bfloat16) gives the storage type of the shared result.
        shape = x.shape if hasattr(x, "shape") else None
        if isinstance(x, np.ndarray):
            native = np.ascontiguousarray(x).reshape(-1)
        elif is_torch(x):
            native = x.detach().contiguous().reshape(-1)
        else:
            to_flat(x)  # raises the ConfigError naming the unsupported type
            raise ConfigError(f"allreduce takes a NumPy array or a torch tensor, got {type(x).__name__}")
        wire, dtype, restore = to_flat(native)
        n = len(wire)
        storage = np.dtype(dtype.storage)
        bounds = shard_bounds(n, self.block_size, parts)
        chunks = [native[lo:hi] for lo, hi in bounds]
        check_destination(wire, dtype, inplace, out)
        if inplace:
            if not shares_memory(x, wire):
                raise ConfigError("an in-place allreduce needs a contiguous tensor (this one would be copied)")
            return chunks, [{"inplace": True} for _ in chunks], lambda _results: x
        full = out if out is not None else lazy_zeros(n, storage, self._written(wire, dtype.itemsize))
        return (
            chunks,
            [{"out": full[lo:hi]} for lo, hi in bounds],
            lambda _results: restore(full).reshape(shape),
        )

    def _split_rows(self, x: Any, inplace: bool, out: Any, parts: int) -> tuple[list[Any], Any, tuple[int, ...]]:
        # Rows are dealt round-robin (row r to shard r % S), not cut in ranges as a dense
        # tensor's blocks are: an embedding's frequent rows often come first, and ranges
        # would load one shard (and its link) with most of them. Each shard returns the
        # union of its rows.
        data = rows_op_data(x, inplace, out)
        rows = data.x
        # Shard chunks: each shard's op hands back its rows as received, and they are
        # joined here in one copy (not one per shard and one more here).
        chunks = rows.deal(parts, ShardChunk)

        def finish(results: list[RowPieces]) -> Any:
            joined = RowPieces.join(results, rows.num_rows, rows.shape)
            return joined if data.sparse_dim is None else joined.to_torch(data.sparse_dim)

        return chunks, finish, rows.dense_shape

    def _split_cuda(self, x: Any, inplace: bool, out: Any, parts: int) -> tuple[list[Any], Any]:
        if not is_torch(x):
            raise ConfigError(
                "a sharded allreduce of a CUDA array supports torch tensors only; "
                f"got {type(x).__name__} (wrap it with torch.as_tensor)"
            )
        if inplace or out is not None:
            raise ConfigError("an in-place allreduce or out= of a CUDA tensor is not supported")
        # Before any shard takes a part: a chunk left empty goes as a host tensor, which
        # would be taken, and a refusal by a later shard would break the worker for good.
        check_cuda_torch_dtype(x)
        import torch

        shape = x.shape
        flat = x.detach().contiguous().reshape(-1)
        bounds = shard_bounds(flat.numel(), self.block_size, parts)
        # An empty chunk goes as an empty host tensor of the same dtype: the op's length
        # and type are all the aggregator checks, and no device work is started for it.
        chunks = [flat[lo:hi] if hi > lo else torch.empty(0, dtype=flat.dtype) for lo, hi in bounds]

        def finish(results: list[Any]) -> Any:
            parts = [r.reshape(-1) for r, (lo, hi) in zip(results, bounds, strict=True) if hi > lo]
            if not parts:
                return torch.zeros(shape, dtype=flat.dtype, device=flat.device)
            return (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(shape)

        return chunks, finish

    def _written(self, wire: np.ndarray, itemsize: int) -> float:
        """The expected fraction of the result's 4 KiB pages that will be written.

        The shards' ops compute each chunk's exact block mask later, on their own
        threads; a sample of blocks is enough to choose how the result is allocated.
        """
        nb = len(wire) // self.block_size
        if nb == 0 or wire.nbytes < LAZY_ZEROS_BYTES:
            return 1.0  # below LAZY_ZEROS_BYTES lazy_zeros allocates plain zeros whatever the estimate
        rows = wire[: nb * self.block_size].reshape(nb, self.block_size)
        picks = np.linspace(0, nb - 1, min(nb, _SAMPLE_BLOCKS)).astype(np.intp)
        own = float(np.count_nonzero(rows[picks].any(axis=1))) / len(picks)
        return pages_written(own, self.world_size, self.block_size * itemsize)

    # Errors and stats.

    def _shard_error(self, k: int, error: BaseException) -> BaseException:
        """Shard ``k``'s error as the same omnireduce type, its message naming the shard."""
        where = f"shard {k} ({self.addresses[k]})"
        new: BaseException
        try:
            if isinstance(error, OpError):
                new = type(error)(f"{where}: {error.reason}", job=error.job, op=error.op, ranks=error.ranks)
            elif isinstance(error, OmniReduceError):
                new = type(error)(f"{where}: {error}")
            else:
                new = OpError(f"{where}: {error!r}", job=self.job)
        except TypeError:  # a subclass with another constructor: keep the original
            return error
        new.__cause__ = error
        return new

    def _record(self, parts: list[OpStats | None], seconds: float, op: int) -> OpStats:
        merged = merge_parallel([p for p in parts if p is not None], seconds)
        merged.op = op
        with self._stats_lock:
            self.stats.add(merged)
        return merged


def _identity(text: str) -> str:
    return text


def _dense_bytes(x: Any) -> int | None:
    """The bytes of ``x`` as a dense tensor (a sparse tensor's too), or None if it is no tensor."""
    if isinstance(x, np.ndarray):
        return int(x.nbytes)
    if isinstance(x, SparseRows):
        return int(x.num_rows) * int(x.row_width) * int(x.values.dtype.itemsize)
    if isinstance(x, KnownRows):
        return x.nbytes
    if is_torch(x):
        return int(x.numel()) * int(x.element_size())
    return None


def _settle(fut: Future, result: Any = None, error: BaseException | None = None) -> None:
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except Exception:  # the caller cancelled the future: nobody waits for it
        pass
