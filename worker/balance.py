"""Batches in proportion to replica speed, for replicas of unequal CPUs and GPUs.

In synchronous data-parallel training every step waits for the slowest replica.
Giving each replica a share of the global batch proportional to its speed makes
them finish together; weighting each replica's gradient by its share of the
samples (``Worker.allreduce(g, weight=n)``, ``OmniReduceState.samples``) keeps
the update equal to the gradient of the mean loss over the global batch.

The aggregator measures the speeds: a weighted op carries the rank's sample
count and its compute time since its previous op, and every such op returns the
recommended batch per rank (:attr:`worker.client.Worker.recommended_batches`,
smoothed over steps, summing to the global batch). This module turns it into
integer batch sizes and splits a data set by them::

    balancer = Balancer(worker, global_batch=512)
    sampler = ProportionalSampler(len(dataset), rank, world_size, seed=0)
    for epoch in range(epochs):
        sampler.set_epoch(epoch, balancer.batch_sizes())
        for batch in batches_of(sampler, balancer.batch_size()):
            ...                                   # forward, backward with weight=len(batch)
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from omnireduce.errors import ConfigError

logger = logging.getLogger(__name__)

#: Calls of :meth:`Balancer.batch_sizes` without a recommendation after which it warns.
WARN_AFTER = 10

__all__ = ["batch_sizes", "Balancer", "ProportionalSampler"]


def batch_sizes(shares: Sequence[float], global_batch: int, minimum: int = 1) -> list[int]:
    """Integer batch sizes summing to ``global_batch``, in proportion to ``shares``.

    Largest remainders: each rank gets the floor of its exact share, and the
    samples left go to the largest fractional parts (ties to the lower rank), so
    the sizes are the same on every rank given the same shares. Ranks below
    ``minimum`` are then raised to it at the expense of the largest batches.

    Args:
        shares: non-negative weights per rank (e.g. the aggregator's recommended
            batches, or speeds); not all zero.
        global_batch: the total.
        minimum: every rank gets at least this many (a rank with no samples would
            stop measuring its speed).

    Raises:
        ConfigError: bad shares, or a total smaller than ``minimum`` per rank.
    """
    s = np.asarray(shares, dtype=np.float64)
    if s.ndim != 1 or len(s) == 0 or not np.isfinite(s).all() or (s < 0).any() or s.max() <= 0:
        raise ConfigError(f"shares must be non-negative finite numbers, not all zero, got {list(shares)}")
    # Shares near the float64 maximum would sum to inf (and every exact share to 0).
    s = s / s.max()
    if minimum < 0 or global_batch < minimum * len(s):
        raise ConfigError(f"a global batch of {global_batch} cannot give {len(s)} ranks at least {minimum} each")
    exact = s / s.sum() * global_batch
    sizes = np.floor(exact).astype(np.int64)
    # Stable sort on the negated remainder: ties go to the lower rank.
    order = np.argsort(-(exact - sizes), kind="stable")
    sizes[order[: global_batch - int(sizes.sum())]] += 1
    # Raising ranks to the minimum takes the samples from the largest batches
    # (one rank per pass: at most one pass per rank).
    short = np.maximum(minimum - sizes, 0)
    sizes += short
    excess = int(short.sum())
    while excess:
        big = int(np.argmax(sizes))
        take = min(excess, int(sizes[big]) - minimum)
        sizes[big] -= take
        excess -= take
    return sizes.tolist()


class Balancer:
    """Each rank's batch size from the aggregator's recommendations.

    Args:
        worker: this rank's worker (anything with ``recommended_batches`` and ``world_size``).
        global_batch: the samples of one step over all ranks.
        minimum: the smallest batch a rank gets.
    """

    def __init__(self, worker: Any, global_batch: int, minimum: int = 1) -> None:
        if global_batch < minimum * worker.world_size:
            raise ConfigError(f"global batch {global_batch} is smaller than {minimum} per rank")
        self.worker = worker
        self.global_batch = global_batch
        self.minimum = minimum
        # Calls answered with equal batches for want of a recommendation (see batch_sizes).
        self._unrecommended = 0

    def batch_sizes(self) -> list[int]:
        """Every rank's batch size: equal until the aggregator has recommended others.

        Only weighted ops through the aggregator bring recommendations: after
        :data:`WARN_AFTER` calls without one (every op went through gloo, the DDP hook's
        dense or auto mode, or carried no weight) a warning says so, once.
        """
        rec = self.worker.recommended_batches
        if rec is None:
            self._unrecommended += 1
            if self._unrecommended == WARN_AFTER:
                logger.warning(
                    "Balancer: no batch recommendation after %d calls, so the batches stay equal: only weighted "
                    "ops through the aggregator bring one (not the DDP hook's buckets through gloo, mode dense)",
                    WARN_AFTER)
        shares = rec if rec is not None else [1.0] * self.worker.world_size
        return batch_sizes(shares, self.global_batch, self.minimum)

    def batch_size(self, rank: int | None = None) -> int:
        """This rank's (or ``rank``'s) batch size."""
        return self.batch_sizes()[self.worker.rank if rank is None else rank]


class ProportionalSampler:
    """Splits a data set over ranks in proportion to their batch sizes, anew each epoch.

    Every rank draws the same permutation (seeded by ``seed`` and the epoch) and
    takes its contiguous share of it, so the ranks' samples are disjoint and
    together cover the data set (up to the remainder of the rounding). Works as a
    ``torch.utils.data.DataLoader`` sampler (it only needs ``__iter__`` and ``__len__``).

    Args:
        length: samples in the data set.
        rank: this rank.
        world_size: the number of ranks.
        seed: the permutation's seed, the same on every rank.
        shuffle: permute each epoch (else ranks take contiguous index ranges).
    """

    def __init__(self, length: int, rank: int, world_size: int, seed: int = 0, shuffle: bool = True) -> None:
        if length < 0 or not 0 <= rank < world_size:
            raise ConfigError(f"bad sampler: length {length}, rank {rank}, world size {world_size}")
        self.length = length
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self._shares: list[float] = [1.0] * world_size

    def set_epoch(self, epoch: int, shares: Sequence[float] | None = None) -> None:
        """Starts an epoch; ``shares`` (e.g. :meth:`Balancer.batch_sizes`) sets the split, same on every rank."""
        self.epoch = epoch
        if shares is not None:
            if len(shares) != self.world_size:
                raise ConfigError(f"{len(shares)} shares for {self.world_size} ranks")
            self._shares = [float(v) for v in shares]

    def _bounds(self) -> tuple[int, int]:
        sizes = batch_sizes(self._shares, self.length, minimum=0) if self.length else [0] * self.world_size
        start = sum(sizes[: self.rank])
        return start, start + sizes[self.rank]

    def __iter__(self) -> Iterator[int]:
        start, stop = self._bounds()
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.length)
        else:
            order = np.arange(self.length)
        return iter(order[start:stop].tolist())

    def __len__(self) -> int:
        start, stop = self._bounds()
        return stop - start
