"""How a tensor is cut into blocks, columns and streams.

A tensor of ``length`` elements is cut into ``num_blocks`` blocks of
``block_size`` elements; the last one may be short (padded logically, never on
the wire). Blocks are striped over ``num_columns`` columns: column ``c`` holds
blocks ``c, c + C, c + 2C, ...``, so the clustered nonzero rows of an embedding
gradient spread over many columns and finish in few rounds. Consecutive columns
are grouped into streams (OmniReduce's slots); a stream moves one block per
column per round, all its columns in one message, and streams run in parallel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from omnireduce.errors import ConfigError

__all__ = [
    "EAGER_PIECE_BYTES", "EAGER_PIECES", "INF", "MAX_BLOCKS", "Layout", "eager_start_blocks", "shard_eager_pieces",
]

#: Sentinel block index: the column (or stream) has no more nonzero blocks.
INF = np.iinfo(np.int64).max
#: Block indices are int64 on the wire; this bound keeps them far from INF.
MAX_BLOCKS = 1 << 48
#: An eager op's payload goes in up to EAGER_PIECES STARTs of at least EAGER_PIECE_BYTES.
EAGER_PIECE_BYTES = 256 << 10
EAGER_PIECES = 8


def shard_eager_pieces(shards: int, pieces: int = EAGER_PIECES) -> int:
    """Each shard's share of an eager op's pieces when the op is split over ``shards``:
    its parts already travel side by side, and more messages only cost CPU."""
    return max(1, pieces // max(1, shards))


def eager_start_blocks(blocks: int, block_bytes: int, message_blocks: int, pieces: int = EAGER_PIECES) -> int:
    """The most blocks one START of an eager op carries, for a rank sending ``blocks``.

    One message's worth (``message_blocks``) at most; within that, the payload is cut
    in up to ``pieces`` pieces of at least EAGER_PIECE_BYTES (a shard of a sharded op
    takes fewer: its op's parts already travel side by side). The aggregator answers
    each run of streams once every rank's part of it is in, so over a link the first
    sums come back while the rest still goes up: with one START per rank, upload and
    download took turns (a dedicated aggregator on 1 Gbit/s links, 2 workers, 100 MB at
    10%: 371 ms in one or two STARTs, 232 ms in eight). Pieces are not smaller, since
    every message costs the CPU of both ends (on loopback that is all there is).
    """
    floor = max(1, EAGER_PIECE_BYTES // max(1, block_bytes))
    return max(1, min(message_blocks, max(floor, -(-blocks // max(1, pieces)))))


@dataclass(frozen=True, slots=True)
class Layout:
    """The block layout of one op; every worker of the op must compute the same one.

    Args:
        length: elements in the flat tensor.
        block_size: elements per block.
        message_blocks: at most this many columns (so blocks) per stream message.
        streams: at most this many streams.
    """

    length: int
    block_size: int
    message_blocks: int
    streams: int
    num_blocks: int = field(init=False)
    num_columns: int = field(init=False)
    num_streams: int = field(init=False)

    def __post_init__(self) -> None:
        for name in ("block_size", "message_blocks", "streams"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.length, (int, np.integer)) or self.length < 0:
            raise ConfigError(f"length must be a non-negative integer, got {self.length!r}")
        nb = -(-self.length // self.block_size)
        if nb >= MAX_BLOCKS:
            raise ConfigError(f"tensor of {self.length} elements has too many blocks ({nb})")
        cols = min(nb, self.streams * self.message_blocks)
        # One stream even for an empty tensor, so that every op has a round to finish on.
        nstreams = max(1, -(-cols // self.message_blocks))
        object.__setattr__(self, "num_blocks", nb)
        object.__setattr__(self, "num_columns", cols)
        object.__setattr__(self, "num_streams", nstreams)

    @property
    def tail_length(self) -> int:
        """Elements in the last block (``block_size`` when the length divides evenly)."""
        if self.num_blocks == 0:
            return 0
        return self.length - (self.num_blocks - 1) * self.block_size

    def stream_columns(self, stream: int) -> slice:
        """The contiguous range of columns carried by ``stream``."""
        n, c = self.num_streams, self.num_columns
        return slice(stream * c // n, (stream + 1) * c // n)

    def message_bytes(self, itemsize: int) -> int:
        """The most payload bytes one message of the op carries (a short tensor in one huge
        block carries no more than itself)."""
        return min(min(self.message_blocks, max(self.num_columns, 1)) * self.block_size, self.length) * itemsize

    def payload_elements(self, ids: np.ndarray) -> int:
        """Elements on the wire for the blocks ``ids`` (the short last block counted short)."""
        n = len(ids) * self.block_size
        if self.tail_length != self.block_size and n and bool((ids == self.num_blocks - 1).any()):
            n -= self.block_size - self.tail_length
        return n
