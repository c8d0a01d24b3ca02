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
and gloo give it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from concurrent.futures import Future

import torch
from torch import nn

from omnireduce import config
from omnireduce.errors import OmniReduceError
from worker.api import Allreducer

logger = logging.getLogger(__name__)

__all__ = ["GradientReducer"]


class _Bucket:
    __slots__ = ("params", "index", "sparse", "ready", "future", "buffer")

    def __init__(self, params: list[torch.nn.Parameter], index: int, sparse: bool = False) -> None:
        self.params = params
        self.index = index
        # One parameter whose gradient is a sparse COO tensor (a sparse embedding's weight).
        self.sparse = sparse
        self.ready = 0
        self.future: Future | None = None
        self.buffer: torch.Tensor | None = None


def _sparse_weights(model: nn.Module) -> set[int]:
    """The parameters (by id) whose gradients are sparse: the weights of sparse embeddings, as DDP finds them."""
    return {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}


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

    Raises:
        ConfigError: ``bucket_cap_mb`` is not a finite positive number.
    """

    def __init__(
        self, model: torch.nn.Module, worker: Allreducer, average: bool = True, bucket_cap_mb: float = 25.0
    ) -> None:
        config.check_number("bucket_cap_mb", bucket_cap_mb)
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
            if id(p) in sparse:
                # A bucket of its own, as DDP gives it: its rows, not a flat copy, are sent.
                if current:
                    self._buckets.append(_Bucket(current, len(self._buckets)))
                    current, size = [], 0
                self._buckets.append(_Bucket([p], len(self._buckets), sparse=True))
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
        """Removes the gradient hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._enabled or self.error is not None:
            return
        b = self._buckets[self._bucket_of[id(p)]]
        b.ready += 1
        # Launch in bucket order only, so every rank numbers its ops the same way.
        buckets = self._buckets
        while self._next < len(buckets) and buckets[self._next].ready == len(buckets[self._next].params):
            self._launch(self._buckets[self._next])
            self._next += 1

    def _launch(self, b: _Bucket) -> None:
        weight = self.samples
        divide = weight is None and self.average and self.worker.world_size > 1
        if b.sparse:
            p = b.params[0]
            grad = p.grad if p.grad is not None else _no_rows(p)
            if grad.is_sparse:
                # A new tensor (the rows of a coalesced copy), as DDP leaves the local gradient alone.
                flat = grad / self.worker.world_size if divide else grad
            else:
                # A dense gradient from a table made sparse only later: sent dense (every rank alike).
                flat = grad.reshape(-1) / self.worker.world_size if divide else grad.reshape(-1).clone()
            key: tuple = ("sparse", b.index)
        else:
            flat = torch.cat([_flat(p) for p in b.params])
            if divide:
                flat.div_(self.worker.world_size)
            key = ("bucket", b.index)
        b.buffer = flat
        try:
            b.future = self.worker.allreduce_async(flat, weight=weight, key=key)
        except BaseException as e:
            self.error = e
            raise

    def synchronize(self) -> None:
        """Waits for every bucket's sum and writes it into the parameters' ``.grad``.

        Buckets whose parameters got no gradient this step (unused parameters) are
        sent now, with zeros, so every rank performs the same ops.

        Raises:
            OmniReduceError: a bucket's allreduce failed (also kept in ``self.error``).
        """
        if self.error is not None:
            raise OmniReduceError(f"gradient reduction failed earlier: {self.error}") from self.error
        try:
            while self._next < len(self._buckets):
                self._launch(self._buckets[self._next])
                self._next += 1
            for b in self._buckets:
                assert b.future is not None and b.buffer is not None
                out = b.future.result()
                if b.sparse:
                    _set_sparse(b.params[0], out)
                    continue
                offset = 0
                for p in b.params:
                    n = p.numel()
                    value = out[offset : offset + n].view(p.shape)
                    if p.grad is None:
                        # Unused on every rank: leave it None, as DDP does.
                        if bool(value.any()):
                            p.grad = value.clone()
                    elif p.grad.is_sparse:
                        p.grad = value.clone()  # it went dense (see _flat)
                    else:
                        p.grad.copy_(value)
                    offset += n
        except OmniReduceError as e:
            self.error = e
            raise
        finally:
            for b in self._buckets:
                b.ready, b.future, b.buffer = 0, None, None
            self._next = 0


def _flat(p: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient flattened for a dense bucket (zeros if it has none)."""
    g = p.grad
    if g is None:
        return torch.zeros(p.numel(), dtype=p.dtype)
    if g.is_sparse:
        # Sparse outside a sparse embedding (a custom function): every rank sends it dense alike.
        return g.to_dense().reshape(-1)
    return g.reshape(-1)


def _no_rows(p: torch.Tensor) -> torch.Tensor:
    """A sparse gradient of no rows: this rank did not use the table, the others may have."""
    return torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.int64),
                                   torch.empty((0, *p.shape[1:]), dtype=p.dtype), tuple(p.shape))


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
