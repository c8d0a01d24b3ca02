"""A ``torch.distributed`` backend named "omnireduce" whose collectives run through the aggregator.

``import worker.backend`` registers it; then::

    dist.init_process_group("omnireduce")   # rank, world from torchrun; aggregator from OMNIREDUCE_ADDRESS
    dist.all_reduce(t)                       # sparse sum through the aggregator
    DistributedDataParallel(model)           # works on it with no gloo at all

``all_reduce`` (SUM, AVG) of float tensors goes through the sparse protocol.
``broadcast``, ``all_gather`` and ``barrier`` are built on the same sum: a tensor's
bytes travel as small integers (exact in float16), zero on every rank but the
owner, so the sum reproduces them bit for bit, for any dtype. Other collectives
raise an error naming themselves.
"""

from __future__ import annotations

import logging
import uuid
from concurrent.futures import Future as ConcurrentFuture
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from omnireduce import config
from omnireduce.errors import ConfigError, OmniReduceError
from worker.client import Worker

logger = logging.getLogger(__name__)

__all__ = ["BACKEND_NAME", "OmniReduceProcessGroup", "create_process_group"]

BACKEND_NAME = "omnireduce"
_JOB_KEY = "omnireduce/job"
_FLOAT = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _bytes_as_halves(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as float16 values 0..255, exact through a float sum."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).to(torch.float16)


def _halves_to(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return values.to(torch.uint8).view(like.dtype).view(like.shape)


class OmniReduceProcessGroup(dist.ProcessGroup):
    """A process group whose collectives are sums through the omnireduce aggregator.

    Args:
        rank: this process's rank.
        world_size: the number of processes.
        worker: the connected worker of this rank (owned and closed by the group).

    Attributes:
        samples: this rank's sample count for the current step, or None. When set,
            ``all_reduce`` with AVG is the mean weighted by every rank's samples
            (``sum(samples_i * t_i) / sum(samples_i)``): replicas with unequal
            batches then average to the gradient of the global batch.
    """

    def __init__(self, rank: int, world_size: int, worker: Worker) -> None:
        super().__init__(rank, world_size)
        self._rank = rank
        self._world = world_size
        self.worker = worker
        self.samples: float | None = None

    def set_samples(self, samples: float | None) -> None:
        """Sets :attr:`samples` (None: plain averages again)."""
        self.samples = samples

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def size(self) -> int:
        return self._world

    def rank(self) -> int:
        return self._rank

    def shutdown(self) -> None:
        self.worker.close()

    def __repr__(self) -> str:
        return f"OmniReduceProcessGroup(rank={self._rank}, world={self._world}, job={self.worker.job!r})"

    def _work(self, parts: list[tuple[ConcurrentFuture, Any]], value: Any, what: str) -> Any:
        """A Work completing once every (future, finish) part has finished."""
        fut: torch.futures.Future = torch.futures.Future()
        left = [len(parts)]
        failed: list[BaseException] = []

        def done(src: ConcurrentFuture, finish: Any) -> None:
            try:
                finish(src.result())
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the Work
                logger.error("omnireduce %s failed: %s", what, e)
                failed.append(e)
            left[0] -= 1
            if left[0] == 0:
                if failed:
                    e = failed[0]
                    fut.set_exception(RuntimeError(f"omnireduce {what} failed: {type(e).__name__}: {e}"))
                else:
                    fut.set_result(value)

        if not parts:
            fut.set_result(value)
        for src, finish in parts:
            src.add_done_callback(lambda s, f=finish: done(s, f))
        return _create_work_from_future(fut)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        # Options hold a ReduceOp wrapping a RedOpType; only the latter compares reliably.
        op = getattr(op, "op", op)
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise OmniReduceError(f"the omnireduce backend's all_reduce supports SUM and AVG, not {op}")
        parts = []
        for t in tensors:
            if t.dtype not in _FLOAT:
                raise OmniReduceError(f"the omnireduce backend's all_reduce supports float tensors, not {t.dtype}")
            if t.device.type != "cpu":
                raise OmniReduceError(f"the omnireduce backend's all_reduce supports CPU tensors, not {t.device}")
            # A weighted AVG is divided by the total weight in the aggregator.
            weight = self.samples if op == dist.ReduceOp.AVG else None
            average = op == dist.ReduceOp.AVG and weight is None

            def finish(out: torch.Tensor, t: torch.Tensor = t, average: bool = average) -> None:
                t.copy_(out.view(t.shape))
                if average:
                    t.div_(self._world)

            parts.append((self.worker.allreduce_async(t, weight=weight), finish))
        return self._work(parts, tensors, "all_reduce")

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0
        parts = []
        for t in tensors:
            values = _bytes_as_halves(t)
            if self._rank != root:
                values.zero_()

            def finish(out: torch.Tensor, t: torch.Tensor = t) -> None:
                t.copy_(_halves_to(out, t))

            parts.append((self.worker.allreduce_async(values), finish))
        return self._work(parts, tensors, f"broadcast from rank {root}")

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        parts = []
        for outs, t in zip(output_tensors, input_tensors, strict=True):
            if len(outs) != self._world:
                raise OmniReduceError(f"all_gather needs {self._world} output tensors, got {len(outs)}")
            mine = _bytes_as_halves(t)
            n = mine.numel()
            values = torch.zeros(n * self._world, dtype=torch.float16)
            values[self._rank * n : (self._rank + 1) * n] = mine

            def finish(out: torch.Tensor, outs: list[torch.Tensor] = outs, n: int = n) -> None:
                for r, o in enumerate(outs):
                    o.copy_(_halves_to(out[r * n : (r + 1) * n], o))

            parts.append((self.worker.allreduce_async(values), finish))
        return self._work(parts, output_tensors, "all_gather")

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        outs = list(output.view(self._world, *input.shape).unbind(0))
        return self.allgather([outs], [input], opts)

    def barrier(self, opts: Any = None) -> Any:
        one = torch.ones(1, dtype=torch.float32)

        def finish(out: torch.Tensor) -> None:
            if out.item() != self._world:
                raise OmniReduceError(f"barrier counted {out.item()} ranks, expected {self._world}")

        return self._work([(self.worker.allreduce_async(one), finish)], [one], "barrier")

    def _unsupported(self, name: str) -> Any:
        raise OmniReduceError(
            f"the omnireduce backend does not support {name}; it supports all_reduce (SUM, AVG of float "
            "tensors), broadcast, all_gather and barrier"
        )

    def reduce(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("reduce")

    def reduce_scatter(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("reduce_scatter")

    def _reduce_scatter_base(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("reduce_scatter_tensor")

    def alltoall(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("all_to_all")

    def alltoall_base(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("all_to_all_single")

    def gather(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("gather")

    def scatter(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("scatter")

    def send(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("send")

    def recv(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("recv")


def create_process_group(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> OmniReduceProcessGroup:
    """The backend's constructor, called by ``dist.init_process_group("omnireduce")``.

    The job id comes from ``OMNIREDUCE_JOB`` if set; otherwise rank 0 makes a
    unique one and shares it through the group's store, so each process group
    (including subgroups, which get their own store prefix) is its own job.
    """
    job = config.resolve(None, config.OMNIREDUCE_JOB, "", str)
    if not job:
        if rank == 0:
            store.set(_JOB_KEY, f"torch-{uuid.uuid4().hex[:12]}")
        job = store.get(_JOB_KEY).decode()
    try:
        worker = Worker(rank=rank, world_size=world_size, job=job)
    except ConfigError as e:
        raise ConfigError(f"cannot create the omnireduce process group: {e}") from e
    return OmniReduceProcessGroup(rank, world_size, worker)


dist.Backend.register_backend(BACKEND_NAME, create_process_group, devices=["cpu"])
