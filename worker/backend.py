"""A ``torch.distributed`` backend named "omnireduce" whose collectives run through the aggregator.

Installing the package registers it through torch's ``torch.backends`` entry
point (:mod:`worker.autoload`), so an unchanged script (or torchrun's
``--dist-backend omnireduce``) can say::

    dist.init_process_group("omnireduce")   # rank, world from torchrun; aggregator from OMNIREDUCE_ADDRESS
    dist.all_reduce(t)                       # sparse sum through the aggregator
    DistributedDataParallel(model)           # works on it with no gloo at all

``all_reduce`` SUM and AVG of float and integer tensors, dense or sparse COO,
go through the sparse protocol (a sparse tensor's rows are its blocks, see
:mod:`worker.rows`). MIN, MAX, PRODUCT and the bitwise ops gather every rank's
tensor and reduce locally; ``reduce`` is an all_reduce that only the root keeps, and
``reduce_scatter`` one of the inputs laid end to end, of which each rank keeps its piece.
``broadcast``, ``all_gather``, ``gather``, ``scatter`` and ``barrier`` are built
on the same sum: a tensor's bytes travel zero on every rank but the owner, so the
sum reproduces them bit for bit, for any dtype (as the widest integer type their
length allows, :mod:`worker.tensorbytes`); ``all_to_all`` gathers
every rank's chunks that way. ``send`` and ``recv`` relay a message through the
aggregator (:mod:`worker.p2p`), ``recv`` from any source too (its sender found through
the group's store).

Every failure of a collective (a mismatch between ranks, a timeout, a lost
peer, a refusal) fails its ``Work``: ``wait()``, the future's ``wait()`` and
``value()``, and so ``dist.all_reduce`` and DDP's backward raise
:class:`CollectiveError` on every rank, and the tensor is left as it was.
Arguments that a rank refuses (a dtype, a reduction or an output that does not
fit) raise :class:`CollectiveError` in its call, as gloo's do, and fail the
collective on the other ranks at once, naming that rank and why
(:meth:`worker.client.Worker.refuse`), instead of at their timeout; every rank's
later collectives then pair up as before.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future as ConcurrentFuture
from datetime import timedelta
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from omnireduce import blocks, config
from omnireduce.errors import CollectiveError, ConfigError, OmniReduceError
from worker.api import Allreducer, connect
from worker.autoload import BACKEND_NAME, register
from worker.loop import fail_future, forward
from worker.p2p import PeerLinks
from worker.tensorbytes import (
    agreement_of,
    as_bytes,
    byte_view,
    bytes_of,
    from_bytes,
    rooted_size,
    sized,
    sized_bytes,
    wide,
    with_root,
)
from worker.work import OmniReduceWork

logger = logging.getLogger(__name__)

__all__ = ["BACKEND_NAME", "CollectiveError", "OmniReduceProcessGroup", "OmniReduceWork", "create_process_group",
           "register"]

_JOB_KEY = "omnireduce/job"
# How many times a rank made a group over its store (one count per rank: the key and the rank).
_MAKINGS_KEY = "omnireduce/makings"
_FLOAT = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# Summed exactly (in int64 by the aggregator), wrapping around as the type's own sum does.
_INT = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)
# Reductions that are not sums: every rank's tensor is gathered and reduced here.
_GATHERED: dict[Any, Callable[[torch.Tensor], torch.Tensor]] = {
    dist.ReduceOp.MIN: lambda s: s.amin(0),
    dist.ReduceOp.MAX: lambda s: s.amax(0),
    dist.ReduceOp.PRODUCT: lambda s: s.prod(0, dtype=s.dtype),
    dist.ReduceOp.BAND: lambda s: _fold(s, torch.bitwise_and),
    dist.ReduceOp.BOR: lambda s: _fold(s, torch.bitwise_or),
    dist.ReduceOp.BXOR: lambda s: _fold(s, torch.bitwise_xor),
}


_BITWISE = (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR)


def _fold(stacked: torch.Tensor, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    out = stacked[0].clone()
    for row in stacked[1:]:
        out = fn(out, row)
    return out


def _failed(error: BaseException) -> ConcurrentFuture:
    failed: ConcurrentFuture = ConcurrentFuture()
    failed.set_exception(error)
    return failed


def _splits(sizes: list[int], rows: int, world: int, what: str, side: str) -> list[int]:
    """An all_to_all_single's rows per rank on one side: as given, or ``rows`` split evenly."""
    if not sizes:
        if rows % world:
            raise CollectiveError(f"{what}: the {side}'s {rows} rows do not split evenly over {world} ranks")
        return [rows // world] * world
    sizes = [int(n) for n in sizes]
    if len(sizes) != world or min(sizes) < 0 or sum(sizes) != rows:
        raise CollectiveError(f"{what}: {side} split sizes {sizes} must be {world} counts summing to {rows} rows")
    return sizes


def _check_reducible(t: torch.Tensor, op: Any, what: str, name: str) -> None:
    """Refuses a reduction the backend does not do (``name``: the collective asked)."""
    if op in _GATHERED:
        if t.is_sparse:
            raise CollectiveError(f"{what}: only SUM and AVG take sparse tensors")
        if op in _BITWISE and (t.is_floating_point() or t.is_complex()):
            # Refused in the call (as gloo does), not after every rank's bytes went round.
            raise CollectiveError(f"the omnireduce backend's {name} cannot use {op} with {t.dtype} ({what}): "
                                  f"bitwise reductions take integer and bool tensors")
        return
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        raise CollectiveError(f"the omnireduce backend's {name} does not support {op}")
    if t.dtype not in _FLOAT and t.dtype not in _INT:
        raise CollectiveError(f"the omnireduce backend's {name} does not support {t.dtype} ({what})")
    if op == dist.ReduceOp.AVG and t.dtype not in _FLOAT:
        raise CollectiveError(f"the omnireduce backend's {name} AVG needs a float tensor, not {t.dtype}")


def _same_count(outputs: list[Any], inputs: list[Any], what: str) -> None:
    if len(outputs) != len(inputs):
        raise CollectiveError(f"{what}: {len(outputs)} outputs for {len(inputs)} inputs")


def _dense(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t``, refused if it is not a dense CPU tensor (a collective that lays tensors end to end)."""
    if t.is_sparse or t.device.type != "cpu":
        raise CollectiveError(f"{what}: the omnireduce backend takes dense CPU tensors here, not a {t.layout} "
                              f"tensor on {t.device}")
    return t


def _strided(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t``, refused if it is sparse (a collective that moves a tensor's bytes)."""
    if t.is_sparse:
        raise CollectiveError(f"{what}: the omnireduce backend moves the bytes of dense tensors here, not of a "
                              f"{t.layout} tensor")
    return t


def _chunk_refusal(chunk_link: Any, error: BaseException, what: str,
                   then: Callable[[], None]) -> Callable[[], Callable[[], None]]:
    """What numbers an all_to_all's chunk op in its turn (see ``_a2a_release``) by refusing it
    on every rank; ``then`` completes the all_to_all once the lock is let go."""
    def refuse() -> Callable[[], None]:
        try:
            chunk_link.refuse(error)
        except OmniReduceError as e:
            logger.debug("omnireduce %s: the chunks' op could not be refused: %s", what, e)
        return then

    return refuse


def _gathered_value(outputs: list[list[torch.Tensor]]) -> Any:
    """A gathering Work's value as gloo's: the one input's list of outputs, or the lists of several."""
    return outputs[0] if len(outputs) == 1 else outputs


def _describe(tensors: list[torch.Tensor]) -> str:
    return ", ".join(f"{'sparse ' if t.is_sparse else ''}{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
                     for t in tensors)


def _op_type(opts: Any, default: Any = dist.ReduceOp.SUM) -> Any:
    op = getattr(opts, "reduceOp", default) if opts is not None else default
    # Options hold a ReduceOp wrapping a RedOpType; only the latter compares reliably.
    return getattr(op, "op", op)


class OmniReduceProcessGroup(dist.ProcessGroup):
    """A process group whose collectives are sums through the omnireduce aggregator.

    Args:
        rank: this process's rank.
        world_size: the number of processes.
        worker: the connected worker of this rank (owned and closed by the group).
        store: the group's store (torch's ``Store``): ``send`` counts its messages there,
            for ``recv`` from any source (:mod:`worker.p2p`); None: no such receives.

    Attributes:
        samples: this rank's sample count for the current step, or None. When set,
            ``all_reduce`` with AVG is the mean weighted by every rank's samples
            (``sum(samples_i * t_i) / sum(samples_i)``): replicas with unequal
            batches then average to the gradient of the global batch.
    """

    def __init__(self, rank: int, world_size: int, worker: Allreducer, store: Any = None) -> None:
        super().__init__(rank, world_size)
        self._rank = rank
        self._world = world_size
        self.worker = worker
        self._store = store
        self.samples: float | None = None
        # send/recv's pair workers, made on the first message (None again once shut down).
        self._p2p: PeerLinks | None = None
        self._shut = False
        self._p2p_lock = threading.Lock()
        # all_to_all calls so far, those whose chunks have gone, and the ones ready to go.
        self._a2a_lock = threading.Lock()
        self._a2a_calls = 0
        # Whether the kernels of all_to_all's chunk ops were compiled (see _exchange).
        self._a2a_warm = False
        self._a2a_sent = 0
        self._a2a_ready: dict[int, Callable[[], Callable[[], None]]] = {}
        # torch keeps a group's name in its backends; this group is its own backend.
        self._name = ""
        self._desc = ""

    def set_samples(self, samples: float | None) -> None:
        """Sets :attr:`samples` (None: plain averages again)."""
        self.samples = samples

    def set_timeout(self, timeout: timedelta) -> None:
        """Sets the op timeout of this group's collectives and messages, those in flight
        included (torch's ``ProcessGroup.set_timeout``). Called on the group, it wins over
        ``$OMNIREDUCE_TIMEOUT``, which only sets the timeout the group starts with.

        Args:
            timeout: how long an op may go without hearing from the aggregator.

        Raises:
            ConfigError: ``timeout`` is not a positive ``timedelta``.
        """
        if not isinstance(timeout, timedelta):
            raise ConfigError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
        seconds = timeout.total_seconds()
        self.worker.set_timeout(seconds)
        with self._p2p_lock:
            links = self._p2p
        if links is not None:
            links.set_timeout(seconds)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def size(self) -> int:
        return self._world

    def rank(self) -> int:
        return self._rank

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_desc(self) -> str:
        return self._desc

    def shutdown(self) -> None:
        self._close_links()
        self.worker.close()

    def abort(self) -> None:
        self._close_links()
        self.worker.close()

    def _close_links(self) -> None:
        with self._p2p_lock:
            self._shut = True
            links, self._p2p = self._p2p, None
        if links is not None:
            links.close()

    def __repr__(self) -> str:
        return f"OmniReduceProcessGroup(rank={self._rank}, world={self._world}, job={self.worker.job!r})"

    def _work(self, parts: list[tuple[ConcurrentFuture, Callable[[Any], None]]], value: Any, what: str) -> Any:
        return OmniReduceWork(parts, value, what)

    def _submit(self, x: Any, what: str, **options: Any) -> ConcurrentFuture:
        """The worker's future of ``x``'s sum; a refusal becomes a failed future, not an exception,
        so that the caller sees it where it sees every other failure (in the Work)."""
        try:
            return self.worker.allreduce_async(x, **options)
        except OmniReduceError as e:
            return _failed(e)

    def _submit_bytes(self, values: torch.Tensor, what: str) -> ConcurrentFuture:
        """:meth:`_submit` of bytes that one rank owns each (sent as :func:`worker.tensorbytes.wide` makes them);
        the future's result is bytes again."""
        return as_bytes(self._submit(wide(values), what))

    def _refuse(self, error: CollectiveError, ops: list[torch.Tensor], op: Any = None) -> NoReturn:
        """Raises ``error``, this rank's refusal of a collective's arguments, once the ops the
        collective would have sent are failed on every rank (the other ranks raise at once,
        naming this rank, and their later ops keep their numbers in step).

        Args:
            error: why.
            ops: one entry per op the collective sends when its arguments are good: what it
                would have summed, or a tensor of its size (:func:`worker.tensorbytes.sized`).
            op: the reduction, for a collective that reduces: an AVG is weighted by
                :attr:`samples` (a sharded worker sends weighted ops to every shard).
        """
        weight = self.samples if op == dist.ReduceOp.AVG else None
        for x in ops:
            self.worker.refuse(error, x, weight=weight)
        raise error

    def _check_root(self, out: torch.Tensor, root: int, nbytes: int, what: str) -> None:
        """Raises (on every rank alike: all see the same sum) unless every rank named ``root``
        as the collective's root and gave ``nbytes`` (:func:`worker.tensorbytes.with_root`);
        else two "roots'" bytes would have been summed into the result, or a tensor a few
        bytes short of the root's would have taken its first bytes."""
        one_root, one_size = agreement_of(out, self._world)
        if not one_root:
            raise CollectiveError(f"{what}: the ranks named different roots (this rank named {root}); "
                                  "nothing was written")
        if not one_size:
            raise CollectiveError(f"{what}: the ranks' tensors differ in size (this rank's: {nbytes} bytes); "
                                  "nothing was written")

    def _gathered(self, t: torch.Tensor) -> torch.Tensor:
        """The size of the op that gathers every rank's bytes of ``t`` (:meth:`_gather_values`)."""
        return sized_bytes(self._world * t.numel() * t.element_size())

    def _wire(self, t: torch.Tensor, op: Any) -> torch.Tensor:
        """What the op that reduces ``t`` with ``op`` sums (or its size)."""
        return self._gathered(t) if op in _GATHERED else t

    # all_reduce

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = _op_type(opts)
        what = f"all_reduce ({op.name if hasattr(op, 'name') else op}) of {_describe(tensors)}"
        try:
            for t in tensors:
                if t.device.type != "cpu":
                    raise CollectiveError(f"the omnireduce backend supports CPU tensors, not {t.device} ({what})")
                _check_reducible(t, op, what, "all_reduce")
        except CollectiveError as e:
            self._refuse(e, [self._wire(t, op) for t in tensors], op)
        return self._work([self._reduced(t, op, what, "all_reduce") for t in tensors], tensors, what)

    def _reduced(self, t: torch.Tensor, op: Any, what: str,
                 name: str) -> tuple[ConcurrentFuture, Callable[[Any], None]]:
        """The part of a collective that reduces ``t`` over the ranks with ``op``, in place.

        Raises:
            CollectiveError: ``op`` or ``t``'s dtype is not supported (``name``: the collective).
        """
        _check_reducible(t, op, what, name)
        if op in _GATHERED:
            return self._gathered_reduce(t, op, what)
        return self._sum(t, op == dist.ReduceOp.AVG, what)

    def _sum(self, t: torch.Tensor, average: bool, what: str) -> tuple[ConcurrentFuture, Callable[[Any], None]]:
        # A weighted AVG is divided by the total weight in the aggregator.
        weight = self.samples if average else None
        divide = average and weight is None
        if t.is_sparse:
            def finish_sparse(out: torch.Tensor) -> None:
                if divide:
                    out = torch.sparse_coo_tensor(out.indices(), out.values() / self._world, out.shape,
                                                  is_coalesced=True)
                t.copy_(out)

            return self._submit(t, what, weight=weight), finish_sparse

        def finish(out: torch.Tensor) -> None:
            out = out.view(t.shape)
            if divide:
                out = out / self._world
            t.copy_(out)

        return self._submit(t, what, weight=weight), finish

    def _gathered_reduce(self, t: torch.Tensor, op: Any, what: str) -> tuple[ConcurrentFuture, Callable[[Any], None]]:
        src, n = self._gather_values(t)
        reduce = _GATHERED[op]

        def finish(out: torch.Tensor) -> None:
            stacked = torch.stack([from_bytes(out[r * n : (r + 1) * n], t) for r in range(self._world)])
            t.copy_(reduce(stacked))

        return src, finish

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    # Collectives built on a sum of bytes.

    @staticmethod
    def _check_outputs(outs: list[torch.Tensor], t: torch.Tensor, what: str) -> None:
        """Refuses outputs of another dtype or size than the input (as gloo does): the
        gathered bytes would otherwise be read as another type, or fail in the Work."""
        for o in outs:
            if o.dtype != t.dtype or o.numel() != t.numel():
                raise CollectiveError(f"{what}: an output of {_describe([o])} does not match the input's "
                                      f"{_describe([t])}")

    def _gather_values(self, t: torch.Tensor) -> tuple[ConcurrentFuture, int]:
        """Starts the sum that gathers every rank's bytes of ``t``; returns it and the bytes per rank."""
        mine = bytes_of(t)
        n = mine.numel()
        values = torch.zeros(n * self._world, dtype=torch.uint8)
        values[self._rank * n : (self._rank + 1) * n] = mine
        return self._submit_bytes(values, "all_gather"), n

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0
        what = f"broadcast from rank {root} of {_describe(tensors)}"
        try:
            for t in tensors:
                _strided(t, what)
        except CollectiveError as e:
            self._refuse(e, [sized_bytes(rooted_size(t.numel() * t.element_size())) for t in tensors])
        parts = []
        for t in tensors:
            values = bytes_of(t)
            n = values.numel()
            values = with_root(values if self._rank == root else None, n, root)

            def finish(out: torch.Tensor, t: torch.Tensor = t, n: int = n) -> None:
                self._check_root(out, root, n, what)
                t.copy_(from_bytes(out[:n], t))

            parts.append((self._submit_bytes(values, what), finish))
        return self._work(parts, tensors, what)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> Any:
        what = f"all_gather of {_describe(input_tensors)}"
        try:
            _same_count(output_tensors, input_tensors, what)
            for outs, t in zip(output_tensors, input_tensors, strict=True):
                _strided(t, what)
                if len(outs) != self._world:
                    raise CollectiveError(f"all_gather needs {self._world} output tensors, got {len(outs)}")
                self._check_outputs(outs, t, what)
        except CollectiveError as e:
            self._refuse(e, [self._gathered(t) for t in input_tensors])
        parts = []
        for outs, t in zip(output_tensors, input_tensors, strict=True):
            src, n = self._gather_values(t)

            def finish(out: torch.Tensor, outs: list[torch.Tensor] = outs, n: int = n) -> None:
                for r, o in enumerate(outs):
                    o.copy_(from_bytes(out[r * n : (r + 1) * n], o))

            parts.append((src, finish))
        return self._work(parts, _gathered_value(output_tensors), what)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        what = f"all_gather_into_tensor of {_describe(inputs)}"
        try:
            _same_count(outputs, inputs, what)
            outs = []
            for o, i in zip(outputs, inputs, strict=True):
                if o.numel() != i.numel() * self._world:
                    raise CollectiveError(f"{what}: an output of {_describe([o])} does not hold {self._world} "
                                          f"inputs of {_describe([i])}")
                try:
                    outs.append(list(o.view(self._world, *i.shape).unbind(0)))
                except RuntimeError as e:  # strides that no view of world x the input's shape fits
                    raise CollectiveError(f"{what}: an output of {_describe([o])} with strides {o.stride()} cannot "
                                          f"be viewed as {self._world} inputs: {e}") from e
        except CollectiveError as e:
            self._refuse(e, [self._gathered(t) for t in inputs])
        return self.allgather(outs, inputs, opts)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    # torch 2.13's names (dist.all_gather_into_tensor, reduce_scatter_tensor and their
    # coalesced forms); the inherited ones look for a backend by device and find none.
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def barrier(self, opts: Any = None) -> Any:
        one = torch.ones(1, dtype=torch.float32)

        def finish(out: torch.Tensor) -> None:
            if out.item() != self._world:
                raise OmniReduceError(f"barrier counted {out.item()} ranks, expected {self._world}")

        # gloo's barrier Work holds no tensor: its future's value is [].
        return self._work([(self._submit(one, "barrier"), finish)], [], "barrier")

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> Any:
        # output_lists[r][i]: rank r's tensor i.
        if len(output_lists) != self._world or any(len(outs) != len(inputs) for outs in output_lists):
            self._refuse(CollectiveError(f"all_gather_coalesced needs {self._world} output lists of "
                                         f"{len(inputs)} tensors, got {[len(outs) for outs in output_lists]}"),
                         [self._gathered(t) for t in inputs])
        return self.allgather([[outs[i] for outs in output_lists] for i in range(len(inputs))], inputs, opts)

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0
        what = f"gather to rank {root} of {_describe(input_tensors)}"
        try:
            for t in input_tensors:
                _strided(t, what)
            if self._rank == root and (len(output_tensors) != len(input_tensors)
                                       or any(len(outs) != self._world for outs in output_tensors)):
                raise CollectiveError(f"{what}: the root needs {self._world} output tensors per input")
            if self._rank == root:
                for outs, t in zip(output_tensors, input_tensors, strict=True):
                    self._check_outputs(outs, t, what)
        except CollectiveError as e:
            self._refuse(e, [self._gathered(t) for t in input_tensors])
        parts = []
        for i, t in enumerate(input_tensors):
            src, n = self._gather_values(t)

            def finish(out: torch.Tensor, i: int = i, n: int = n) -> None:
                if self._rank == root:
                    for r, o in enumerate(output_tensors[i]):
                        o.copy_(from_bytes(out[r * n : (r + 1) * n], o))

            parts.append((src, finish))
        return self._work(parts, _gathered_value(output_tensors), what)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0
        what = f"scatter from rank {root} of {_describe(output_tensors)}"
        try:
            for t in output_tensors:
                _strided(t, what)
            if self._rank == root:
                if len(input_tensors) != len(output_tensors) or any(len(ins) != self._world for ins in input_tensors):
                    raise CollectiveError(f"{what}: the root needs {self._world} input tensors per output")
                for ins, t in zip(input_tensors, output_tensors, strict=True):
                    for x in ins:
                        _strided(x, what)
                        # Only the total length reaches the aggregator: inputs of other sizes (or
                        # dtypes) would put bytes in the wrong rank's output; gloo refuses them too.
                        if x.dtype != t.dtype or x.numel() != t.numel():
                            raise CollectiveError(f"{what}: an input of {_describe([x])} does not match the "
                                                  f"output's {_describe([t])}")
        except CollectiveError as e:
            self._refuse(e, [sized_bytes(rooted_size(self._world * t.numel() * t.element_size()))
                             for t in output_tensors])
        parts = []
        for i, t in enumerate(output_tensors):
            n = bytes_of(t).numel()
            mine = torch.cat([bytes_of(x) for x in input_tensors[i]]) if self._rank == root else None
            values = with_root(mine, n * self._world, root)

            def finish(out: torch.Tensor, t: torch.Tensor = t, n: int = n) -> None:
                self._check_root(out, root, n * self._world, what)
                t.copy_(from_bytes(out[self._rank * n : (self._rank + 1) * n], t))

            parts.append((self._submit_bytes(values, what), finish))
        return self._work(parts, output_tensors, what)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        # An all_reduce whose result only the root keeps: the other ranks' tensors stay as they were.
        root = opts.rootRank if opts is not None else 0
        reduce_opts = dist.AllreduceOptions()
        reduce_opts.reduceOp = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
        return self.allreduce(tensors if self._rank == root else [t.clone() for t in tensors], reduce_opts)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> Any:
        # An all_reduce of the inputs laid end to end, of which each rank keeps its own piece:
        # every rank receives the whole sum (the aggregator has no per-rank result).
        op = _op_type(opts)
        what = f"reduce_scatter ({getattr(op, 'name', op)}) of {_describe(output_tensors)}"
        try:
            _same_count(output_tensors, input_tensors, what)
            for out, ins in zip(output_tensors, input_tensors, strict=True):
                if len(ins) != self._world:
                    raise CollectiveError(f"reduce_scatter needs {self._world} input tensors, got {len(ins)}")
                if any(i.dtype != out.dtype or i.numel() != out.numel() for i in ins):
                    raise CollectiveError(f"{what}: every input must have the output's dtype and size, got "
                                          f"{_describe(ins)}")
                for i in ins:
                    _dense(i, what)
        except CollectiveError as e:
            self._refuse(e, self._scattered(output_tensors, op), op)
        pairs = [(out, torch.cat([i.reshape(-1) for i in ins]))
                 for out, ins in zip(output_tensors, input_tensors, strict=True)]
        return self._scatter_all(pairs, op, what)

    def _scattered(self, outputs: list[torch.Tensor], op: Any) -> list[torch.Tensor]:
        """The sizes of the ops of a reduce_scatter into ``outputs``."""
        return [self._wire(sized(self._world * o.numel() * o.element_size()).view(o.dtype), op) for o in outputs]

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        op = _op_type(opts)
        what = f"reduce_scatter_tensor ({getattr(op, 'name', op)}) of {_describe([input])}"
        try:
            if input.numel() != output.numel() * self._world:
                raise CollectiveError(f"{what}: the input needs {self._world} x the output's {output.numel()} "
                                      "elements")
            _dense(input, what)
        except CollectiveError as e:
            self._refuse(e, self._scattered([output], op), op)
        # A copy: the sum is made in place, and the input stays as it was.
        return self._scatter_all([(output, input.reshape(-1).clone())], op, what)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        op = _op_type(opts)
        what = f"reduce_scatter_tensor ({getattr(op, 'name', op)}) of {_describe(inputs)}"
        try:
            _same_count(outputs, inputs, what)
            for t in inputs:
                _dense(t, what)
        except CollectiveError as e:
            self._refuse(e, self._scattered(outputs, op), op)
        pairs = [(out, t.reshape(-1).clone()) for out, t in zip(outputs, inputs, strict=True)]
        return self._scatter_all(pairs, op, what)

    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def _scatter_all(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], op: Any, what: str) -> Any:
        """The reduce_scatter of each (output, flat) pair: ``flat`` holds every rank's pieces end to
        end; this rank's piece of its reduction goes to ``output``. Every pair is checked before
        the first is sent, so a refusal sends none of them."""
        try:
            for out, flat in pairs:
                if flat.dtype != out.dtype or flat.numel() != out.numel() * self._world:
                    raise CollectiveError(f"{what}: the input ({flat.numel()} {flat.dtype}) does not match "
                                          f"{self._world} x the output {_describe([out])}")
                _check_reducible(flat, op, what, "reduce_scatter")
        except CollectiveError as e:
            self._refuse(e, self._scattered([out for out, _ in pairs], op), op)
        parts = []
        for out, flat in pairs:
            src, reduce = self._reduced(flat, op, what, "reduce_scatter")

            def finish(res: Any, out: torch.Tensor = out, flat: torch.Tensor = flat, reduce: Any = reduce) -> None:
                n = out.numel()
                reduce(res)
                out.copy_(flat[self._rank * n : (self._rank + 1) * n].view(out.shape))

            parts.append((src, finish))
        return self._work(parts, [out for out, _ in pairs], what)

    # all_to_all: every rank's bytes for every other rank gathered (world x an all_to_all's bytes:
    # correct and bit-exact, not fast; the aggregator has no per-rank result to route), in two
    # ops: the split table, then the chunks, in a job of their own (see _exchange).

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> Any:
        what = f"all_to_all of {_describe(input_tensors)}"
        try:
            if len(output_tensors) != self._world or len(input_tensors) != self._world:
                raise CollectiveError(f"all_to_all needs {self._world} input and output tensors, got "
                                      f"{len(input_tensors)} and {len(output_tensors)}")
            for t in (*output_tensors, *input_tensors):
                _dense(t, what)
        except CollectiveError as e:
            self._refuse_exchange(e, what)
        chunks = [bytes_of(t) for t in input_tensors]

        def finish(received: list[torch.Tensor]) -> None:
            for o, got in zip(output_tensors, received, strict=True):
                o.copy_(from_bytes(got, o))

        sizes = [o.numel() * o.element_size() for o in output_tensors]
        return self._work([self._exchange(chunks, sizes, finish, what)], output_tensors, what)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> Any:
        what = f"all_to_all_single of {_describe([input])}"
        try:
            _dense(input, what)
            _dense(output, what)
            if input.dim() == 0 or output.dim() == 0:
                raise CollectiveError(f"{what}: all_to_all_single splits tensors by rows: a 0-dim tensor has none")
            if output.dtype != input.dtype or output.shape[1:] != input.shape[1:]:
                raise CollectiveError(f"{what}: the output {_describe([output])} does not match the input's rows")
            sent = _splits(input_split_sizes, input.shape[0], self._world, what, "input")
            wanted = _splits(output_split_sizes, output.shape[0], self._world, what, "output")
        except CollectiveError as e:
            self._refuse_exchange(e, what)
        row = math.prod(input.shape[1:]) * input.element_size()
        data = bytes_of(input)
        edges = [0, *itertools.accumulate(n * row for n in sent)]
        chunks = [data[edges[r] : edges[r + 1]] for r in range(self._world)]

        def finish(received: list[torch.Tensor]) -> None:
            output.copy_(from_bytes(torch.cat(received), output))

        return self._work([self._exchange(chunks, [n * row for n in wanted], finish, what)], [output], what)

    all_to_all_single = alltoall_base

    def _refuse_exchange(self, error: CollectiveError, what: str) -> NoReturn:
        """Refuses an all_to_all's two ops (see :meth:`_exchange`): the split table's, and, in
        its turn among the all_to_alls, the chunks' op, which the other ranks number and fail
        when their table op fails; without it this rank's later all_to_alls would pair with
        the others' earlier ones."""
        try:
            chunk_link = self._links(what).group_link("a2a")
        except CollectiveError:
            raise error from None  # shut down: no op goes out
        with self._a2a_lock:
            seq = self._a2a_calls
            self._a2a_calls += 1
            self.worker.refuse(error, sized_bytes(self._world * self._world * 8))
        self._a2a_release(seq, _chunk_refusal(chunk_link, error, what, lambda: None))
        raise error

    def _exchange(self, chunks: list[torch.Tensor], wanted: list[int], finish: Callable[[list[torch.Tensor]], None],
                  what: str) -> tuple[ConcurrentFuture, Callable[[Any], None]]:
        """The part of an all_to_all that sends ``chunks[r]`` (bytes) to rank ``r`` and gives
        ``finish`` the bytes received from each rank, which must be ``wanted[r]`` long.

        Two ops: the bytes every rank sends every other (a small gather, on the group's
        worker, numbered in the call), then every rank's chunks, padded to the longest, once
        the table is in. The second goes through a job of its own (``<job>.a2a``), its ops
        in the order of the all_to_all calls, so the call does not wait (``async_op=True``
        returns at once) and the group's collectives after it keep their numbers. A rank
        whose ``wanted`` disagrees with what the others send still takes part in both, so the
        ranks stay in step, and its own collective fails.
        """
        world, me = self._world, self._rank
        chunk_link = self._links(what).group_link("a2a")
        # The chunk op's length: the longest of the ranks' bytes (at least this rank's, and what
        # any rank sends it), times the world.
        if not self._a2a_warm and max(sum(c.numel() for c in chunks), *wanted) * world >= blocks.NUMBA_MIN_ELEMENTS:
            # The chunk op goes out from the table op's callback, on the communication thread,
            # where compiling its kernels would silence the connection's heartbeats: here instead
            # (for chunks that may take them: long enough as bytes, whichever integer kind).
            for dtype in (np.int64, np.int32, np.int16, np.uint8):
                blocks.warm_dtype(np.dtype(dtype), chunk_link.block_size)
            self._a2a_warm = True
        mine = torch.tensor([c.numel() for c in chunks], dtype=torch.int64)
        with self._a2a_lock:
            # The call-order number with the table's op: two threads' all_to_alls send their
            # chunks in the order their tables were numbered.
            seq = self._a2a_calls
            self._a2a_calls += 1
            table_op, _ = self._gather_values(mine)
        result: ConcurrentFuture = ConcurrentFuture()
        layout: dict[str, Any] = {}

        def skip(error: BaseException) -> None:
            # This rank sends no chunks, yet numbers their op (in call order) and fails it on
            # every rank: a table op that failed here only (this rank's own timeout, a lost
            # connection) must not leave the other ranks' chunk op unpaired, or every later
            # all_to_all would pair with the one before it.
            self._a2a_release(seq, _chunk_refusal(chunk_link, error, what, lambda: fail_future(result, error)))

        def send_chunks(f: ConcurrentFuture) -> None:
            error = f.exception()
            if error is not None:
                skip(error)
                return
            try:
                table = f.result().view(torch.int64).view(world, world)
                longest = int(table.sum(1).max())
                # Gathered as _gather_values lays bytes out: this rank's at rank x longest, zeros elsewhere.
                gathered = torch.zeros(longest * world, dtype=torch.uint8)
                if longest and chunks:
                    data = torch.cat(chunks)
                    gathered[me * longest : me * longest + data.numel()] = data
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the Work
                logger.exception("omnireduce %s: laying out the chunks failed", what)
                skip(e)
                return
            layout.update(table=table, n=longest)

            def submit() -> Callable[[], None]:
                try:
                    src = chunk_link.allreduce_async(wide(gathered))
                except OmniReduceError as e:
                    return lambda error=e: fail_future(result, error)
                return lambda: forward(as_bytes(src), result)

            self._a2a_release(seq, submit)

        table_op.add_done_callback(send_chunks)

        def received(out: torch.Tensor) -> None:
            table, n = layout["table"], layout["n"]
            starts = torch.cumsum(table, 1) - table  # where rank j's chunk for rank r starts in j's bytes
            got = [int(table[j, me]) for j in range(world)]
            if got != wanted:
                raise CollectiveError(f"{what}: rank {me} expects {wanted} bytes from the ranks, they send {got}")
            finish([out[j * n + int(starts[j, me]) : j * n + int(starts[j, me]) + got[j]] for j in range(world)])

        return result, received

    def _a2a_release(self, seq: int, number: Callable[[], Callable[[], None]]) -> None:
        """Numbers all_to_all ``seq``'s chunk op once every earlier all_to_all's has been (their split
        tables may complete out of call order, on shards): ``number()`` sends or refuses it and
        returns what completes the all_to_all's future."""
        with self._a2a_lock:
            self._a2a_ready[seq] = number
            then = []
            while self._a2a_sent in self._a2a_ready:
                then.append(self._a2a_ready.pop(self._a2a_sent)())
                self._a2a_sent += 1
        # After the lock: completing a future runs its callbacks (the user's, on the Work's
        # future), which may start another all_to_all.
        for complete in then:
            complete()

    # Point to point: each message an op of a job of the two ranks (see worker.p2p).

    def _links(self, what: str) -> PeerLinks:
        with self._p2p_lock:
            if self._shut:
                raise CollectiveError(f"{what}: the process group is shut down")
            if self._p2p is None:
                self._p2p = PeerLinks(self.worker, self._store)
            return self._p2p

    def _message(self, tensors: list[torch.Tensor], peer: int, tag: int, sending: bool) -> Any:
        src, dst = (self._rank, peer) if sending else (peer, self._rank)
        what = f"{'send to' if sending else 'recv from'} rank {peer} (tag {tag}) of {_describe(tensors)}"
        if not 0 <= peer < self._world or peer == self._rank:
            raise CollectiveError(f"{what}: the peer must be another rank of the group's {self._world}")
        links = self._links(what)
        # A receive of several tensors posts them back to back: a receive from any source
        # polling beside it does not take one of its sender's messages in between.
        with links.posting():
            try:
                for t in tensors:
                    _dense(t, what)
            except CollectiveError as e:
                for _ in tensors:
                    links.refuse(e, src, dst, tag)
                raise
            parts = []
            for t in tensors:
                data = bytes_of(t) if sending else torch.zeros(t.numel() * t.element_size(), dtype=torch.uint8)

                def finish(out: torch.Tensor, t: torch.Tensor = t) -> None:
                    if not sending:
                        t.copy_(from_bytes(out, t))

                try:
                    future = as_bytes(links.transfer(wide(data), src, dst, tag))
                except OmniReduceError as e:
                    future = _failed(e)
                parts.append((future, finish))
        return self._work(parts, tensors, what)

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> Any:  # noqa: N803 - torch's names
        return self._message(tensors, dstRank, tag, sending=True)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> Any:  # noqa: N803 - torch's names
        return self._message(tensors, srcRank, tag, sending=False)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        """Receives one tensor from a rank with a message of ``tag`` not received yet, the
        ranks taken in turn (:mod:`worker.anysource`); the Work's ``_source_rank()`` names
        that rank, as torch's ``recv(src=None)`` asks."""
        what = f"recv from any source (tag {tag}) of {_describe(tensors)}"
        if len(tensors) != 1:
            raise CollectiveError(f"{what}: takes one tensor, as gloo's does")
        t = tensors[0]
        _dense(t, what)
        if self._store is None:
            raise CollectiveError(f"{what}: this process group was made without a store")
        if self._world < 2:
            raise CollectiveError(f"{what}: the group has no other rank")
        links = self._links(what)
        data = torch.zeros(t.numel() * t.element_size(), dtype=torch.uint8)
        try:
            future = links.receive_any(wide(data), tag, [r for r in range(self._world) if r != self._rank])
        except OmniReduceError as e:
            future = _failed(e)
        source: list[int] = []

        def finish(got: tuple[int, torch.Tensor]) -> None:
            src, out = got
            t.copy_(from_bytes(byte_view(out), t))
            source.append(src)

        return OmniReduceWork([(future, finish)], tensors, what, source=source)


def _job_of(store: dist.Store, rank: int, group_id: str | None) -> str:
    """The job id of a process group.

    ``OMNIREDUCE_JOB`` names the default group's job; another group's job is that
    name and the group's, so that every group is a job of its own. Without it
    rank 0 makes a unique id and shares it through the group's store (each group
    has its own store prefix).

    A group made again over the same store (``destroy_process_group`` then
    ``init_process_group``) is counted there (each rank its own makings): its
    n-th making after the first is a job of its own (``~n`` added to the name), and
    rank 0's id of it another key. Else the ranks could read the last making's id
    from the store, or meet the last making's failed ops at the aggregator.
    """
    # Each rank counts its own makings: a rank may make the group again before a slower one
    # made it the first time (no barrier between), so one count shared by all would go wrong.
    making = store.add(f"{_MAKINGS_KEY}/{rank}", 1) - 1
    job = config.resolve(None, config.OMNIREDUCE_JOB, "", str)
    if job:
        # The default group is the one made while torch has none yet.
        name = job if not dist.is_initialized() or not group_id else f"{job}.{group_id}"
        suffix = f"~{making}" if making else ""
        return name[: 200 - len(suffix)] + suffix
    key = f"{_JOB_KEY}/{making}"
    if rank == 0:
        store.set(key, f"torch-{uuid.uuid4().hex[:12]}")
    return store.get(key).decode()


def _timeout_of(opts: Any) -> float | None:
    """The seconds an op of the group may wait: the group's ``timeout=`` where it was given
    (torch passes its 30-minute default otherwise), unless ``OMNIREDUCE_TIMEOUT`` is set;
    None leaves it to the worker (``$OMNIREDUCE_TIMEOUT``, else 60 s).

    The variable wins because it is this backend's own setting, while ``timeout=`` is
    shared with the script's other backends (a gloo group made beside it takes it too).
    """
    timeout = getattr(opts, "timeout", None)
    if not isinstance(timeout, timedelta):
        return None
    if config.resolve_optional(None, config.OMNIREDUCE_TIMEOUT, float) is not None:
        return None
    from torch.distributed.constants import default_pg_timeout

    return None if timeout == default_pg_timeout else timeout.total_seconds()


def create_process_group(opts: Any, pg_options: Any = None) -> OmniReduceProcessGroup:
    """The backend's constructor, called by ``dist.init_process_group("omnireduce")`` and ``dist.new_group``.

    Args:
        opts: torch's ``_DistributedBackendOptions`` (store, group_rank, group_size,
            timeout, group_id).
        pg_options: backend options (unused).
    """
    rank, world = opts.group_rank, opts.group_size
    job = _job_of(opts.store, rank, getattr(opts, "group_id", None))
    try:
        worker = connect(rank=rank, world_size=world, job=job, timeout=_timeout_of(opts))
    except ConfigError as e:
        raise ConfigError(f"cannot create the omnireduce process group: {e}") from e
    return OmniReduceProcessGroup(rank, world, worker, store=opts.store)


# Registered here too for code that imports this module without torch's entry points
# (TORCH_DEVICE_BACKEND_AUTOLOAD=0, or a tree that is not pip-installed).
register()
