"""A tensor's bytes as the process group's byte-moving collectives send them.

``broadcast``, ``all_gather``, ``gather``, ``scatter``, ``all_to_all`` and point-to-point
messages sum bytes of which every rank but one sends zeros: the sum is the owner's bytes,
bit for bit, for any dtype. They go as the widest integer type their length allows
(:func:`wide`), as the workers and the aggregator sum integers in int64.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from worker.loop import forward

__all__ = ["as_bytes", "bytes_of", "from_bytes", "sized", "sized_bytes", "wide"]

# Widest first: the aggregator and the workers sum integers in int64, so a uint8 byte costs
# them an int64 element.
_WIDE = (torch.int64, torch.int32, torch.int16)


def sized(nbytes: int) -> torch.Tensor:
    """A tensor of ``nbytes`` bytes that holds none (a meta tensor): the size of an op that is
    refused, for a sharded worker to number it on the shards that the other ranks' op takes."""
    return torch.empty(nbytes, dtype=torch.uint8, device="meta")


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a copy where ``t`` is not contiguous)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8)
    return flat.view(torch.uint8)


def from_bytes(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`bytes_of`: ``values`` as a tensor of ``like``'s dtype and shape."""
    if like.numel() == 0:
        return torch.empty_like(like)
    return values.view(like.dtype).view(like.shape)


def wide(values: torch.Tensor) -> torch.Tensor:
    """Bytes of which every rank but one sends zeros (so their sum is the same bytes, with no
    carry from one byte into the next), viewed as the widest integer type their length allows
    (copied first where their offset is not a multiple of its size): fewer, wider elements to
    sum (2 ranks on loopback, an op of 1 MB took 3.5 ms as int64 and 7.3 ms as uint8; 16 MB,
    29.5 and 70.5 ms)."""
    if values.numel() == 0:
        return values
    for dtype in _WIDE:
        if values.numel() % dtype.itemsize == 0:
            if values.storage_offset() % dtype.itemsize:
                # The type follows the length alone, which every rank of the op agrees on (a
                # sender's tensor may be a view at any offset, the receiver's zeros are not):
                # bytes at an offset the type does not divide are copied to a fresh buffer.
                values = values.clone()
            return values.view(dtype)
    return values


# Bits of each piece of a rooted collective's byte count in its trailer: its square, summed
# over up to MAX_WORLD_SIZE ranks, stays well within int64 for any count below 2**63.
_PIECE_BITS = 21
_PIECES = 3


def _agreed(nbytes: int, root: int) -> list[int]:
    """What the ranks of a rooted collective must agree on: the root, and the byte count in pieces."""
    mask = (1 << _PIECE_BITS) - 1
    return [root, *((nbytes >> (_PIECE_BITS * i)) & mask for i in range(_PIECES))]


_TRAILER_BYTES = 2 * 8 * (1 + _PIECES)


def rooted_size(nbytes: int) -> int:
    """The length of :func:`with_root`'s bytes for ``nbytes`` of values."""
    return -(-nbytes // 8) * 8 + _TRAILER_BYTES


def with_root(values: torch.Tensor | None, nbytes: int, root: int) -> torch.Tensor:
    """Bytes of a rooted collective (broadcast, scatter) to sum: the root's ``values`` (zeros
    on the other ranks), padded to 8 bytes, then a trailer of int64 that every rank adds: the
    root and the byte count (in pieces), then their squares. :func:`agreement_of` reads their
    sums back: the ranks gave one value if and only if ``sum(v)**2 == world * sum(v**2)``, so
    a misnamed root, or a tensor a few bytes off (the padding hides it from the aggregator's
    length check), fails every rank instead of summing two ranks' bytes into the result or
    cutting it short. The length is a multiple of 8: :func:`wide` sends it as int64, so the
    sums of the trailer are exact."""
    out = torch.zeros(rooted_size(nbytes), dtype=torch.uint8)
    if values is not None:
        out[:nbytes] = values
    agreed = _agreed(nbytes, root)
    out[-_TRAILER_BYTES:].view(torch.int64).copy_(torch.tensor(agreed + [v * v for v in agreed], dtype=torch.int64))
    return out


def agreement_of(out: torch.Tensor, world: int) -> tuple[bool, bool]:
    """From the summed trailer of :func:`with_root`'s bytes: whether the ranks named one root,
    and whether they gave one byte count."""
    sums = out[-_TRAILER_BYTES:].clone().view(torch.int64).tolist()
    half = len(sums) // 2
    same = [s * s == q * world for s, q in zip(sums[:half], sums[half:], strict=True)]
    return same[0], all(same[1:])


def sized_bytes(nbytes: int) -> torch.Tensor:
    """:func:`sized` of an op of bytes, as :func:`wide` sends them (so a sharded worker
    numbers the refused op on the shards that the other ranks' op takes)."""
    return wide(sized(nbytes))


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` (an op's result of :func:`wide` bytes) as uint8 again."""
    # An empty result may have any strides, which view() refuses.
    return t.view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)


def as_bytes(src: Future) -> Future:
    """The future of ``src``'s tensor result as uint8 bytes again (:func:`byte_view`)."""
    out: Future = Future()
    forward(src, out, byte_view)
    return out
