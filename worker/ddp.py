"""A DDP communication hook that reduces gradient buckets through the aggregator.

Usage, one line after wrapping the model::

    w = worker.connect()                             # address, rank, world from the environment
    ddp_model.register_comm_hook(OmniReduceState(w), omnireduce_hook)

The hook returns at once: the bucket goes to the worker's communication thread,
which owns the socket, so backward keeps computing while several buckets are in
flight. The sums are written back into ``bucket.buffer()`` in place.
"""

# No "from __future__ import annotations": DDP compares the hook's annotations
# with the real dist.GradBucket and Future[Tensor] objects.
import itertools
import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future as ConcurrentFuture
from typing import Any

import torch
import torch.distributed as dist

from omnireduce import config
from omnireduce.errors import CollectiveError, ConfigError, OmniReduceError
from worker.api import Allreducer
from worker.auto import MODES, PathChooser
from worker.embedding_rows import Part, RowTracker, divide_rows
from worker.futures import Settable
from worker.knownrows import known_rows
from worker.rows import SparseRows

logger = logging.getLogger(__name__)

__all__ = ["OmniReduceState", "omnireduce_hook", "complete_torch_future", "cast_wrapper", "send_joined"]


class OmniReduceState:
    """State of :func:`omnireduce_hook`.

    Args:
        worker: the connected worker of this rank.
        average: divide by the world size, as DDP's default allreduce does, so that
            switching the hook on changes no numbers beyond float rounding.

    Attributes:
        samples: this rank's sample count in the current step, for replicas with
            unequal batches: set it before ``backward()`` and the gradients are
            weighted by each rank's share of the step's samples (the aggregator
            computes ``sum(samples_i * grad_i) / sum(samples_i)``), which is the
            gradient of the mean loss over the global batch. None (the default)
            averages over ranks (with ``average``) or sums.
        dense_group: a torch process group (e.g. gloo) for the dense path; with
            ``mode="auto"`` each bucket goes through the sparse protocol or a dense
            allreduce on this group, whichever the cost model predicts faster for the
            bucket's density (see :mod:`worker.auto`); with ``mode="dense"`` always
            the group.
        mode: "sparse" (default), "dense" or "auto". In auto mode a bucket that holds a table
            tracked by :func:`worker.embedding_rows.track_embedding_rows` always takes the
            sparse protocol, without a vote.
        paths: how many buckets took each path ({"sparse": n, "dense": m}).
        votes: how many times the ranks voted on a bucket's path in auto mode (once
            per probe cycle of a bucket, ``probe_every`` ops, not per step).
        error: the first error a bucket hit (None while all is well); once set,
            every later bucket fails at once with the same cause, so a loop can
            check ``state.error`` after catching the error from ``backward()``. Such a
            bucket's ops are refused (numbered and failed on every rank, see
            :meth:`worker.client.Worker.refuse`), as is a bucket whose tensor this
            rank's worker refuses: a rank that has not heard of the failure yet fails
            at once rather than at its timeout, and the ranks' ops stay in step.
        buckets: buckets reduced so far.
        coalesce_sparse: send the sparse gradients that DDP hands over one after
            another (it gives each its own bucket: one per embedding table) as one op
            per row shape and dtype, the tables' rows numbered one after the other,
            instead of one op each: a model of 26 tables pays one op's fixed cost, not
            26. A sparse gradient is held only while another sparse one follows it: the
            previous backward pass's buckets say which does (DDP's buckets keep their
            order once rebuilt after the first step; in the first pass a run is held
            until the next dense bucket or the pass's last). So a table whose gradient
            is ready early (a sampled softmax's output embedding) goes out at once,
            while backward computes the layers below it, instead of waiting for the
            next dense bucket. Every rank sees the same buckets in the same order, so
            the ranks' ops match.
    """

    __slots__ = ("worker", "average", "samples", "dense_group", "mode", "paths", "error", "buckets", "_chooser",
                 "_lock", "coalesce_sparse", "_held", "votes", "_agreed", "_kinds", "_last_kinds", "rows",
                 "_dense_step", "_weight_agreed", "_weight")

    def __init__(
        self,
        worker: Allreducer,
        average: bool = True,
        samples: float | None = None,
        dense_group: dist.ProcessGroup | None = None,
        mode: str = "sparse",
        probe_every: int = 16,
        coalesce_sparse: bool = True,
    ) -> None:
        if not callable(getattr(worker, "allreduce_async", None)):
            raise ConfigError(f"OmniReduceState needs a connected worker (worker.connect(...)), got {worker!r}")
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode != "sparse" and dense_group is None:
            raise ConfigError(f"mode {mode!r} needs a dense_group (a torch process group, e.g. gloo)")
        if mode == "auto" and getattr(worker, "mode", "sparse") == "auto":
            # Two choosers: the worker's own picks each op's path from this host's cost file
            # alone, so ranks could record different densities, and the hook's votes (a
            # collective of the dense group) would no longer pair up across ranks.
            raise ConfigError("the hook's auto mode needs a worker in sparse mode, not auto (give the worker "
                              "mode='sparse', or set OMNIREDUCE_MODE=sparse): the hook's choice is agreed by every "
                              "rank, the worker's is not")
        self.worker = worker
        self.average = average
        self.samples = samples
        self.dense_group = dense_group
        self.mode = mode
        self.paths = {"sparse": 0, "dense": 0}
        self.votes = 0
        # Per bucket key: (the probe cycle it rests on, the path the ranks agreed on).
        self._agreed: dict[Any, tuple[int, str]] = {}
        # The model is asked for in-place ops: the hook sums a CPU bucket in place (no result to zero).
        self._chooser = (
            PathChooser(worker.world_size, ring_available=True, probe_every=probe_every,
                        block_size=worker.block_size, message_blocks=worker.message_blocks, streams=worker.streams,
                        inplace=True)
            if mode == "auto" else None
        )
        self.error: BaseException | None = None
        self.buckets = 0
        self._lock = threading.Lock()
        self.coalesce_sparse = coalesce_sparse
        # Sparse gradients held to go out in one op with the sparse ones after them: (index, gradient, future).
        self._held: list[tuple[int, torch.Tensor, ConcurrentFuture]] = []
        # Bucket index -> whether it is sparse: this backward pass's so far, and the previous pass's.
        self._kinds: dict[int, bool] = {}
        self._last_kinds: dict[int, bool] | None = None
        #: The dense embedding tables whose buckets go out as their looked-up rows
        #: (:func:`worker.embedding_rows.track_embedding_rows` sets it).
        self.rows: RowTracker | None = None
        # Where this backward pass's buckets through the dense group were (see _step_agreement); None: none.
        self._dense_step: torch.device | None = None
        # This pass's factor on its dense-group buckets, once agreed (see _pass_weight).
        self._weight_agreed = False
        self._weight: float | None = None

    def record(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error


def complete_torch_future(
    source: ConcurrentFuture, target: torch.Tensor, what: str, state: OmniReduceState | None = None
) -> torch.futures.Future:
    """A torch future completed with ``target`` once ``source`` (an allreduce) is done.

    The sum is copied into ``target`` in place; a sparse ``target``'s sum (which has
    rows of its own) is the future's value instead. A failure completes the torch
    future with a :class:`omnireduce.errors.CollectiveError` whose message names
    what failed and its cause (DDP re-raises it from ``backward()``).

    Args:
        source: the worker's future of the summed tensor.
        target: the tensor the sum is written into, and the future's value.
        what: names the collective in error messages, e.g. "DDP bucket 3".
        state: records the error, if given.
    """
    result = Settable()

    def done(src: ConcurrentFuture) -> None:
        try:
            out = src.result()
            if target.is_sparse:
                # A sparse sum has its own rows: it replaces the bucket's tensor.
                if out.shape != target.shape:
                    raise OmniReduceError(f"result has shape {tuple(out.shape)}, expected {tuple(target.shape)}")
                value = out
            else:
                if out.numel() != target.numel():
                    # DDP does not check the result's size; a wrong one would corrupt silently.
                    raise OmniReduceError(f"result has {out.numel()} elements, expected {target.numel()}")
                if out is not target:
                    target.copy_(out.view(target.shape))
                value = target
        except BaseException as e:  # noqa: BLE001 - handed to the waiting backward()
            if state is not None:
                state.record(e)
            logger.error("omnireduce %s failed: %s", what, e)
            error = CollectiveError(f"omnireduce {what} failed: {type(e).__name__}: {e}")
            error.__cause__ = e
            result.fail(error)
            return
        result.set(value)

    source.add_done_callback(done)
    return result.future


def omnireduce_hook(state: OmniReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: sums the bucket over all ranks through the aggregator.

    Args:
        state: the hook state, holding the worker.
        bucket: the gradient bucket; its buffer receives the result in place.

    Returns:
        A future completed with ``bucket.buffer()`` once the sum is in it.
    """
    sparse = bucket.buffer().is_sparse
    index = bucket.index()
    if index in state._kinds:
        # This pass had a bucket of this index already: a new pass began that no last bucket
        # ended. DDP's static_graph does so in its first iteration (every bucket index 0,
        # none is_last). What the last pass told is unknown: nothing is held, nothing agreed.
        if state._held:
            _send_held(state)
        state._kinds, state._last_kinds, state._dense_step = {}, None, None
    if state._last_kinds is None:
        # Where a pass may end unannounced (the first, and after one that did: DDP's
        # static_graph), the samples are agreed per bucket, not kept for a pass whose end
        # would go unseen; every rank runs the same agreements at the same buckets.
        state._weight_agreed = False
    if state._held and not sparse:
        # A dense bucket ends the run of sparse ones: they go out now, before it.
        _send_held(state)
    state._kinds[index] = sparse
    last = bucket.is_last()
    dense_step = None
    try:
        future = _hook(state, bucket)
    finally:
        if state._held and (last or not _sparse_follows(state, index)):
            _send_held(state)
        if last:
            state._last_kinds, state._kinds = state._kinds, {}
            dense_step, state._dense_step = state._dense_step, None
            state._weight_agreed = False
    if dense_step is not None:
        future = _step_agreement(state, future, dense_step)
    return future


def _step_agreement(state: OmniReduceState, last: torch.futures.Future,
                    device: torch.device) -> torch.futures.Future:
    """The last bucket's future, failed on every rank if any rank's ``state.error`` was set.

    A bucket of the dense group that a failed rank joins (:func:`_skip_dense`) fails only
    there: the other ranks' sums succeed, and without this they would train on, never
    told, while that rank raises at every step. So a pass that used the dense group ends
    with a one-int MIN allreduce on it of "no error here", which every rank runs (the
    buckets' paths are agreed, so every rank sees a dense one alike); a sparse-protocol
    bucket needs none, as a failed rank refuses it on every rank. The flag lives where the
    pass's dense buckets did (``device``), as the group's backend (NCCL) may need.
    """
    ok = torch.tensor([int(state.error is None)], dtype=torch.int32, device=device)
    flag = dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=state.dense_group, async_op=True).get_future()

    def check(both: torch.futures.Future) -> torch.Tensor:
        bucket, agreed = both.value()
        value = bucket.value()  # this bucket's own error first
        agreed.value()
        if not ok.item() and state.error is None:
            error = CollectiveError("omnireduce: another rank failed this step's DDP buckets after an earlier "
                                    "failure there (that rank's state.error says why); the sums are not used")
            state.record(error)
            raise error
        return value

    return torch.futures.collect_all([last, flag]).then(check)


def _sparse_follows(state: OmniReduceState, index: int) -> bool:
    """Whether a sparse bucket follows bucket ``index``, as far as the previous pass says (first
    pass: no). A gradient held waits for a next bucket, and the first pass may end without
    announcing its last (DDP's static_graph): what it holds would never go out."""
    if state._last_kinds is None:
        return False
    return state._last_kinds.get(index + 1, False)


def _hook(state: OmniReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    if buf.is_sparse:
        return _sparse_bucket(state, bucket.index(), buf)
    what = f"allreduce of DDP bucket {bucket.index()} ({buf.numel()} x {buf.dtype})"
    key = (bucket.index(), buf.numel(), buf.dtype)
    # A bucket that holds a tracked table takes the sparse protocol on every rank, without
    # a vote: a rank whose table was dropped (its rows are no longer given) must not enter
    # the dense group's collective while the others run the rows op.
    tracked = state.rows is not None and state.rows.ever_held(bucket)
    chooser = None if tracked else state._chooser
    parts = state.rows.bucket_parts(bucket) if state.rows is not None else None
    if state.error is not None:
        path = "sparse" if parts is not None or tracked else state.mode
        if chooser is not None:
            # The other ranks may wait in the agreement: vote sparse, so that they go on to
            # omnireduce (where this rank refuses the op) instead of blocking in gloo; a verdict
            # that stands (or a choice every rank makes alike) is followed as it is.
            path, basis = chooser.plan(key, buf.numel(), buf.element_size())
            path = _agree(state, key, "sparse" if basis is not None else path, basis)
        if path == "dense":
            state._dense_step = buf.device
            return _skip_dense(state, what, buf)
        ops = [buf] if parts is None else [part.view for part in parts]
        return _skip(state, what, ops, key=key if parts is None else None)
    if parts is not None:
        return _parts_bucket(state, buf, what, parts)
    path = "sparse" if tracked else state.mode
    if chooser is not None:
        path, basis = chooser.plan(key, buf.numel(), buf.element_size())
        path = _agree(state, key, path, basis)
    state.paths[path] += 1
    if path == "dense":
        state._dense_step = buf.device
        state.buckets += 1
        _pass_weight(state)
        if state.error is not None:  # the ranks' samples do not agree: failed on every rank alike
            return _skip_dense(state, what, buf)
        return _dense_allreduce(state, buf)
    weight = state.samples
    if weight is None and state.average and state.worker.world_size > 1:
        # Divide before summing, as DDP's default hook does: it keeps a half-precision
        # sum of many ranks from overflowing.
        buf.div_(state.worker.world_size)
    try:
        # A CPU bucket takes its sum in place: no result to allocate and copy back.
        # The key names the bucket from step to step: a sharded worker sizes the op from its last union.
        source = state.worker.allreduce_async(buf, inplace=not buf.is_cuda and buf.is_contiguous(), weight=weight,
                                              key=key)
    except Exception as e:
        return _refused(state, what, e)
    state.buckets += 1
    if chooser is not None:

        def measured(src: ConcurrentFuture) -> None:
            stats = getattr(src, "op_stats", None)
            # Only a sparse op measures the density: a worker in its own dense mode
            # returns every block.
            if stats is not None and stats.path == "sparse":
                chooser.record(key, stats.union_density)

        # Added before the callback that completes the bucket, so the density is
        # recorded before DDP can start the next step (and choose again).
        source.add_done_callback(measured)
    return complete_torch_future(source, buf, what, state)


def _parts_bucket(state: OmniReduceState, buf: torch.Tensor, what: str,
                  parts: list[Part]) -> torch.futures.Future[torch.Tensor]:
    """A bucket holding tracked embedding tables (:mod:`worker.embedding_rows`): each run of
    tables is a rows op (only its looked-up rows are read, divided and sent), the rest of the
    bucket one dense op; the bucket is complete once every op is."""
    world = state.worker.world_size
    weight = state.samples
    divide = weight is None and state.average and world > 1
    sources = []
    sending = False
    try:
        for part in parts:
            if part.rows is None:
                if divide:
                    part.view.div_(world)
                sending = True
                sources.append(state.worker.allreduce_async(part.view, inplace=True, weight=weight))
                sending = False
                continue
            if divide:
                divide_rows(part.view, part.rows, world)
            # Recording the rows written: the tracker checks them at the next step.
            part.known = known_rows(part.view, part.rows, inplace=True, world_size=world, record=True)
            sending = True
            sources.append(state.worker.allreduce_async(part.known, weight=weight))
            sending = False
    except Exception as e:
        # The worker refused the part it was given; the parts after it (or from the one that
        # failed before reaching it) are refused here, so that every rank's ops stay in step.
        return _refused(state, what, e, [part.view for part in parts[len(sources) + sending:]])
    state.buckets += 1
    state.paths["sparse"] += 1
    combined: ConcurrentFuture = ConcurrentFuture()
    lock = threading.Lock()
    left = [len(sources)]

    def done(part: Part, src: ConcurrentFuture) -> None:
        error = src.exception()
        if error is None:
            try:
                if part.pieces:
                    part.copy_back()
                if part.known is not None and state.rows is not None:
                    state.rows.sums_written(part, part.known.union())
            except BaseException as e:  # noqa: BLE001 - handed to the waiting backward()
                logger.exception("could not finish a summed part of a DDP bucket")
                error = e
        with lock:
            if combined.done():
                return  # failed already: the first error wins
            if error is not None:
                combined.set_exception(error)
                return
            left[0] -= 1
            if left[0] == 0:
                combined.set_result(buf)

    for part, src in zip(parts, sources, strict=True):
        src.add_done_callback(lambda f, part=part: done(part, f))
    return complete_torch_future(combined, buf, what, state)


def _agree(state: OmniReduceState, key: Any, path: str, basis: int | None) -> str:
    """The path every rank takes: dense only if every rank chose it.

    The dense path is a collective, so every rank must take the same one, and ranks
    with different cost files could choose differently. They vote (a one-int MIN
    allreduce on the dense group) once per probe cycle of a bucket, at the op after
    its probe: the basis is the cycle's number, counted from the bucket's calls alike
    on every rank (see :meth:`worker.auto.PathChooser.plan`), so every rank votes at
    the same buckets, also after an op that failed on some ranks only, and within a
    cycle the verdict stands. A synchronous collective in every bucket of every step
    would stall backward on every rank.
    """
    if basis is None:
        return path
    agreed = state._agreed.get(key)
    if agreed is not None and agreed[0] == basis:
        return agreed[1]
    flag = torch.tensor([int(path == "dense")], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=state.dense_group)
    state.votes += 1
    path = "dense" if flag.item() else "sparse"
    state._agreed[key] = (basis, path)
    return path


def _skipped(state: OmniReduceState, what: str, ops: list[torch.Tensor], key: Any = None) -> CollectiveError:
    """Refuses the ops of a bucket not sent after an earlier failure, and returns the error.

    Each op is numbered and failed on every rank (:meth:`worker.client.Worker.refuse`):
    a rank that has not heard of the failure yet when it sends that bucket fails at once
    instead of at its timeout, and every rank's op numbers stay in step.

    Args:
        state: the hook state (its ``error`` is the earlier failure).
        what: names the bucket.
        ops: what each of the bucket's ops would have summed (or a tensor of its size).
        key: the ops' key, as they would have been sent (a sharded worker sizes ops by it).
    """
    error = CollectiveError(f"omnireduce {what} skipped after an earlier failure: {state.error}")
    for x in ops:
        state.worker.refuse(error, x, weight=state.samples, key=key)
    return error


def _skip(state: OmniReduceState, what: str, ops: list[torch.Tensor], key: Any = None) -> torch.futures.Future:
    return Settable.failed(_skipped(state, what, ops, key))


def _skip_dense(state: OmniReduceState, what: str, buf: torch.Tensor) -> torch.futures.Future:
    """A bucket after an earlier failure whose path is the dense group: this rank still
    joins the group's allreduce, which the other ranks run (gloo stays in step, and no
    omnireduce op is numbered), and the bucket fails once it is done."""
    error = CollectiveError(f"omnireduce {what} skipped after an earlier failure: {state.error}")
    result = Settable()
    _dense_allreduce(state, buf).add_done_callback(lambda _f: result.fail(error))
    return result.future


def _refused(state: OmniReduceState, what: str, e: Exception,
             rest: list[torch.Tensor] | None = None) -> torch.futures.Future:
    """The bucket's future when this rank refused one of its ops (the worker numbered it and
    failed it on every rank): failed, not raised, so that DDP hands over the buckets after it,
    which are refused too (``state.error``); ``rest``: the bucket's own ops still to refuse."""
    state.record(e)
    logger.error("omnireduce %s refused here: %s: %s", what, type(e).__name__, e)
    if rest:
        _skipped(state, what, rest)
    error = CollectiveError(f"omnireduce {what} failed: {type(e).__name__}: {e}")
    error.__cause__ = e
    return Settable.failed(error)


def _sparse_bucket(state: OmniReduceState, index: int, grad: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A sparse gradient (DDP gives each its own bucket): its rows are the blocks, whatever the mode.

    The sum is a new sparse tensor (the union of every rank's rows), which DDP
    takes as the parameter's gradient.
    """
    what = f"allreduce of DDP bucket {index} (sparse {tuple(grad.shape)} {grad.dtype}, {grad._nnz()} rows)"
    held = state.coalesce_sparse and grad.sparse_dim() == 1 and grad.dim() == 2
    weight = state.samples
    if weight is None and state.average and state.worker.world_size > 1 and state.error is None:
        try:
            # A new tensor: the gradient DDP gave is not changed.
            grad = grad / state.worker.world_size
        except Exception as e:  # e.g. MemoryError: the op is still numbered (refused) below
            logger.exception("omnireduce %s: dividing the gradient failed", what)
            state.record(e)
    # After a failure (an earlier bucket's, or the division's) the op is refused, not sent.
    if state.error is not None and not held:
        return _skip(state, what, [grad], key=("sparse", index))
    state.buckets += 1
    state.paths["sparse"] += 1
    if held:
        # Held even after a failure: the ops of the held run are the same on every rank (see _send_held).
        future: ConcurrentFuture = ConcurrentFuture()
        state._held.append((index, grad, future))
        return complete_torch_future(future, grad, what, state)
    try:
        source = state.worker.allreduce_async(grad, weight=weight, key=("sparse", index))
    except Exception as e:
        return _refused(state, what, e)
    return complete_torch_future(source, grad, what, state)


def _send_held(state: OmniReduceState) -> None:
    """Sends the held sparse gradients: one op per (dtype, row shape), the tables' rows one after the other.

    Every rank holds the same gradients in the same order (DDP's buckets), so the
    ranks' ops match; each gradient's future gets its own rows of the sum.
    """
    held, state._held = state._held, []
    groups: dict[tuple[torch.dtype, tuple[int, ...]], list[tuple[int, torch.Tensor, ConcurrentFuture]]] = {}
    for item in held:
        groups.setdefault((item[1].dtype, tuple(item[1].shape[1:])), []).append(item)
    for items in groups.values():
        if state.error is not None:
            error = _skipped(state, f"sparse DDP buckets {[index for index, _, _ in items]}",
                             [joined_size([(grad, future) for _, grad, future in items])])
            for _, _, future in items:
                future.set_exception(error)
            continue
        try:
            send_joined(state.worker, [(grad, future) for _, grad, future in items], state.samples)
        except BaseException as e:  # noqa: BLE001 - every held bucket's backward() gets it
            state.record(e)
            for _, _, future in items:
                if not future.done():
                    future.set_exception(e)


def send_joined(worker: Allreducer, items: list[tuple[torch.Tensor, ConcurrentFuture]],
                weight: float | None) -> None:
    """Sums sparse 2-D gradients of one dtype and row width as one rows op: the tables' rows
    one after the other. Each item's future gets its own table's rows of the sum (a sparse
    COO tensor), or the op's error.

    Args:
        worker: the worker to send through.
        items: (gradient, future) pairs, in the order every rank gives them.
        weight: this rank's samples (a weighted op), or None.
    """
    try:
        parts = [SparseRows.from_torch(grad) for grad, _ in items]
        offsets = [0, *itertools.accumulate(grad.shape[0] for grad, _ in items)]
        joined = SparseRows.join(parts, offsets[:-1], offsets[-1], None)
    except Exception as e:
        worker.refuse(e, joined_size(items), weight=weight)
        raise
    source = worker.allreduce_async(joined, weight=weight)

    def split(src: ConcurrentFuture) -> None:
        error = src.exception()
        for k, (_, future) in enumerate(items):
            if error is not None:
                future.set_exception(error)
                continue
            try:
                rows = src.result().slice_rows(offsets[k], offsets[k + 1])
                future.set_result(rows.to_torch(1))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                logger.exception("could not split the summed sparse gradients")
                future.set_exception(e)

    source.add_done_callback(split)


def joined_size(items: list[tuple[torch.Tensor, Any]]) -> torch.Tensor:
    """A tensor of the size of the op that joins the sparse gradients of ``items`` (a meta
    tensor: it holds nothing), for refusing that op (:meth:`worker.client.Worker.refuse`)."""
    size = sum(grad.shape[0] * math.prod(grad.shape[1:]) * grad.element_size() for grad, _ in items)
    return torch.empty(size, dtype=torch.uint8, device="meta")


def _pass_weight(state: OmniReduceState) -> float | None:
    """This rank's factor on the pass's dense-group buckets, ``samples / sum(samples)``, or None
    (no rank set samples); agreed once per backward pass, at its first such bucket.

    Every rank runs the agreement (a three-float sum on the dense group), whatever its own
    ``samples`` (per bucket where a pass's end may go unseen: see :func:`omnireduce_hook`):
    samples set on some ranks only, or not a positive finite number on one, fail
    the pass on every rank alike (``state.error``) instead of a gloo mismatch that aborts the
    process, or a silently wrong gradient.
    """
    if state._weight_agreed:
        return state._weight
    mine = state.samples
    try:
        if mine is not None:
            config.check_number("samples", mine)
        bad = False
    except ConfigError:
        bad = True
    flags = torch.tensor([0.0 if mine is None or bad else float(mine), float(mine is not None), float(bad)],
                         dtype=torch.float64)
    dist.all_reduce(flags, group=state.dense_group)
    total, given, refused = flags.tolist()
    world = dist.get_world_size(state.dense_group)
    state._weight_agreed, state._weight = True, None
    if refused or 0 < given < world:
        why = (f"{int(refused)} rank(s) set samples that are not a positive finite number" if refused
               else f"samples set on {int(given)} of the {world} ranks only")
        state.record(ConfigError(f"omnireduce DDP hook: {why} (this rank's: {mine!r}); the dense group's "
                                 "buckets are not summed"))
    elif given:
        state._weight = float(mine) / total
    return state._weight


def _dense_allreduce(state: OmniReduceState, buf: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """The bucket through the dense group: DDP's own allreduce, weighted when samples are set."""
    group = state.dense_group
    world = dist.get_world_size(group)
    weight = _pass_weight(state)
    if weight is not None:
        # sum(n_i * g_i) / sum(n_i)
        buf.mul_(weight)
    elif state.average and world > 1:
        buf.div_(world)

    def value(f: torch.futures.Future) -> torch.Tensor:
        try:
            return f.value()[0]
        except Exception as e:
            # As for the omnireduce buckets: the first error is kept, and the later buckets are refused.
            state.record(e)
            raise

    return dist.all_reduce(buf, group=group, async_op=True).get_future().then(value)


Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def cast_wrapper(dtype: torch.dtype, hook: Hook) -> Hook:
    """Runs ``hook`` on the bucket cast to ``dtype`` (e.g. bfloat16) and casts the result back.

    torch's own ``bf16_compress_wrapper`` refuses to run without NCCL; this one
    works on the CPU, with any hook.

    Args:
        dtype: the type the bucket travels in.
        hook: the communication hook to wrap, e.g. :func:`omnireduce_hook`.
    """

    def cast_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        full = bucket.buffer()
        bucket.set_buffer(full.to(dtype))

        def back(fut: torch.futures.Future) -> torch.Tensor:
            full.copy_(fut.value())
            return full

        return hook(state, bucket).then(back)

    cast_hook.__name__ = cast_hook.__qualname__ = f"cast_{str(dtype).replace('torch.', '')}_{hook.__name__}"
    return cast_hook
