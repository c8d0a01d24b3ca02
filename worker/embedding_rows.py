"""Dense embedding gradients sent as the rows each step looked up (the DDP hook's ``rows=`` path).

An ``nn.Embedding(sparse=False)`` gives a dense gradient (what Adam and most optimizers
want) that is zero outside the rows the step looked up. :func:`track_embedding_rows`
records those ids with a forward hook on every such table of a model; the DDP hook
then sends each run of adjacent tracked tables (of one width) in a bucket as
``allreduce(view, rows=...)`` of their gradients: only the looked-up rows are read and
sent, with no mask pass over the tables (:mod:`worker.knownrows`). The bucket's other
parameters go out as one dense op beside them (the mask pass over those alone).

The promise it rests on: a tracked table's gradient is zero outside the ids looked up
through it since its last op, and outside the rows that op summed (gradients accumulated
over synced steps without zeroing: those rows are checked, and sent again where nonzero).
A weight used elsewhere too (tied to an output projection, or read with
``F.embedding``/``F.linear`` directly) breaks it. Tables whose weight another module
holds are not tracked; each set of tables a bucket holds is checked against its ids at
its first use and every ``verify_every``-th after (a pass over their gradients), and a
table that fails is no longer tracked on that rank (logged): it takes the mask pass from
then on. Ranks that disagree on this fail that op on every rank (``MismatchError``, or
the op timeout on a sharded worker), so the result is never silently wrong; the hook's
error then stays set (``state.error``), as after any failed bucket. CPU buckets only: a
GPU bucket takes the hook's usual path.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from omnireduce.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["Part", "RowTracker", "divide_rows", "track_embedding_rows", "tracker_of"]

#: A bucket of tracked tables is checked against its ids at its first use and every this many after.
DEFAULT_VERIFY_EVERY = 100


class RowTracker:
    """The ids each tracked embedding table looked up since its gradients were last sent.

    Args:
        verify_every: check a bucket's tables against their ids (a pass over their
            gradients) at the bucket's first use and every this many uses after; 0 never.
    """

    def __init__(self, verify_every: int = DEFAULT_VERIFY_EVERY) -> None:
        if isinstance(verify_every, bool) or not isinstance(verify_every, int) or verify_every < 0:
            raise ConfigError(f"verify_every must be a non-negative integer, got {verify_every!r}")
        self.verify_every = verify_every
        self._lock = threading.Lock()
        # Parameter (by id) -> the ids looked up through it since its bucket last went out.
        self._ids: dict[int, list[torch.Tensor]] = {}
        self._names: dict[int, str] = {}
        self._uses: dict[tuple[int, ...], int] = {}
        # Parameter (by id) -> the rows its last op wrote (see sums_written).
        self._written: dict[int, np.ndarray] = {}
        self._handles: list[Any] = []
        # Every table ever tracked (by id), dropped ones too: what all ranks agree on.
        self._ever: set[int] = set()
        #: Buckets sent as rows, and the tables dropped after a failed check.
        self.buckets = 0
        self.dropped: list[str] = []

    @property
    def tables(self) -> list[str]:
        """The names of the tables tracked."""
        return list(self._names.values())

    def track(self, name: str, module: nn.Module) -> None:
        """Records the ids ``module`` (an embedding) looks up whenever gradients are on."""
        weight = module.weight
        key = id(weight)
        self._ids[key] = []
        self._names[key] = name
        self._ever.add(key)

        def looked_up(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], _output: Any) -> None:
            if torch.is_grad_enabled() and key in self._ids:
                ids = args[0] if args else kwargs["input"]
                with self._lock:
                    # A copy: the caller may refill or remap its id tensor in place before the
                    # sum (a reused input buffer under gradient accumulation).
                    self._ids[key].append(ids.detach().reshape(-1).clone())

        self._handles.append(module.register_forward_hook(looked_up, with_kwargs=True))

    def remove(self) -> None:
        """Stops tracking: the forward hooks are removed and the ids forgotten."""
        for h in self._handles:
            h.remove()
        with self._lock:
            self._handles, self._ids, self._written = [], {}, {}
            self._names.clear()

    def sums_written(self, part: Part, union: np.ndarray) -> None:
        """Notes the rows a part's op wrote (its union): the next plan of the same tables sends again
        those that are still nonzero then (gradients accumulated over steps without zeroing)."""
        with self._lock:
            for key, first, count in part.tables:
                lo, hi = np.searchsorted(union, [first, first + count])
                self._written[key] = union[lo:hi] - first

    def bucket_parts(self, bucket: dist.GradBucket) -> list[Part] | None:
        """How a bucket holding tracked tables goes out, or None if it holds none (or is not a
        contiguous CPU buffer). Consumes the tables' ids.

        Returns:
            The bucket's ops, in buffer order (every rank plans the same ones): each run of
            adjacent tracked tables of one width as a rows op on their gradients' view, and
            the rest of the bucket as one dense op.
        """
        params = bucket.parameters()
        if not any(id(p) in self._ids for p in params):
            return None
        with self._lock:
            # Consumed here, whichever way the bucket goes (a GPU bucket's too).
            looked_up = {id(p): self._ids[id(p)] for p in params if id(p) in self._ids}
            for k in looked_up:
                self._ids[k] = []
            written = {k: self._written.pop(k) for k in looked_up if k in self._written}
        buf = bucket.buffer()
        if buf.is_sparse or buf.device.type != "cpu" or not buf.is_contiguous() or buf.dim() != 1:
            return None
        base, size = buf.data_ptr(), buf.element_size()
        segments = sorted((((g.data_ptr() - base) // size, g.numel(), p) for p, g in zip(
            params, bucket.gradients(), strict=True)), key=lambda seg: seg[0])
        # Counted per set of tables: DDP rebuilds its buckets after the first step.
        group = tuple(looked_up)
        uses = self._uses.get(group, 0)
        self._uses[group] = uses + 1
        check = self.verify_every > 0 and uses % self.verify_every == 0
        parts: list[Part] = []
        dense: list[torch.Tensor] = []
        for offset, numel, p in segments:
            grad = buf[offset : offset + numel]
            if id(p) not in looked_up or p.dim() != 2 or p.shape[1] == 0:
                dense.append(grad)
                continue
            width = p.shape[1]
            view = grad.view(-1, width)
            ids = _rows_to_send(view, looked_up[id(p)], written.get(id(p)))
            if check and not self._verify(view, ids, p, f"DDP bucket {bucket.index()}"):
                dense.append(grad)
                continue
            last = parts[-1] if parts else None
            if (last is not None and last.rows is not None and last.view.shape[1] == width
                    and last.end == offset):
                # Adjacent to the run before, of the same width: one op for both.
                first = last.view.shape[0]
                last.view = buf[last.start : offset + numel].view(-1, width)
                last.rows = np.concatenate([last.rows, ids + first])
                last.end = offset + numel
                last.tables.append((id(p), first, view.shape[0]))
            else:
                parts.append(Part(view, ids, offset, offset + numel, tables=[(id(p), 0, view.shape[0])]))
        if not parts:
            return None  # every table dropped: the whole bucket takes the mask pass
        if dense:
            parts.append(Part.dense_of(dense, buf))
        self.buckets += 1
        return parts

    def ever_held(self, bucket: dist.GradBucket) -> bool:
        """Whether ``bucket`` holds a table that was tracked, dropped since or not: the same on every rank."""
        return any(id(p) in self._ever for p in bucket.parameters())

    def tracks(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is the weight of a table tracked (and not dropped)."""
        return id(p) in self._ids

    def table_rows(self, p: torch.Tensor, view: torch.Tensor | None, where: str) -> np.ndarray | None:
        """The rows of one tracked table's gradient ``view`` to send now, ascending (its ids are
        consumed), checked at the table's first use and every ``verify_every``-th after; None
        if the table is not tracked, or no longer (its check failed: it goes dense from now on).

        Args:
            p: the table's weight.
            view: its gradient, ``(rows, width)``; None if it has none (no rows, then).
            where: what the gradient is sent as, for the log.
        """
        key = id(p)
        with self._lock:
            if key not in self._ids:
                return None
            seen, self._ids[key] = self._ids[key], []
            written = self._written.pop(key, None)
            uses = self._uses.get((key,), 0)
            self._uses[(key,)] = uses + 1
        if view is None:
            return np.empty(0, dtype=np.int64)
        ids = _rows_to_send(view, seen, written)
        if self.verify_every > 0 and uses % self.verify_every == 0 and not self._verify(view, ids, p, where):
            return None
        return ids

    def _verify(self, view: torch.Tensor, ids: np.ndarray, p: torch.Tensor, where: str) -> bool:
        """Whether every nonzero row of table ``p``'s gradient is among its ``ids``; if not, it is dropped."""
        nonzero = view.ne(0).any(1).nonzero().squeeze(1).numpy()
        outside = np.setdiff1d(nonzero, ids, assume_unique=True)
        if not len(outside):
            return True
        with self._lock:
            name = self._names.pop(id(p))
            del self._ids[id(p)]
            self.dropped.append(name)
        logger.warning(
            "%s: %d nonzero gradient rows of embedding %s outside the ids looked up through it (its "
            "weight used elsewhere too, e.g. tied?); it is sent with a mask pass from now on",
            where, len(outside), name,
        )
        return False


def divide_rows(view: torch.Tensor, rows: np.ndarray, world: int) -> None:
    """Divides only ``rows`` of a table's gradient ``view`` by ``world``, in place: the others are
    zero (what the tracking rests on), so the mean needs no pass over them."""
    idx = torch.from_numpy(rows)
    view.index_copy_(0, idx, view.index_select(0, idx).div_(world))


def _rows_to_send(view: torch.Tensor, seen: list[torch.Tensor], before: np.ndarray | None) -> np.ndarray:
    """A table's rows that may be nonzero, ascending: the ids looked up through it (``seen``),
    and the rows its last op summed (``before``) that are nonzero again: gradients accumulated
    over synced steps without zeroing, whose other ranks' copies would else be left out."""
    ids = np.unique(torch.cat(seen).cpu().numpy()).astype(np.int64, copy=False) if seen else (
        np.empty(0, dtype=np.int64))
    if before is not None and len(before):
        still = view.index_select(0, torch.from_numpy(before)).ne(0).any(1).numpy()
        if still.any():
            ids = np.union1d(ids, before[still])
    return ids


class Part:
    """One op of a bucket planned by :meth:`RowTracker.bucket_parts`.

    Args:
        view: a rows op's ``(n, width)`` view of the bucket (its tables' gradients), or a
            dense op's tensor (a view of the bucket, or a copy of its scattered pieces).
        rows: a rows op's rows that may be nonzero; None for the dense op.
        start: where the view starts in the bucket (elements).
        end: where it ends.
        pieces: a dense op's pieces of the bucket, when ``view`` is their copy (the sum
            is copied back into them); else empty.
        tables: a rows op's tables: (parameter id, first row in ``view``, rows).
    """

    __slots__ = ("view", "rows", "start", "end", "pieces", "tables", "known")

    def __init__(self, view: torch.Tensor, rows: np.ndarray | None, start: int, end: int,
                 pieces: list[torch.Tensor] | None = None, tables: list[tuple[int, int, int]] | None = None) -> None:
        self.view = view
        self.rows = rows
        self.start = start
        self.end = end
        self.pieces = pieces or []
        self.tables = tables or []
        #: A rows op's rows and their destination, once submitted (its union is recorded).
        self.known: Any = None

    @classmethod
    def dense_of(cls, pieces: list[torch.Tensor], buf: torch.Tensor) -> Part:
        """The dense op of a bucket's other parameters: a view where they are adjacent, else a copy."""
        base, size = buf.data_ptr(), buf.element_size()
        start = (pieces[0].data_ptr() - base) // size
        end = (pieces[-1].data_ptr() - base) // size + pieces[-1].numel()
        if sum(t.numel() for t in pieces) == end - start:
            return cls(buf[start:end], None, start, end)
        return cls(torch.cat(pieces), None, start, end, pieces)

    def copy_back(self) -> None:
        """Writes a copied dense op's sum back into the bucket."""
        at = 0
        for t in self.pieces:
            t.copy_(self.view[at : at + t.numel()])
            at += t.numel()


def track_embedding_rows(state: Any, model: nn.Module, verify_every: int = DEFAULT_VERIFY_EVERY) -> list[str]:
    """Sends ``model``'s dense embedding tables' gradients as the rows each step looked up.

    Tracks every ``nn.Embedding`` and ``nn.EmbeddingBag`` with ``sparse=False`` whose
    weight no other module holds; see the module's docstring for the promise and its check.
    Call it once, before training; the hook must be in its sparse mode (the default) or
    its auto mode (a bucket holding a tracked table then always takes the sparse protocol,
    on every rank, without a vote: see :func:`worker.ddp.omnireduce_hook`).

    Args:
        state: the :class:`worker.ddp.OmniReduceState` of the model's DDP hook.
        model: the model (or the DDP module wrapping it).
        verify_every: check each bucket's tables against their ids at its first use
            and every this many uses after (0: never).

    Returns:
        The names of the tables tracked.

    Raises:
        ConfigError: the hook is in its dense mode (every bucket through the dense group).
    """
    if state.mode == "dense":
        raise ConfigError("embedding rows are tracked in the hook's sparse and auto modes, not its dense mode "
                          "(every bucket goes through the dense group there)")
    if state.rows is not None:
        state.rows.remove()  # tracked again: the old hooks go
    state.rows = tracker_of(model, verify_every)
    return state.rows.tables


def tracker_of(model: nn.Module, verify_every: int = DEFAULT_VERIFY_EVERY) -> RowTracker:
    """A :class:`RowTracker` of every ``nn.Embedding``/``nn.EmbeddingBag`` of ``model`` with
    ``sparse=False`` and a trainable weight that no other module holds.

    Args:
        model: the model.
        verify_every: see :class:`RowTracker`.
    """
    tracker = RowTracker(verify_every)
    # A weight another module also holds (a tied output projection) gets gradients there too.
    holders: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    for name, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and not module.sparse:
            if not module.weight.requires_grad:
                continue  # frozen: no gradient to send
            if holders.get(id(module.weight), 0) > 1:
                logger.info("embedding %s shares its weight with another module: not tracked", name or "(root)")
                continue
            tracker.track(name or "(root)", module)
    return tracker
