"""Cost models of allreduce: alpha-beta (Hockney) terms for the classic dense algorithms and
for this project's sparse block protocol, with the parameters measured by ``omnireduce-calibrate``.

Every function returns seconds. ``size`` is the tensor's size in bytes, ``n`` the number of
workers. A message of ``m`` bytes costs ``alpha + m * beta``; a reduction costs ``gamma`` per
byte of each operand added (``CostParams.add_s_per_byte``).

The sparse model follows what one op does (``worker.op``, ``aggregator.engine``): every worker
computes its block mask, joins with a START (round 0), then each stream moves one block per
column per round until every column has passed the last nonzero block of the union of the
workers' blocks; the aggregator sums each round and sends the sums to every worker, which
scatters them into a fresh result.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from omnireduce.config import PROBE_DENSE
from omnireduce.layout import eager_start_blocks, shard_eager_pieces

logger = logging.getLogger(__name__)

__all__ = [
    "CostParams",
    "SparseEstimate",
    "DEFAULT_COSTS_PATH",
    "ring_time",
    "recursive_doubling_time",
    "rabenseifner_time",
    "parameter_server_time",
    "union_density",
    "expected_max_rounds",
    "sparse_estimate",
    "sparse_time",
    "choose_path",
]

#: Where ``omnireduce-calibrate`` writes its parameters by default.
DEFAULT_COSTS_PATH = os.path.join(os.path.expanduser("~"), ".cache", "omnireduce", "costs.json")
# Bytes of one block pointer on the wire (int64), sent with every block and every instruction.
_INDEX_BYTES = 8
_PAGE = 4096


@dataclass
class CostParams:
    """Machine parameters of the models; all times in seconds.

    Args:
        alpha: one-way latency of a ZeroMQ message between two processes.
        beta: seconds per byte of a one-way ZeroMQ transfer.
        mask_s_per_byte: the worker's block-mask kernel per byte of zero blocks (read in full).
        mask_dense_s_per_byte: the same per byte of nonzero blocks (the kernel stops at the
            first nonzero word of a block).
        copy_s_per_byte: gathering or scattering blocks by index, per byte moved.
        zero_s_per_byte: first touch of freshly allocated memory (huge pages: fault and zeroing), per byte.
        page_fault_s: first touch of one 4 KiB page of a lazily mapped sparse result.
        add_s_per_byte: summing one operand into another, per byte of the operand.
        per_message_s: CPU time of the Python path (encode, decode, engine) per protocol message.
        scattered_s_per_byte: what scattered (not all-nonzero) blocks cost beyond the copies
            above, per byte of the union: the aggregator's unaligned sums (a zeroed
            accumulator, indexed adds, the result assembled block by block) and the
            worker's per-round gathers and scatters. Measured on real ops by the calibration.
        cores: CPU cores the processes of one host share (loopback: all workers and the aggregator).
        full_duplex: whether sending and receiving on a link overlap (a real NIC); on loopback
            both directions are CPU work on the same cores, so they add.
        meta: free-form notes of the calibration (host, load average, date).
    """

    alpha: float = 50e-6
    beta: float = 1.0 / 2e9
    mask_s_per_byte: float = 0.045e-9  # 100 MB float32 in 4.4 ms (the word-row kernel, an EPYC)
    mask_dense_s_per_byte: float = 0.01e-9  # stops at each block's first word: 100 MB in 0.9 ms
    copy_s_per_byte: float = 0.3e-9
    zero_s_per_byte: float = 0.15e-9
    page_fault_s: float = 1e-6
    add_s_per_byte: float = 0.15e-9
    per_message_s: float = 40e-6
    scattered_s_per_byte: float = 0.0
    cores: int = 2
    full_duplex: bool = False
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CostParams:
        """Parses :meth:`to_json`'s output; unknown keys are ignored (newer files), missing ones default.

        Raises:
            ValueError: not a JSON object, or a value of the wrong type (a string, a bool for a
                number, NaN, a negative time, ``cores`` below 1): every rank's choices would
                otherwise fail or go one way, far from where the file was read.
        """
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError(f"expected a JSON object of parameters, got {type(raw).__name__}")
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in raw:
                continue
            v = raw[f.name]
            if f.name == "meta":
                ok = isinstance(v, dict)
            elif f.name == "full_duplex":
                ok = isinstance(v, bool)
            elif f.name == "cores":
                ok = isinstance(v, int) and not isinstance(v, bool) and v >= 1
            else:
                ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0)
            if not ok:
                raise ValueError(f"parameter {f.name} has an invalid value {v!r}")
            values[f.name] = v
        return cls(**values)

    def save(self, path: str = DEFAULT_COSTS_PATH) -> str:
        """Writes the parameters as JSON (atomically: a file of its own, renamed over the old
        one, so two writers at once each leave a whole file); returns the path."""
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".costs-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return path

    @classmethod
    def load(cls, path: str = DEFAULT_COSTS_PATH) -> CostParams:
        """Reads a JSON file written by :meth:`save`."""
        with open(path) as f:
            return cls.from_json(f.read())


def _link(send: float, recv: float, p: CostParams) -> float:
    """Seconds for a link to carry ``send`` and ``recv`` bytes at once."""
    return (max(send, recv) if p.full_duplex else send + recv) * p.beta


def ring_time(size: float, n: int, p: CostParams) -> float:
    """Ring allreduce (reduce-scatter then allgather): ``2(n-1)`` steps of ``size / n`` bytes.

    ``2(n-1) alpha + 2(n-1)/n size beta + (n-1)/n size gamma``; every step both sends and
    receives a chunk, which on a half-duplex link costs twice.
    """
    if n <= 1:
        return 0.0
    chunk = size / n
    step = p.alpha + _link(chunk, chunk, p)
    return 2 * (n - 1) * step + (n - 1) * chunk * p.add_s_per_byte


def _pof2(n: int) -> tuple[int, int]:
    """The largest power of two ``<= n`` and the ranks left over."""
    q = 1 << (n.bit_length() - 1)
    return q, n - q


def recursive_doubling_time(size: float, n: int, p: CostParams) -> float:
    """Recursive doubling: ``log2 n`` exchanges of the whole tensor, each followed by a sum.

    For ``n`` not a power of two the ``r`` extra ranks first send their tensor to a partner
    and get the result back at the end: two more whole-tensor messages (Thakur et al. 2005).
    """
    if n <= 1:
        return 0.0
    q, r = _pof2(n)
    whole = p.alpha + _link(size, size, p)
    t = int(math.log2(q)) * (whole + size * p.add_s_per_byte)
    if r:
        t += 2 * (p.alpha + size * p.beta) + size * p.add_s_per_byte
    return t


def rabenseifner_time(size: float, n: int, p: CostParams) -> float:
    """Rabenseifner: reduce-scatter by recursive halving, allgather by recursive doubling.

    ``2 log2(n) alpha + 2 (n-1)/n size beta + (n-1)/n size gamma`` for a power of two
    (full duplex); extra ranks cost two whole-tensor messages as in recursive doubling.
    """
    if n <= 1:
        return 0.0
    q, r = _pof2(n)
    moved = (q - 1) / q * size
    rs = math.log2(q) * p.alpha + _link(moved, moved, p)
    t = 2 * rs + moved * p.add_s_per_byte
    if r:
        t += 2 * (p.alpha + size * p.beta) + size * p.add_s_per_byte
    return t


def parameter_server_time(size: float, n: int, p: CostParams, shards: int = 1) -> float:
    """Dense parameter server: every worker sends the whole tensor to the aggregator and gets the sum back.

    The aggregator's link carries ``n * size`` bytes each way (divided over ``shards``) and it
    adds ``n`` operands of ``size`` bytes.
    """
    if n <= 1:
        return 0.0
    shards = max(1, shards)
    return 2 * p.alpha + _link(n * size / shards, n * size / shards, p) + n * size / shards * p.add_s_per_byte


def union_density(density: float | Sequence[float], n: int | None = None) -> float:
    """Fraction of blocks nonzero in at least one worker, for blocks placed independently at random.

    Args:
        density: every worker's block density, or one density shared by ``n`` workers.
        n: the number of workers when ``density`` is one number.
    """
    if isinstance(density, (int, float)):
        if n is None:
            raise ValueError("n is required with a single density")
        ds = np.full(n, float(density))
    else:
        ds = np.asarray(density, dtype=float)
    return float(1.0 - np.prod(1.0 - np.clip(ds, 0.0, 1.0)))


def _binom_cdf(trials: int, prob: float) -> np.ndarray:
    """``P(X <= k)`` for ``k = 0..trials`` of a Binomial(trials, prob), in log space."""
    k = np.arange(trials + 1, dtype=float)
    logc = np.concatenate(([0.0], np.cumsum(np.log(trials - k[1:] + 1) - np.log(k[1:]))))
    logpmf = logc + k * math.log(prob) + (trials - k) * math.log1p(-prob)
    return np.minimum(np.cumsum(np.exp(logpmf)), 1.0)


def expected_max_rounds(num_blocks: int, columns: int, union: float, group: int | None = None) -> float:
    """Expected largest number of union-nonzero blocks in a column, over ``group`` columns.

    A stream advances one block per column per round, so a stream of ``group`` columns
    needs this many data rounds (after round 0). Column ``c`` holds blocks ``c, c + C, ...``:
    the first ``num_blocks mod C`` columns (or all) have ``L = ceil(num_blocks / C)`` rows,
    the others ``L - 1``; each row is in the union with probability ``union``, so a column's
    count is Binomial and ``E[max] = sum_k (1 - P(max <= k))``.

    Args:
        num_blocks: blocks of the tensor.
        columns: columns of the layout (``min(blocks, message_blocks * streams)``).
        union: the union block density.
        group: columns the maximum is taken over (one stream's); all of them by default.
    """
    if num_blocks <= 0 or columns <= 0 or union <= 0.0:
        return 0.0
    rows = -(-num_blocks // columns)
    long_cols = num_blocks - columns * (rows - 1)
    g = columns if group is None else max(1, min(group, columns))
    if union >= 1.0:
        return float(rows if long_cols * g >= columns or g == columns else rows - 1)
    # The group's share of long columns (streams hold contiguous columns; the mix is averaged).
    a = g * long_cols / columns
    b = g - a
    with np.errstate(divide="ignore"):
        log_long = np.log(_binom_cdf(rows, union))[:rows]
        log_short = np.log(_binom_cdf(rows - 1, union)) if rows > 1 else np.zeros(1)
    log_short = np.concatenate((log_short, np.zeros(max(0, rows - len(log_short)))))[:rows]
    below = np.exp(a * log_long + b * log_short)  # P(max <= k), k = 0..rows-1
    return float(np.sum(1.0 - below))


@dataclass
class SparseEstimate:
    """The parts of a sparse allreduce prediction, in seconds unless named otherwise."""

    total: float
    mask: float
    result_pages: float
    copies: float
    transfer: float
    rounds: float
    union: float
    critical_rounds: float
    stream_rounds: float
    messages: float
    bytes_in: float
    bytes_out: float


def sparse_estimate(
    elements: int,
    world_size: int,
    p: CostParams,
    density: float | Sequence[float] = 1.0,
    *,
    element_size: int = 4,
    block_size: int = 256,
    message_blocks: int = 256,
    streams: int = 4,
    shards: int = 1,
    union: float | None = None,
    inplace: bool = False,
) -> SparseEstimate:
    """Predicts one sparse allreduce of this project's protocol, part by part.

    The op's time is the worker's block mask and result allocation (before and around the
    exchange), plus the exchange, which is bound by whichever is longest of: the critical
    path of round trips (the slowest stream's rounds), the CPU time the aggregator (per
    shard) spends on messages, bytes and sums, and the CPU time of the processes sharing
    the host's cores (workers and aggregator: on loopback they contend).

    Args:
        elements: elements of the tensor.
        world_size: workers.
        p: machine parameters.
        density: fraction of nonzero blocks per worker (one value for all, or one per worker).
        element_size: bytes per element.
        block_size: elements per block.
        message_blocks: blocks (columns) per stream message.
        streams: streams per op.
        shards: aggregator shards; streams, bytes and messages are divided over them.
        union: the union block density, if known (else from ``density`` for random blocks).
        inplace: the sum goes into the input (or a caller's buffer), not a fresh array.
    """
    n = max(1, world_size)
    size = float(elements) * element_size
    dens = np.full(n, float(density)) if isinstance(density, (int, float)) else np.asarray(density, dtype=float)
    u = union_density(dens) if union is None else float(union)
    nb = -(-elements // block_size) if elements else 0
    cols = min(nb, message_blocks * streams)
    nstreams = max(1, -(-cols // message_blocks)) if cols else 1
    per_stream = max(1, cols // nstreams) if cols else 0
    shards = max(1, min(shards, nstreams))
    if nb <= cols:
        # One row of blocks: an eager op, whose START carries the blocks (one round trip).
        crit = per_stream_rounds = 1.0
    else:
        crit = expected_max_rounds(nb, cols, u) + 1.0  # + round 0 (START and the first instruction)
        per_stream_rounds = expected_max_rounds(nb, cols, u, per_stream) + 1.0
    stream_rounds = nstreams * per_stream_rounds
    block_bytes = block_size * element_size
    # Messages each way per worker: a stream-round each, except that an eager op's streams
    # travel in as few STARTs as hold layout.eager_start_blocks (per shard, in its share
    # of the pieces), and their RESULTs likewise.
    shard_blocks = float(dens.max()) * nb / shards
    most = eager_start_blocks(math.ceil(shard_blocks), block_bytes, message_blocks, shard_eager_pieces(shards))
    exchanges = (max(1.0, min(float(nstreams), shards * math.ceil(shard_blocks / most)))
                 if nb <= cols else stream_rounds)
    # Worker -> aggregator: own blocks, each with the pointer to its next; START: the first
    # nonzero block of each column that has one (only finite pointers travel).
    sent = dens * size * (1.0 + _INDEX_BYTES / block_bytes) + _INDEX_BYTES * np.minimum(cols, dens * nb)
    # Aggregator -> each worker: the union's sums, and the instruction: one pointer per union block.
    recv = u * size * (1.0 + _INDEX_BYTES / block_bytes)
    bytes_in, bytes_out = float(sent.sum()), n * recv
    # Every exchange: up to n messages in and n out at the aggregator, 1 in and 1 out at a worker.
    messages = 2.0 * n * exchanges
    # The mask kernel reads every word of a tensor unless most of its blocks are nonzero,
    # when it stops at each block's first nonzero word (config.PROBE_DENSE).
    mask = size * max(p.mask_dense_s_per_byte if d > PROBE_DENSE else p.mask_s_per_byte for d in dens)
    # A fresh result (worker.op.lazy_zeros): below 30% of 4 KiB pages written, a lazy mapping
    # faults in each page a union block lands on; above, huge pages zero the whole tensor.
    pages = 1.0 - (1.0 - u) ** max(1.0, _PAGE / block_bytes)
    if inplace:
        result_pages = 0.0
    elif pages < 0.3 and size >= 1 << 22:
        result_pages = pages * size / _PAGE * p.page_fault_s
    else:
        result_pages = size * p.zero_s_per_byte
    # Consecutive blocks (a dense op) go out as views; scattered ones are gathered.
    gather = 0.0 if dens.max() >= 1.0 else float(dens.max()) * size * p.copy_s_per_byte
    worker_cpu = gather + u * size * p.copy_s_per_byte + 2.0 * exchanges * p.per_message_s
    agg_cpu = (messages * p.per_message_s + bytes_in * p.add_s_per_byte) / shards
    transfer = _link(bytes_in / shards, bytes_out / shards, p)
    latency = crit * 2.0 * (p.alpha + p.per_message_s)
    # n workers and the aggregator share the cores; every byte moved is CPU work at both ends.
    host_cpu = (n * worker_cpu + agg_cpu * shards + 2 * transfer * shards) / max(1, p.cores)
    exchange = max(latency, agg_cpu + transfer, worker_cpu, host_cpu)
    # A tensor whose blocks are not all nonzero takes the protocol's unaligned paths.
    scattered = u * size * p.scattered_s_per_byte if dens.max() < 1.0 else 0.0
    total = mask + result_pages + exchange + scattered
    return SparseEstimate(
        total=total, mask=mask, result_pages=result_pages, copies=worker_cpu, transfer=transfer, rounds=latency,
        union=u, critical_rounds=crit, stream_rounds=stream_rounds, messages=messages, bytes_in=bytes_in,
        bytes_out=bytes_out,
    )


def sparse_time(elements: int, world_size: int, p: CostParams, density: float | Sequence[float] = 1.0,
                **kwargs: Any) -> float:
    """The predicted seconds of :func:`sparse_estimate` (same arguments)."""
    return sparse_estimate(elements, world_size, p, density, **kwargs).total


def choose_path(
    elements: int,
    density: float | Sequence[float],
    world_size: int,
    p: CostParams,
    *,
    ring_available: bool = False,
    element_size: int = 4,
    **sparse_kwargs: Any,
) -> tuple[str, float, float]:
    """Picks the path an auto mode should take for one tensor.

    The dense alternative is a ring through a torch process group when one exists (plus
    nothing else: the tensor is used as is), else a dense transfer through the aggregator
    (every block sent, no mask pass).

    Args:
        elements: elements of the tensor.
        density: its block density (per worker or shared).
        world_size: workers.
        p: machine parameters.
        ring_available: a dense ring (torch process group) exists.
        element_size: bytes per element.
        **sparse_kwargs: layout of the sparse path (see :func:`sparse_estimate`).

    Returns:
        ``("sparse" | "dense", predicted sparse seconds, predicted dense seconds)``.
    """
    size = float(elements) * element_size
    sparse = sparse_time(elements, world_size, p, density, element_size=element_size, **sparse_kwargs)
    if ring_available:
        dense = ring_time(size, world_size, p)
    else:
        # The dense path through the aggregator is the block protocol with every block
        # sent and no mask pass (worker.op's dense mode): the sparse model at density 1.
        kwargs = {k: v for k, v in sparse_kwargs.items() if k != "union"}
        full = sparse_estimate(elements, world_size, p, 1.0, element_size=element_size, union=1.0, **kwargs)
        dense = full.total - full.mask
    path = "sparse" if sparse < dense else "dense"
    logger.debug("choose_path: %d elements, density %s: sparse %.3g s, dense %.3g s -> %s",
                 elements, density, sparse, dense, path)
    return path, sparse, dense
