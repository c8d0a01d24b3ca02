"""Auto mode: per tensor, the sparse protocol or a dense path, whichever the cost model predicts faster.

The choice needs the tensor's density before the op, but measuring it is the mask
pass that the dense path wants to skip. So the density is the **union** density the
last sparse op of the same tensor (same key: a DDP bucket, a tensor length)
measured: the blocks the aggregator returned over the blocks of the tensor. Every
worker of the job receives the same blocks, so every worker records the same
density and makes the same choice, which a dense path through a torch process
group needs (a collective all ranks must enter). Every ``probe_every``-th op of a
key takes the sparse path again to follow a density that changes in training.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Hashable

from omnireduce import config, model
from omnireduce.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["MODES", "PathChooser", "load_costs"]

#: The paths a worker can be told to take.
MODES = ("sparse", "dense", "auto")


def load_costs(path: str | None = None) -> model.CostParams:
    """Machine parameters for the model: ``path``, else ``$OMNIREDUCE_COSTS``, else
    ``omnireduce-calibrate``'s default file, else built-in defaults (logged)."""
    path = path or os.environ.get(config.OMNIREDUCE_COSTS) or model.DEFAULT_COSTS_PATH
    try:
        return model.CostParams.load(path)
    except FileNotFoundError:
        logger.info("no cost parameters at %s (run omnireduce-calibrate); using the defaults", path)
    except (OSError, ValueError, TypeError) as e:
        logger.warning("cost parameters at %s unreadable (%s); using the defaults", path, e)
    return model.CostParams()


class PathChooser:
    """Remembers each tensor's last measured union density and picks the path for its next op.

    Args:
        world_size: workers of the job.
        ring_available: the dense path is a ring through a torch process group (else a
            dense transfer through the aggregator).
        costs: the model's machine parameters (default :func:`load_costs`).
        probe_every: every this many ops of a key take the sparse path to re-measure.
        layout: ``block_size``, ``message_blocks``, ``streams``, ``shards`` of the sparse path, and
            ``inplace`` (the ops sum in place: no result to zero).
    """

    def __init__(
        self,
        world_size: int,
        ring_available: bool,
        costs: model.CostParams | None = None,
        probe_every: int = 16,
        **layout: int,
    ) -> None:
        if probe_every < 1:
            raise ConfigError(f"probe_every must be >= 1, got {probe_every}")
        self.world_size = world_size
        self.ring_available = ring_available
        self.costs = costs or load_costs()
        self.probe_every = probe_every
        self.layout = layout
        self._union: dict[Hashable, float] = {}
        self._calls: dict[Hashable, int] = {}
        # Per key: the inputs of its last prediction and the path it gave. A DDP bucket's
        # union changes only when a sparse op measures it, so most steps reuse it.
        self._plans: dict[Hashable, tuple[float, int, int, str]] = {}
        self._lock = threading.Lock()

    def choose(self, key: Hashable, elements: int, element_size: int) -> str:
        """"sparse" or "dense" for the next op of ``key``; counts the call."""
        return self.plan(key, elements, element_size)[0]

    def plan(self, key: Hashable, elements: int, element_size: int) -> tuple[str, int | None]:
        """The path for the next op of ``key``, and what the choice rests on; counts the call.

        Returns:
            ``(path, basis)``: ``basis`` is None when the op measures (the first op of
            ``key``, and every ``probe_every``-th: "sparse" on every rank, whatever the
            model says), else the number of the probe cycle the op is in. Every rank
            counts the same calls of a key, so the basis is the same on every rank and
            changes at the same op: the first op after each probe, where ranks that agree
            on paths (the DDP hook) vote, once per cycle. It rests on call counts, not on
            how many densities a rank recorded, because an op may succeed on some ranks and
            fail on others: their counts of densities would part, and with them the votes.
            A key with no density recorded here (its measuring op failed on this rank) is
            "sparse".
        """
        with self._lock:
            calls = self._calls.get(key, 0)
            self._calls[key] = calls + 1
            union = self._union.get(key)
        if calls % self.probe_every == 0:
            return "sparse", None
        basis = calls // self.probe_every
        if union is None:
            return "sparse", basis
        last = self._plans.get(key)
        if last is not None and last[:3] == (union, elements, element_size):
            return last[3], basis
        # Each worker's own density, for random blocks, from the union the aggregator returned.
        density = 1.0 - (1.0 - min(union, 1.0)) ** (1.0 / max(1, self.world_size))
        path, sparse_s, dense_s = model.choose_path(
            elements, density, self.world_size, self.costs, ring_available=self.ring_available,
            element_size=element_size, union=union, **self.layout,
        )
        logger.debug("auto %r: union %.4f, sparse %.3g s, dense %.3g s -> %s", key, union, sparse_s, dense_s, path)
        with self._lock:
            self._plans[key] = (union, elements, element_size, path)
        return path, basis

    def record(self, key: Hashable, union: float) -> None:
        """The union density a sparse op of ``key`` measured."""
        with self._lock:
            self._union[key] = union

    def union(self, key: Hashable) -> float | None:
        """The last union density recorded for ``key``."""
        with self._lock:
            return self._union.get(key)
