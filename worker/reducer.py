"""Gradient reduction for plain training loops (no DDP), Horovod style.

Per-parameter post-accumulate-grad hooks flatten gradients into buckets; a
bucket whose gradients are all ready is sent at once, in bucket order, so the
reduction of late layers overlaps the backward pass of early ones. Call
:meth:`GradientReducer.synchronize` before ``optimizer.step()``::

    reducer = GradientReducer(model, worker.connect())
    loss.backward()
    reducer.synchronize()
    optimizer.step()

The weight of an ``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True`` gets a sparse
COO gradient: it goes as an op of its own, its looked-up rows as the blocks (no dense
copy of the table), and its gradient becomes the sparse sum of every rank's rows, as DDP
and gloo give it. With ``embedding_rows=True`` a ``sparse=False`` table goes as an op of
its own too, as ``allreduce(grad, rows=ids, inplace=True)`` of the ids it looked up
(:mod:`worker.embedding_rows`: the promise, and its check): its dense gradient is neither
copied into a bucket nor scanned for nonzero blocks.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Iterator
from concurrent.futures import Future

import torch
from torch import nn

from omnireduce import config
from omnireduce.errors import OmniReduceError
from worker.api import Allreducer
from worker.ddp import joined_size, send_joined
from worker.embedding_rows import DEFAULT_VERIFY_EVERY, Part, RowTracker, divide_rows, tracker_of
from worker.knownrows import KnownRows, dense_sum_of, known_rows

logger = logging.getLogger(__name__)

__all__ = ["GradientReducer"]


class _Kind(enum.Enum):
    DENSE = "dense"  # parameters flattened into one buffer
    SPARSE = "sparse"  # one parameter with a sparse COO gradient (a sparse embedding's weight)
    ROWS = "rows"  # one tracked dense embedding table, sent as its looked-up rows


class _Bucket:
    __slots__ = ("params", "index", "kind", "module", "ready", "future", "buffer", "known", "used")

    def __init__(self, params: list[torch.nn.Parameter], index: int, kind: _Kind = _Kind.DENSE,
                 module: nn.Module | None = None) -> None:
        self.params = params
        self.index = index
        self.kind = kind
        # A sparse bucket's embedding: whether it is sparse now decides what an unused table sends.
        self.module = module
        self.ready = 0
        self.future: Future | None = None
        self.buffer: torch.Tensor | None = None
        # A rows bucket's op, once submitted (the rows it wrote are recorded).
        self.known: KnownRows | None = None
        # Per parameter, whether it had a gradient here when the bucket went (see synchronize).
        self.used: list[bool] = []


def _sparse_weights(model: nn.Module) -> dict[int, nn.Module]:
    """The parameters (by id) whose gradients are sparse, and their modules: the weights of sparse
    embeddings, as DDP finds them."""
    return {id(m.weight): m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}


class GradientReducer:
    """Sums (or averages) the gradients of a model over all ranks through the aggregator.

    Every rank must build its reducer over the same model structure, so buckets
    line up across ranks.

    Args:
        model: the model whose parameters' gradients are reduced.
        worker: the connected worker of this rank.
        average: divide by the world size (the mean gradient, as DDP computes).
            Overridden by :attr:`samples` when that is set.
        bucket_cap_mb: bucket size in MiB (DDP's default is 25).
        embedding_rows: send each dense embedding table's gradient as the rows it looked
            up (see the module's docstring); the tables tracked are in :attr:`rows`.
        verify_every: with ``embedding_rows``, check each table against its ids at its
            first use and every this many uses after (0: never).

    Raises:
        ConfigError: ``bucket_cap_mb`` is not a finite positive number, or (with
            ``embedding_rows``) ``verify_every`` not a non-negative integer.

    After a failed :meth:`synchronize` the gradients are not to be used: buckets of one
    parameter and tracked tables are divided and summed in ``.grad`` itself (as DDP's
    hook sums in its buckets).
    """

    def __init__(
        self, model: torch.nn.Module, worker: Allreducer, average: bool = True, bucket_cap_mb: float = 25.0,
        embedding_rows: bool = False, verify_every: int = DEFAULT_VERIFY_EVERY,
    ) -> None:
        config.check_number("bucket_cap_mb", bucket_cap_mb)
        #: The dense embedding tables sent as their rows (``embedding_rows=True``), else None.
        self.rows: RowTracker | None = tracker_of(model, verify_every) if embedding_rows else None
        self.worker = worker
        self.average = average
        #: This rank's sample count in the current step (set before ``backward()``), for
        #: replicas given unequal batches: every bucket is then the samples-weighted mean
        #: ``sum(samples_i * grad_i) / sum(samples_i)`` (the aggregator weights it), not the
        #: plain mean. None: the plain mean (or sum, without ``average``).
        self.samples: float | None = None
        self.error: BaseException | None = None
        self._enabled = True
        params = [p for p in model.parameters() if p.requires_grad]
        sparse = _sparse_weights(model)
        # Reverse order, as DDP does: gradients of the last layers are ready first.
        cap = int(bucket_cap_mb * 2**20)
        self._buckets: list[_Bucket] = []
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(params):
            kind = _Kind.SPARSE if id(p) in sparse else (
                _Kind.ROWS if self.rows is not None and self.rows.tracks(p) else None)
            if kind is not None:
                # A bucket of its own, as DDP gives a sparse one: its rows, not a flat copy, are sent.
                if current:
                    self._buckets.append(_Bucket(current, len(self._buckets)))
                    current, size = [], 0
                self._buckets.append(_Bucket([p], len(self._buckets), kind, sparse.get(id(p))))
                continue
            nbytes = p.numel() * p.element_size()
            if current and (size + nbytes > cap or p.dtype != current[0].dtype):
                self._buckets.append(_Bucket(current, len(self._buckets)))
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self._buckets.append(_Bucket(current, len(self._buckets)))
        self._bucket_of: dict[int, int] = {}
        for i, b in enumerate(self._buckets):
            for p in b.params:
                self._bucket_of[id(p)] = i
        self._next = 0
        # Sparse gradients wait here for the last sparse bucket, then go as one op per (dtype,
        # row width), as the DDP hook's do: a model of 26 tables pays one op's fixed cost, not 26.
        self._held: list[tuple[_Bucket, torch.Tensor]] = []
        # Whether each step sends how many ranks used each parameter (_launch_used), and its op.
        self._flagged = any(b.kind is not _Kind.SPARSE for b in self._buckets)
        self._used: Future | None = None
        self._last_sparse = max((b.index for b in self._buckets if b.kind is _Kind.SPARSE), default=-1)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulates gradients locally; the next backward outside reduces the total."""
        self._enabled = False
        try:
            yield
        finally:
            self._enabled = True

    def remove(self) -> None:
        """Removes the gradient hooks (and the embedding tables' forward hooks)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.rows is not None:
            self.rows.remove()

    def _on_grad(self, p: torch.Tensor) -> None:
        # After a failure too: the buckets are then refused (see _op), in the same order.
        if not self._enabled:
            return
        b = self._buckets[self._bucket_of[id(p)]]
        if b.index < self._next or b.ready == len(b.params):
            # A gradient for a bucket this step already has whole: a backward pass began
            # without synchronize() after the last one (which raised, and the batch was
            # skipped). Its buckets' ops went out on this rank and the rest did not, so this
            # rank's ops no longer pair with the others': every later op is refused (the
            # others' fail at once, naming this rank) rather than summed with another step's.
            if self.error is None:
                self.error = OmniReduceError(
                    "a parameter's gradient came again before synchronize(): a backward pass began before the "
                    f"last one was synchronized (it raised after {self._next} of {len(self._buckets)} buckets "
                    "went out), or one backward computed it twice (a layer run in two reentrant checkpoint "
                    "segments: use checkpoint(..., use_reentrant=False)); this rank's ops no longer pair with "
                    "the other ranks'")
                logger.error("GradientReducer: %s", self.error)
            self._reset_step()
        b.ready += 1
        # Launch in bucket order only, so every rank numbers its ops the same way.
        buckets = self._buckets
        while self._next < len(buckets) and buckets[self._next].ready == len(buckets[self._next].params):
            try:
                self._launch(self._buckets[self._next])
            except BaseException as e:
                # Raised before the bucket's op was numbered (backward raises it): the ranks'
                # ops are out of step from here on, so every later one is refused.
                if self.error is None:
                    self.error = e
                raise
            self._next += 1
        if self._next == len(buckets):
            self._launch_used()  # during backward's tail already, not at synchronize()

    def _launch(self, b: _Bucket) -> None:
        b.used = [p.grad is not None for p in b.params]
        weight = self.samples
        world = self.worker.world_size
        divide = weight is None and self.average and world > 1
        if b.kind is _Kind.SPARSE:
            self._launch_sparse(b, divide, world)
            return
        if b.kind is _Kind.ROWS:
            flat, inplace = self._rows_op(b, divide, world)
        else:
            own = _own_gradient(b)
            # A bucket of one parameter (a table larger than the cap) is summed where its gradient
            # is: no copy into a bucket and back.
            flat = own if own is not None else torch.cat([_flat(p) for p in b.params])
            if divide:
                flat.div_(world)
            inplace = own is not None
        b.buffer = flat
        if b.known is not None:
            b.future = self._op(b.known, weight=weight)
        else:
            b.future = self._op(flat, weight=weight, key=("bucket", b.index), inplace=inplace)

    def _op(self, x: object, **options: object) -> Future:
        """A bucket's op, sent; or, once an op failed (``self.error``), refused: numbered and
        failed on every rank (:meth:`worker.client.Worker.refuse`), so that a rank that has not
        heard of the failure yet fails at once instead of at its timeout, and the ranks' ops
        stay in step. A refusal by the worker (it numbered the op) fails the bucket, not the
        gradient hook: the buckets after it are refused in turn."""
        if self.error is None:
            try:
                return self.worker.allreduce_async(x, **options)
            except Exception as e:
                logger.error("GradientReducer: an op refused here: %s: %s", type(e).__name__, e)
                self.error = e
                return _failed(e)
        error = OmniReduceError(f"skipped after an earlier failure: {self.error}")
        self.worker.refuse(error, x, **options)
        return _failed(error)

    def _launch_sparse(self, b: _Bucket, divide: bool, world: int) -> None:
        p = b.params[0]
        grad = p.grad
        if grad is None:
            # Unused here: no rows, in the form the ranks that used the table send.
            grad = _no_rows(p) if b.module is None or b.module.sparse else torch.zeros_like(p)
        if grad.is_sparse:
            # A new tensor (the rows of a coalesced copy), as DDP leaves the local gradient alone.
            b.buffer = grad / world if divide else grad
            if grad.dim() == 2 and grad.sparse_dim() == 1:
                b.future = Future()
                self._held.append((b, b.buffer))
        else:
            # A dense gradient (the table's sparse flag turned off after the reducer was built): sent dense.
            b.buffer = grad.reshape(-1) / world if divide else grad.reshape(-1).clone()
        if b.future is None:
            b.future = self._op(b.buffer, weight=self.samples, key=("sparse", b.index))
        if b.index == self._last_sparse:
            self._send_held()

    def _send_held(self) -> None:
        """Sends the held sparse gradients: one op per (dtype, row width), in bucket order."""
        held, self._held = self._held, []
        groups: dict[tuple[torch.dtype, int], list[tuple[torch.Tensor, Future]]] = {}
        for b, grad in held:
            assert b.future is not None
            groups.setdefault((grad.dtype, grad.shape[1]), []).append((grad, b.future))
        for items in groups.values():
            if self.error is None:
                try:
                    send_joined(self.worker, items, self.samples)
                    continue
                except Exception as e:  # refused (numbered) by send_joined or the worker
                    logger.error("GradientReducer: a sparse op refused here: %s: %s", type(e).__name__, e)
                    self.error = error = e
            else:
                error = OmniReduceError(f"skipped after an earlier failure: {self.error}")
                self.worker.refuse(error, joined_size(items), weight=self.samples)
            for _, future in items:
                future.set_exception(error)

    def _rows_op(self, b: _Bucket, divide: bool, world: int) -> tuple[torch.Tensor, bool]:
        """Sets up a tracked table's op: its rows (``b.known``), or, once the table is dropped (or
        its gradient is not a dense CPU tensor), its whole gradient. Returns the gradient (flat
        where it goes whole) and whether a whole gradient is summed in place."""
        assert self.rows is not None
        p = b.params[0]
        grad = p.grad
        usable = _in_place(grad)
        # Consumed whichever way the table goes: its ids are this step's.
        ids = self.rows.table_rows(p, grad.view(grad.shape[0], -1) if usable else None,
                                   f"GradientReducer bucket {b.index}")
        if ids is None or (grad is not None and not usable):
            # The mask pass over the whole gradient, as for any bucket (zeros where it has none).
            flat = grad.view(-1) if usable else _flat(p)
            if divide:
                flat.div_(world)
            return flat, usable
        if grad is None:
            # Unused here: no rows from this rank, and a dense sum to give the gradient if others sent some.
            b.known = dense_sum_of(_no_rows(p), world_size=world)
            b.known.written = []
            return p.detach(), False
        if divide:
            divide_rows(grad, ids, world)
        b.known = known_rows(grad, ids, inplace=True, world_size=world, record=True)
        return grad, False

    def synchronize(self) -> None:
        """Waits for every bucket's sum and writes it into the parameters' ``.grad``.

        Buckets whose parameters got no gradient this step (unused parameters) are
        sent now, with zeros, so every rank performs the same ops.

        Raises:
            OmniReduceError: a bucket's allreduce failed (also kept in ``self.error``).
        """
        try:
            while self._next < len(self._buckets):
                self._launch(self._buckets[self._next])
                self._next += 1
            self._launch_used()
            if self.error is not None:
                # Every bucket of the step was refused (from the failure on): none is waited for.
                raise OmniReduceError(f"gradient reduction failed earlier: {self.error}") from self.error
            futures = [b.future for b in self._buckets]
            assert all(f is not None for f in futures)
            outs = [f.result() for f in futures]  # type: ignore[union-attr]
            counts = (self._used.result().tolist() if self._used is not None
                      else [u for b in self._buckets for u in b.used])
            k = 0
            for b, out in zip(self._buckets, outs, strict=True):
                assert b.buffer is not None
                used, k = counts[k : k + len(b.params)], k + len(b.params)
                if b.kind is _Kind.SPARSE:
                    _set_sparse(b.params[0], out)
                    continue
                if b.kind is _Kind.ROWS:
                    self._set_rows(b, out, used[0] > 0)
                    continue
                offset = 0
                for p, ranks in zip(b.params, used, strict=True):
                    n = p.numel()
                    value = out[offset : offset + n].view(p.shape)
                    if p.grad is None:
                        # Unused here: the sum where another rank used it (zeros too), else left
                        # None, as DDP does.
                        if ranks:
                            p.grad = value.clone()
                    elif p.grad.is_sparse:
                        p.grad = value.clone()  # it went dense (see _flat)
                    elif value.data_ptr() != p.grad.data_ptr():
                        p.grad.copy_(value)
                    offset += n
        except BaseException as e:
            # Any failure (a bucket that could not be set up too): later ops are refused.
            if self.error is None:
                self.error = e
            raise
        finally:
            self._reset_step()

    def _launch_used(self) -> None:
        """Sends, once every bucket went, how many ranks gave each parameter a gradient: one
        that some ranks left unused gets the sum on every rank even where it is exactly zero
        (DDP gives them all the zeros), or an optimizer with momentum or weight decay would move
        it on some ranks only. An op of 4 bytes a parameter, refused like the buckets after a
        failure. (A sparse gradient's rows say so themselves: a model of sparse tables only
        sends none.)"""
        if self._flagged and self._used is None:
            flags = [u for b in self._buckets for u in b.used]
            self._used = self._op(torch.tensor(flags, dtype=torch.int32), key=("used",))

    def _reset_step(self) -> None:
        self._used = None
        for b in self._buckets:
            b.ready, b.future, b.buffer, b.known, b.used = 0, None, None, None, []
        self._next = 0
        self._held = []

    def _set_rows(self, b: _Bucket, out: torch.Tensor, used: bool) -> None:
        """Gives a tracked table its summed gradient (summed in place, unless it had none);
        ``used``: whether any rank had a gradient for it."""
        p = b.params[0]
        if b.known is not None:
            assert self.rows is not None  # a rows bucket exists only with a tracker
            union = b.known.union()
            # The rows written: if the gradient is not zeroed before the next step, they go again.
            self.rows.sums_written(Part(out, None, 0, out.numel(), tables=[(id(p), 0, p.shape[0])]), union)
            if p.grad is None and len(union):
                p.grad = out
        elif p.grad is None:
            # Sent whole, as zeros: the others' sum, if any rank used the table.
            if used:
                p.grad = out.view(p.shape)
        elif p.grad.is_sparse:
            p.grad = out.view(p.shape)
        elif out.data_ptr() != p.grad.data_ptr():
            # Sent whole as a copy (a gradient that could not be summed in place).
            p.grad.copy_(out.view(p.grad.shape))


def _in_place(g: torch.Tensor | None) -> bool:
    """Whether a gradient can be summed where it is: a dense, contiguous CPU tensor."""
    return g is not None and not g.is_sparse and g.device.type == "cpu" and g.is_contiguous()


def _own_gradient(b: _Bucket) -> torch.Tensor | None:
    """The flat view of a one-parameter bucket's gradient, if it can be summed in place."""
    g = b.params[0].grad if len(b.params) == 1 else None
    return g.view(-1) if g is not None and _in_place(g) else None


def _failed(error: BaseException) -> Future:
    failed: Future = Future()
    failed.set_exception(error)
    return failed


def _flat(p: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient flattened for a dense bucket (zeros if it has none)."""
    g = p.grad
    if g is None:
        return torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
    if g.is_sparse:
        # Sparse outside a sparse embedding (a custom function): every rank sends it dense alike.
        return g.to_dense().reshape(-1)
    return g.reshape(-1)


def _no_rows(p: torch.Tensor) -> torch.Tensor:
    """A sparse gradient of no rows: this rank did not use the table, the others may have."""
    return torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.int64),
                                   torch.empty((0, *p.shape[1:]), dtype=p.dtype), tuple(p.shape),
                                   is_coalesced=True, check_invariants=True)


def _set_sparse(p: torch.Tensor, out: torch.Tensor) -> None:
    """Gives a sparse bucket's parameter its summed gradient."""
    if not out.is_sparse:
        # Sent dense (see _launch): the parameter keeps a dense gradient.
        out = out.view(p.shape)
        if p.grad is None or p.grad.is_sparse:
            p.grad = out
        else:
            p.grad.copy_(out)
        return
    if p.grad is None and out._nnz() == 0:
        return  # unused on every rank: left None, as DDP does
    p.grad = out
