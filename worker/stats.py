"""Traffic counters of a worker, per op and cumulative."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from omnireduce.transport import frames_nbytes

# frames_nbytes is the transport's, re-exported for the worker's ops.
__all__ = ["OpStats", "Stats", "frames_nbytes", "merge_parallel"]


@dataclass(slots=True)
class OpStats:
    """What one op moved. ``dense_bytes`` is the payload a dense transfer would send."""

    op: int = 0
    elements: int = 0
    #: Blocks of the tensor.
    blocks: int = 0
    dense_bytes: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    blocks_sent: int = 0
    blocks_received: int = 0
    #: Blocks of the union of every worker's nonzero blocks (for a sparse op): the same on
    #: every rank, unlike ``blocks_received``, which leaves out the blocks only this rank
    #: sent when the aggregator does not send them back (an eager op).
    union_blocks: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    rounds: int = 0
    seconds: float = 0.0
    #: "sparse" (zero blocks detected and skipped) or "dense" (every block sent).
    path: str = "sparse"

    @property
    def union_density(self) -> float:
        """The union of every worker's nonzero blocks (for a sparse op) over the tensor's
        blocks: the same on every rank of the op."""
        return self.union_blocks / self.blocks if self.blocks else 0.0

    @property
    def sent_fraction(self) -> float:
        """Bytes sent as a fraction of the dense payload (0 for an empty op)."""
        return self.bytes_sent / self.dense_bytes if self.dense_bytes else 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _add_counters(into: OpStats, s: OpStats) -> None:
    # The counters that add up over parts of one op run in parallel (shards). Spelled out:
    # a loop of getattr/setattr over the names cost more than the rest of a sharded op's
    # bookkeeping (it runs on the communication thread, for every op).
    into.elements += s.elements
    into.blocks += s.blocks
    into.dense_bytes += s.dense_bytes
    into.bytes_sent += s.bytes_sent
    into.bytes_received += s.bytes_received
    into.blocks_sent += s.blocks_sent
    into.blocks_received += s.blocks_received
    into.union_blocks += s.union_blocks
    into.messages_sent += s.messages_sent
    into.messages_received += s.messages_received


def merge_parallel(parts: list[OpStats], seconds: float) -> OpStats:
    """One op's stats from those of its parts run in parallel (e.g. one per aggregator shard).

    Rounds are the slowest part's; every other counter is the parts' sum.

    Args:
        parts: the parts' stats.
        seconds: the whole op's wall time.
    """
    merged = OpStats(seconds=seconds)
    for s in parts:
        merged.op = s.op
        _add_counters(merged, s)
        if s.path == "dense":
            merged.path = "dense"
            # It sent every block: each is in the part's union, on every rank (a rank whose part
            # went the sparse way measures that too), so the union density agrees across ranks.
            merged.union_blocks += s.blocks - s.union_blocks
        merged.rounds = max(merged.rounds, s.rounds)
    return merged


@dataclass(slots=True)
class Stats:
    """Cumulative counters over the completed ops of a worker, and the last op's."""

    ops: int = 0
    total: OpStats = field(default_factory=OpStats)
    last: OpStats | None = None

    def add(self, op: OpStats) -> None:
        self.ops += 1
        total = self.total
        _add_counters(total, op)
        # Rounds and seconds add up over ops run one after another.
        total.rounds += op.rounds
        total.seconds += op.seconds
        self.last = op

    def as_dict(self) -> dict[str, Any]:
        return {"ops": self.ops, "total": self.total.as_dict(), "last": self.last.as_dict() if self.last else None}
