"""The worker client: sends a tensor's nonzero blocks to the aggregator and gets the sum back.

A :class:`Worker` is one rank's client of one aggregator. It turns the caller's
tensor into an op request (:class:`worker.op.OpRequest`: the flat input or its
data path, the layout, the mode's choice) and hands it to its
:class:`worker.connection.Connection`, whose thread owns the socket and runs
the op (:class:`worker.op.WorkerOp`). Settings are resolved once
(:class:`worker.settings.WorkerSettings`).

Make workers with :func:`worker.connect`: it returns a Worker, a
:class:`worker.sharded.ShardedWorker` or a :class:`worker.colocated.ColocatedWorker`,
all of which implement :class:`worker.api.Allreducer`.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from concurrent.futures import Future
from typing import Any

import numpy as np
import zmq

from omnireduce import blocks, config
from omnireduce.errors import ConfigError, LimitError
from omnireduce.layout import Layout
from worker.auto import PathChooser
from worker.connection import Connection
from worker.cuda import CudaOpData, is_cuda_tensor
from worker.knownrows import KnownRows, KnownRowsOpData, as_known
from worker.loop import WAITS_FOR_ITSELF, CommLoop, OpFuture
from worker.op import OpRequest, PartOf, check_destination
from worker.rows import RowsOpData, is_rows, rows_op_data
from worker.settings import SettingsView, WorkerSettings
from worker.stats import OpStats, Stats
from worker.tensors import is_torch, shares_memory, to_flat

__all__ = ["Worker"]


class Worker(SettingsView):
    """A client of the aggregator for one rank of one job.

    Args:
        address: the aggregator's endpoint; default ``$OMNIREDUCE_ADDRESS``. An
            ``inproc://`` endpoint reaches an aggregator in this process (it must
            share ``context``), without copies through the kernel.
        rank: this worker's rank; default ``$RANK``.
        world_size: the number of workers of the job; default ``$WORLD_SIZE``.
        job: the job id shared by its workers; default ``$OMNIREDUCE_JOB``, else
            ``torchrun-<MASTER_ADDR>:<MASTER_PORT>`` where a torch launcher set them (one per
            launch), else "default".
        block_size: elements per block; default ``$OMNIREDUCE_BLOCK_SIZE``, else 256.
        message_blocks: blocks per message (columns per stream); default
            ``$OMNIREDUCE_MESSAGE_BLOCKS``, else 8192.
        streams: streams in parallel per op; default ``$OMNIREDUCE_STREAMS``, else 16.
        timeout: seconds an op may go without hearing from the aggregator;
            default ``$OMNIREDUCE_TIMEOUT``, else 60.
        context: ZeroMQ context; a private one by default.
        token: the job's shared secret (the job's first worker fixes it); default
            ``$OMNIREDUCE_TOKEN``, else none.
        generation: the job's generation: raise it when the job's workers restart;
            default ``$OMNIREDUCE_GENERATION``, else ``$TORCHELASTIC_RESTART_COUNT``, else 0.
        heartbeat: seconds without hearing from the aggregator after which a heartbeat goes
            (at most one per interval); default ``$OMNIREDUCE_HEARTBEAT``, else 1; 0: off
            (the worker then only answers the aggregator's).
        heartbeat_timeout: seconds of silence after which the connection counts as
            lost; default ``$OMNIREDUCE_HEARTBEAT_TIMEOUT``, else 5.
        curve_server_key: the aggregator's CURVE public key (``.key`` file or Z85
            text); turns CURVE on. Default ``$OMNIREDUCE_CURVE_SERVER_KEY``.
        curve_client_key: this worker's ``.key_secret`` file; default
            ``$OMNIREDUCE_CURVE_CLIENT_KEY``, else a throwaway key pair.
        mode: "sparse" (the block protocol), "dense" (every block sent, no zero-block
            detection), or "auto" (per tensor length, the path :mod:`omnireduce.model`
            predicts faster from the union density the last sparse op of that length
            measured; see :mod:`worker.auto`). Default ``$OMNIREDUCE_MODE``, else sparse.
        max_message_bytes: the largest frame the aggregator accepts (its
            ``--max-message-bytes``): an op whose messages could be larger raises
            :class:`~omnireduce.errors.LimitError` on every rank before anything is sent.
            Default ``$OMNIREDUCE_MAX_MESSAGE_BYTES``, else 64 MiB (the aggregator's default).
        settings: settings resolved already (:meth:`WorkerSettings.resolve`), instead of
            the arguments from ``rank`` on (a sharded worker gives every shard the same).
        loop: the communication thread, shared with other workers of this process (a
            sharded worker's shards share one); a thread of its own by default.

    Example::

        with Worker("tcp://127.0.0.1:5555", rank=0, world_size=2, job="demo") as w:
            y = w.allreduce(x)
    """

    def __new__(cls, address: str | list[str] | tuple[str, ...] | None = None, *args: Any, **kwargs: Any) -> Any:
        """Deprecated: ``Worker`` of several addresses made a :class:`worker.sharded.ShardedWorker`;
        use :func:`worker.connect`. One address makes a plain Worker."""
        value = address if address is not None else os.environ.get(config.OMNIREDUCE_ADDRESS)
        if cls is Worker and (isinstance(value, (list, tuple)) or (isinstance(value, str) and "," in value)):
            warnings.warn("Worker() of several aggregator addresses is deprecated: use worker.connect(addresses)",
                          DeprecationWarning, stacklevel=2)
            from worker.sharded import ShardedWorker  # imports this module: not at the top

            # Not a Worker, so Python does not call Worker.__init__ on it again.
            return ShardedWorker(address, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        address: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        job: str | None = None,
        block_size: int | None = None,
        message_blocks: int | None = None,
        streams: int | None = None,
        timeout: float | None = None,
        context: zmq.Context | None = None,
        *,
        token: str | None = None,
        generation: int | None = None,
        heartbeat: float | None = None,
        heartbeat_timeout: float | None = None,
        curve_server_key: str | os.PathLike[str] | None = None,
        curve_client_key: str | os.PathLike[str] | None = None,
        mode: str | None = None,
        max_message_bytes: int | None = None,
        settings: WorkerSettings | None = None,
        loop: CommLoop | None = None,
    ) -> None:
        self.address: str = config.resolve(address, config.OMNIREDUCE_ADDRESS, None, str)
        if settings is None:
            settings = WorkerSettings.resolve(
                rank, world_size, job, block_size, message_blocks, streams, timeout, token=token,
                generation=generation, heartbeat=heartbeat, heartbeat_timeout=heartbeat_timeout,
                curve_server_key=curve_server_key, curve_client_key=curve_client_key, mode=mode,
                max_message_bytes=max_message_bytes,
            )
        self.settings = settings
        self._chooser = (
            PathChooser(settings.world_size, ring_available=False, block_size=settings.block_size,
                        message_blocks=settings.message_blocks, streams=settings.streams)
            if settings.mode == "auto" else None
        )
        self._connection = Connection(self.address, settings, context, loop)
        self._lock = threading.Lock()
        # Ops submitted and not finished, and since when none has been: the compute time.
        self._outstanding = 0
        self._idle_since: float | None = None

    @property
    def stats(self) -> Stats:
        """What this worker's ops moved."""
        return self._connection.stats

    @property
    def context(self) -> zmq.Context:
        """The ZeroMQ context of this worker's connection (a worker of an ``inproc://``
        address that this one reaches must share it)."""
        return self._connection._ctx

    def __repr__(self) -> str:
        return f"Worker(rank={self.rank}, world_size={self.world_size}, job={self.job!r}, address={self.address!r})"

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def allreduce_async(
        self,
        x: Any,
        inplace: bool = False,
        out: np.ndarray | None = None,
        weight: float | None = None,
        compute_time: float | None = None,
        key: Any = None,
        rows: Any = None,
        dense: bool = False,
        part: PartOf | None = None,
    ) -> Future:
        """Starts a sum over all workers of the job; returns a future of the result.

        Ops are numbered in call order, so every worker must call in the same order.
        ``x`` is read until the future completes: do not modify it before then.

        Args:
            x: a NumPy array, a torch tensor (CPU or CUDA; a sparse COO tensor sums
                its rows: see :mod:`worker.rows`), :class:`worker.rows.SparseRows`, or a
                CUDA array (numba, ``__cuda_array_interface__``), any shape; float32/64,
                float16, bfloat16, or (on the CPU) int8, uint8, int16, int32, int64.
                Of a CUDA tensor only the nonzero blocks are copied to the host.
            inplace: write the sum into ``x`` itself and return ``x`` (CPU tensors only);
                saves allocating and zeroing the result.
            out: a zero-filled, writeable, flat NumPy array of ``x``'s length and
                storage type (uint16 for bfloat16) to write the sum into, instead of
                a new array; the result is then a view of it (CPU tensors only).
            weight: this worker's sample count: the result is then the weighted mean
                ``sum(weight_i * x_i) / sum(weight_i)`` (summed in the aggregator's
                accumulator type). Every worker of the op must give one, or none.
            compute_time: seconds this worker computed for those samples, reported
                for batch balancing (:attr:`recommended_batches`). By default, for a
                weighted op submitted while no other op is in flight, the time since
                this worker's last op finished.
            key: in auto mode, what identifies this tensor from op to op (its
                density history); default its length and dtype.
            rows: for a dense CPU tensor, the indices of its rows (first dimension)
                that may be nonzero, e.g. the ids an embedding looked up this step:
                only they are read and sent, each row one block, with no pass over
                the tensor (see :mod:`worker.knownrows`). Rows not listed are taken
                as zero without being read. The sum is dense (``x``'s type and
                shape), also with ``inplace`` or ``out``. Every worker of the op
                must give ``rows`` (their own), or none.
            dense: for a sparse ``x`` (a COO tensor or :class:`worker.rows.SparseRows`),
                return the sum as a dense tensor of its shape (NumPy for
                ``SparseRows``), written straight from the received rows (or into
                ``out``), instead of a sparse one.
            part: internal to :class:`worker.sharded.ShardedWorker`: the op is a part
                of its op, numbered by it.

        Returns:
            A future of an array or tensor of ``x``'s type, shape and dtype.

        Raises:
            ConfigError: ``x`` is not supported, or ``inplace`` is asked of a tensor
                that is not contiguous, writeable host memory.
        """
        try:
            request = self._request(x, inplace, out, weight, compute_time, key, rows, dense)
            request.part = part
            if part is not None:
                request.op = part.op
        except Exception as e:
            # Every other rank's op of the number this one would have taken fails at once, naming
            # this rank and why, and the ranks' later ops keep their numbers in step.
            self.refuse(e, part=part)
            raise
        fut = request.future
        with self._lock:
            if weight is not None and compute_time is None and self._outstanding == 0 and self._idle_since is not None:
                compute_time = time.monotonic() - self._idle_since
            request.compute = None if compute_time is None else float(compute_time)
            self._outstanding += 1
            fut.add_done_callback(self._op_finished)  # not done yet: runs later, on the connection's thread
            try:
                self._connection.submit(request)
            except BaseException:
                self._outstanding -= 1
                raise
        return fut

    def _request(self, x: Any, inplace: bool, out: np.ndarray | None, weight: float | None,
                 compute_time: float | None, key: Any, rows: Any, dense: bool) -> OpRequest:
        """The checked request of :meth:`allreduce_async`'s op (its compute time still to set).

        Raises:
            ConfigError: the arguments are not usable (see :meth:`allreduce_async`).
        """
        for name, v, positive in (("weight", weight, True), ("compute_time", compute_time, False)):
            if v is not None:
                config.check_number(name, v, positive=positive)
        data: CudaOpData | RowsOpData | KnownRowsOpData | None = None
        layout: Layout | None = None
        known = as_known(x, rows, dense, inplace, out, self.world_size)
        if known is not None:
            x, inplace, out = known, False, None
        if isinstance(x, KnownRows):  # rows= given, or a sharded op's part of such an op
            data = KnownRowsOpData(x)
            flat, dtype, length = None, data.dtype, data.length
            restore = data.restore
            layout = data.layout()
        elif is_rows(x):
            data = rows_op_data(x, inplace, out)
            flat, dtype, length = None, data.dtype, data.length
            restore = data.restore
            layout = data.layout()  # its own, from the row count: not the settings' streams
        elif is_cuda_tensor(x):
            if inplace or out is not None:
                raise ConfigError("an in-place allreduce or out= of a CUDA tensor is not supported")
            # A strided view is summed from a contiguous copy, as a CPU tensor and a sharded worker's are.
            if is_torch(x) and not x.is_contiguous():
                x = x.contiguous()
            data = CudaOpData(x, self.block_size)
            flat, dtype, length = None, data.dtype, data.length
            restore: Any = lambda _out: data.finish()  # noqa: E731
        else:
            flat, dtype, restore = to_flat(x)
            length = len(flat)
            check_destination(flat, dtype, inplace, out)
            if inplace and not shares_memory(x, flat):
                raise ConfigError("an in-place allreduce needs a contiguous tensor (this one would be copied)")
            if inplace:
                restore = lambda _out: x  # noqa: E731
        if weight is not None and dtype.is_integer:
            raise ConfigError(f"weight is not supported for {dtype.name.lower()} tensors: an integer allreduce is an "
                              "exact sum, and a weighted mean has no integer result")
        if layout is None:
            layout = Layout(length, self.block_size, self.message_blocks, self.streams)
        message, limit = layout.message_bytes(dtype.itemsize), self.settings.max_message_bytes
        if message > limit:
            # Sent, such a START would have the aggregator cut the connection (ZeroMQ's
            # MAXMSGSIZE) and count this rank as lost: the job would be over.
            raise LimitError(f"messages of this op would carry up to {message} bytes, above the limit of {limit} "
                             "(max_message_bytes: the aggregator's --max-message-bytes); use smaller blocks (a sparse "
                             "tensor's row is one) or fewer blocks per message, or raise both limits")
        dense, auto_key = False, None
        if data is None and self.mode == "dense":
            dense = True
        elif data is None and self._chooser is not None:
            auto_key = (length, int(dtype)) if key is None else key
            try:
                hash(auto_key)
            except TypeError:
                raise ConfigError(f"key must be hashable, got {type(auto_key).__name__}") from None
            dense = self._chooser.choose(auto_key, length, dtype.itemsize) == "dense"
        if flat is not None and not dense:
            blocks.warm(flat, layout.block_size)  # here, not on the communication thread (see warm)
        elif data is not None and not dense:
            blocks.warm_next_table(layout.num_blocks)
        return OpRequest(
            flat, dtype, layout, restore, OpFuture(self._connection.loop), inplace, data, out,
            None if weight is None else float(weight),
            dense=dense, measured=self._measure(auto_key) if auto_key is not None and not dense else None,
        )

    def refuse(self, error: BaseException, x: Any = None, *, part: PartOf | None = None, **options: Any) -> None:
        """Takes the next op number for an op this rank will not send, and fails that op on
        every rank: theirs raise :class:`~omnireduce.errors.PeerRefusedError` naming this rank
        and ``error``, at once instead of at their timeout.

        :meth:`allreduce_async` does this itself for the arguments it refuses. A caller
        whose own checks refuse an op that every rank makes (a process group's collective)
        calls this instead of submitting it, so that the ranks' op numbers stay in step.

        Args:
            error: why (its type and message are sent).
            x: the tensor the op would have summed; unused (one aggregator: one number).
            part: internal: the sharded op whose part is refused (its number).
            **options: the op's options; unused.
        """
        self._connection.abort(error, op=-1 if part is None else part.op)

    def allreduce(self, x: Any, **options: Any) -> Any:
        """Sums ``x`` over all workers of the job and returns the result.

        Args:
            x: the tensor (see :meth:`allreduce_async`).
            **options: :meth:`allreduce_async`'s options (``inplace``, ``out``,
                ``weight``, ``compute_time``, ``key``, ``rows``).

        Raises:
            OmniReduceError: the op failed (mismatch, timeout, aggregator error, closed worker).
            RuntimeError: called on the worker's communication thread (in an op's callback),
                which would wait for itself: use :meth:`allreduce_async` there.
        """
        if self._connection.on_loop_thread:
            raise RuntimeError(WAITS_FOR_ITSELF)
        return self.allreduce_async(x, **options).result()

    @property
    def recommended_batches(self) -> list[float] | None:
        """The aggregator's latest recommended batch size per rank, or None.

        Sent with every weighted op for which every rank reported a compute time:
        the op's total weight (the global batch) split in proportion to the ranks'
        smoothed speeds (samples per compute second). :mod:`worker.balance` turns
        it into integer batch sizes.
        """
        return self._connection.batches

    def set_timeout(self, seconds: float) -> None:
        """Sets the op timeout (``timeout``) for the ops in flight and those to come.

        Args:
            seconds: how long an op may go without hearing from the aggregator.

        Raises:
            ConfigError: ``seconds`` is not a positive finite number.
        """
        self.settings = self.settings.with_timeout(seconds)
        self._connection.set_timeout(self.settings.timeout)

    def close(self) -> None:
        """Stops the communication thread; pending ops fail with WorkerClosedError."""
        self._connection.close()

    def _measure(self, key: Any) -> Any:
        chooser = self._chooser
        assert chooser is not None

        def measured(stats: OpStats) -> None:
            chooser.record(key, stats.union_density)

        return measured

    def _op_finished(self, _fut: Future) -> None:
        with self._lock:
            self._outstanding -= 1
            if self._outstanding == 0:
                self._idle_since = time.monotonic()

