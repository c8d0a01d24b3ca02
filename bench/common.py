"""What the benchmarks share: the run specification, the test tensors, and the outputs
(a table on stdout, JSON, CSV and a PNG plot)."""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import socket
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

__all__ = [
    "SYSTEMS",
    "COLOCATED",
    "ROWS",
    "ROWS_COLOCATED",
    "KNOWN",
    "KNOWN_COLOCATED",
    "is_known",
    "is_colocated",
    "is_rows",
    "worker_mode",
    "run_local_ranks",
    "DENSITIES",
    "RankSpec",
    "make_tensor",
    "skewed_blocks",
    "row_from_event",
    "format_table",
    "write_outputs",
    "parse_size",
    "free_port",
    "add_predictions",
    "median_model_error",
]

#: The omnireduce system whose ranks serve their own aggregator shards (worker.colocated).
COLOCATED = "omnireduce-colocated"
#: omnireduce of the sparse COO tensor gloo-sparse sums (worker.rows: a row is a block).
ROWS = "omnireduce-rows"
#: The same through co-located shards.
ROWS_COLOCATED = "omnireduce-rows-colocated"
#: omnireduce of the dense tensor gloo sums, given its nonzero rows (worker.knownrows: no mask pass).
KNOWN = "omnireduce-knownrows"
#: The same through co-located shards.
KNOWN_COLOCATED = "omnireduce-knownrows-colocated"
#: The systems compared; gloo's dense all_reduce is the reference of every speedup.
SYSTEMS = ("gloo", "gloo-sparse", "omnireduce", "omnireduce-dense", "omnireduce-auto", COLOCATED, ROWS,
           ROWS_COLOCATED, KNOWN, KNOWN_COLOCATED)


def is_colocated(system: str) -> bool:
    """Whether ``system`` runs on shards served by the ranks themselves (no aggregator process)."""
    return system in (COLOCATED, ROWS_COLOCATED, KNOWN_COLOCATED)


def is_known(system: str) -> bool:
    """Whether ``system`` sums the dense tensor in place given its nonzero rows (dense in, dense out)."""
    return system in (KNOWN, KNOWN_COLOCATED)


def is_rows(system: str) -> bool:
    """Whether ``system`` sums gloo-sparse's COO tensor (sparse in, sparse out) rather than the dense one."""
    return system in (ROWS, ROWS_COLOCATED)


def worker_mode(system: str) -> str:
    """The worker mode of an omnireduce system: "sparse", "dense" or "auto" (rows need none: sparse)."""
    variant = system.removeprefix("omnireduce").lstrip("-")
    return variant if variant in ("dense", "auto") else "sparse"
#: OmniReduce's microbenchmark densities (fraction of 256-element blocks that are nonzero).
DENSITIES = (1.0, 0.8, 0.4, 0.2, 0.1, 0.05, 0.02, 0.01)


@dataclass
class RankSpec:
    """Everything a rank process needs; sent to it as JSON.

    Args:
        world_size: ranks in the run.
        sizes: tensor sizes in elements (float32).
        densities: fractions of nonzero blocks.
        systems: which of :data:`SYSTEMS` to time, in this order.
        repeats: timed repetitions per case, after ``warmup`` untimed ones.
        warmup: untimed repetitions per case.
        block_size: omnireduce's elements per block.
        message_blocks: omnireduce's blocks per message; None leaves the library's default.
        streams: omnireduce's streams per op; None leaves the library's default.
        address: the aggregator's endpoint.
        store: path of the file the ranks rendezvous through (torch's FileStore).
        seed: base of every rank's random generator.
        op_timeout: seconds any single operation may take before the rank fails.
        torch_threads: torch intra-op threads per rank (gloo's sparse path uses them).
        check: compare every system's result with gloo's dense sum (untimed).
        pattern_block: the block of the nonzero pattern (OmniReduce's 256); it stays put when
            ``block_size`` changes, so that block sizes are compared on the same tensors.
        sparse_io: time gloo-sparse's (and the rows systems') conversion to and from the sparse
            tensor too.
        interleave: time the systems round-robin per repetition instead of one after another.
        new_output: time omnireduce's allreduce into a new array; by default it sums in
            place into the same buffer as gloo's all_reduce (refilled untimed).
        skew: 0 places every rank's nonzero blocks uniformly at random; above 0, with this
            Zipf exponent over a popularity order every rank shares (see :func:`skewed_blocks`).
        colocated_listen: per rank, the endpoint its own aggregator shard listens on
            (the "-colocated" systems: every rank serves one shard, worker.colocated).
    """

    world_size: int
    sizes: list[int]
    densities: list[float]
    systems: list[str]
    repeats: int = 10
    warmup: int = 2
    block_size: int = 256
    message_blocks: int | None = None
    streams: int | None = None
    address: str = ""
    store: str = ""
    seed: int = 0
    op_timeout: float = 120.0
    torch_threads: int = 1
    check: bool = True
    pattern_block: int = 256
    sparse_io: bool = False
    interleave: bool = False
    new_output: bool = False
    skew: float = 0.0
    colocated_listen: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        return cls(**json.loads(text))


def free_port() -> int:
    """A TCP port free on loopback now (for a rendezvous store the ranks are told about)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_local_ranks(module: str, argv: list[str] | None, workers: int, rank_env: str,
                    timeout: float) -> list[dict[str, Any]] | None:
    """Runs ``python -m module argv`` as ``workers`` rank processes on loopback.

    Each process gets torch's env:// rendezvous (``MASTER_ADDR``/``MASTER_PORT``) and its rank
    in ``rank_env``; the module's ``main`` runs the rank when that is set.

    Returns:
        The JSON lines rank 0 printed (echoed to stdout), or None if a rank failed (its
        exit codes on stderr).
    """
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = [sys.executable, "-m", module, *(argv if argv is not None else sys.argv[1:])]
    procs = [subprocess.Popen(cmd, env={**env, rank_env: str(r)},
                              stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, text=True)
             for r in range(workers)]
    try:
        out, _ = procs[0].communicate(timeout=timeout)
        codes = [procs[0].returncode] + [p.wait(timeout=timeout) for p in procs[1:]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for e in events:
        print(json.dumps(e))
    if any(codes):
        print(f"rank exit codes {codes}", file=sys.stderr)
        return None
    return events


def parse_size(text: str) -> int:
    """A tensor size in elements: ``26214400``, ``100MB`` (float32 bytes, MB = 2**20) or ``64KB``."""
    t = text.strip().upper()
    for suffix, mult in (("KB", 1 << 10), ("MB", 1 << 20), ("GB", 1 << 30)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult) // 4
    return int(t)


def make_tensor(
    n: int, density: float, block_size: int, rng: np.random.Generator, skew: float = 0.0, order_seed: int = 0
) -> np.ndarray:
    """A float32 tensor whose nonzero blocks are placed at random, independently per rank.

    Exactly ``round(density * blocks)`` blocks are nonzero, as in OmniReduce's own
    benchmark. Values are small nonzero integers, so every sum is exact whatever the
    order of addition and results can be compared bit for bit.

    Args:
        n: elements.
        density: fraction of blocks that are nonzero, 0 to 1.
        block_size: elements per block (the last one may be short).
        rng: the rank's generator.
        skew: 0 places the blocks uniformly (OmniReduce's benchmark: the ranks' blocks
            hardly overlap, so the union is about the sum of their counts); above 0, see
            :func:`skewed_blocks` (an embedding's gradient: hot rows on every rank).
        order_seed: with ``skew``, the seed of the blocks' popularity order, which must be
            the same on every rank.
    """
    nb = -(-n // block_size)
    k = min(nb, round(density * nb))
    x = np.empty(nb * block_size, dtype=np.float32)
    # Written, not np.zeros: untouched calloc pages all map the kernel's one zero page,
    # which would make every pass over the zero blocks read the same cached 4 KiB.
    x.fill(0.0)
    blocks = x.reshape(nb, block_size)
    if k >= nb:
        chosen = np.arange(nb)
    elif skew > 0:
        chosen = skewed_blocks(nb, k, skew, rng, order_seed)
    else:
        chosen = rng.choice(nb, size=k, replace=False)
    # int8 draws are 4x cheaper than float ones and every value in [1, 100] stays exact.
    vals = rng.integers(1, 101, size=(k, block_size), dtype=np.int8).astype(np.float32)
    vals *= np.where(rng.random((k, 1)) < 0.5, -1.0, 1.0).astype(np.float32)
    blocks[chosen] = vals
    return x[:n]


def skewed_blocks(nb: int, k: int, skew: float, rng: np.random.Generator, order_seed: int) -> np.ndarray:
    """``k`` distinct blocks of ``nb``, drawn as an embedding's rows are looked up.

    The blocks have a popularity order, a permutation fixed by ``order_seed`` (the same
    on every rank: the hot rows of a table are hot everywhere), and the block of
    popularity rank ``i`` (from 0) is drawn with weight ``(i + 1) ** -skew`` (Zipf's law);
    the ``k`` blocks are a weighted draw without replacement (Efraimidis and Spirakis:
    the ``k`` largest of ``log(u) / weight``), so each rank's draw is its own but the
    ranks share their hot blocks, and the union of their blocks is smaller than the sum
    of their counts (at 1% of 102,400 blocks and skew 1.1: 0.87 of it at 2 ranks, 0.75
    at 4, 0.64 at 8).

    Args:
        nb: blocks in the tensor.
        k: blocks to draw, below ``nb``.
        skew: Zipf exponent, above 0.
        rng: the rank's generator.
        order_seed: seed of the popularity order.
    """
    weight = np.empty(nb)
    weight[np.random.default_rng([order_seed, nb]).permutation(nb)] = np.arange(1, nb + 1, dtype=np.float64) ** -skew
    with np.errstate(divide="ignore"):  # a draw of exactly 0 is a key of -inf: drawn last
        keys = np.log(rng.random(nb)) / weight
    return np.argpartition(keys, nb - k)[nb - k:]


def row_from_event(event: dict[str, Any]) -> dict[str, Any]:
    """Turns a rank 0 result event into a result row with the summary statistics."""
    times = event["times"]
    row = {k: v for k, v in event.items() if k not in ("type", "times")}
    row["median_s"] = statistics.median(times) if times else math.nan
    row["min_s"] = min(times) if times else math.nan
    row["max_s"] = max(times) if times else math.nan
    row["times"] = times
    return row


def _speedups(rows: list[dict[str, Any]]) -> None:
    ref = {
        (r["workers"], r["elements"], r["density"]): r["median_s"] for r in rows if r["system"] == "gloo"
    }
    for r in rows:
        base = ref.get((r["workers"], r["elements"], r["density"]))
        r["speedup_vs_gloo"] = base / r["median_s"] if base and r["median_s"] > 0 else None


def add_predictions(
    rows: list[dict[str, Any]],
    params: Any,
    *,
    block_size: int = 256,
    message_blocks: int | None = None,
    streams: int | None = None,
    shards: int = 1,
    inplace: bool = True,
) -> list[dict[str, Any]]:
    """Attaches the cost model's prediction to every omnireduce and gloo row.

    Sets ``predicted_s`` (omnireduce: :func:`omnireduce.model.sparse_time`; gloo dense:
    :func:`omnireduce.model.ring_time`, gloo's algorithm for large tensors) and
    ``model_error`` = (predicted - measured) / measured. Other rows are left alone.

    Args:
        rows: result rows (see :func:`row_from_event`); changed in place.
        params: an :class:`omnireduce.model.CostParams`.
        block_size: omnireduce's elements per block.
        message_blocks: omnireduce's blocks per message; None: the library's default.
        streams: omnireduce's streams per op; None: the library's default.
        shards: aggregator shards.
        inplace: omnireduce summed into the input's buffer (the benchmark's default; False
            for ``--new-output`` runs).

    Returns:
        ``rows``.
    """
    from omnireduce import config, model

    mb = message_blocks or config.DEFAULT_MESSAGE_BLOCKS
    st = streams or config.DEFAULT_STREAMS
    for r in rows:
        n, w, d = r["elements"], r["workers"], r["density"]
        if r["system"] == "omnireduce":
            pred = model.sparse_time(n, w, params, d, block_size=block_size, message_blocks=mb, streams=st,
                                     shards=shards, inplace=inplace)
        elif r["system"] == "gloo":
            pred = model.ring_time(4.0 * n, w, params)
        else:
            continue
        r["predicted_s"] = pred
        m = r.get("median_s")
        r["model_error"] = (pred - m) / m if m and m > 0 and not math.isnan(m) else None
    return rows


def median_model_error(rows: list[dict[str, Any]], system: str = "omnireduce") -> float:
    """Median of ``|model_error|`` over the rows of ``system`` that have one (NaN if none)."""
    errs = [abs(r["model_error"]) for r in rows if r["system"] == system and r.get("model_error") is not None]
    return statistics.median(errs) if errs else math.nan


def format_table(rows: list[dict[str, Any]]) -> str:
    """One line per (workers, size, density): each system's median time and its speedup over gloo dense.

    Rows that carry ``predicted_s`` (see :func:`add_predictions`) also show the model's
    prediction and its relative error.
    """
    _speedups(rows)
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    predicted = {s for s in systems if any(r["system"] == s and r.get("predicted_s") is not None for r in rows)}
    keys = sorted({(r["workers"], r["elements"], r["density"]) for r in rows}, key=lambda k: (k[0], k[1], -k[2]))
    head = f"{'workers':>7} {'MB':>7} {'density':>7}"
    for s in systems:
        head += f" | {s + ' ms':>16} {'x gloo':>7}"
        if s in predicted:
            head += f" {'model ms':>9} {'error':>7}"
    head += f" | {'sent':>6} {'union':>6} {'ok':>3}"
    lines = [head, "-" * len(head)]
    by_key = {(r["workers"], r["elements"], r["density"], r["system"]): r for r in rows}
    for w, n, d in keys:
        line = f"{w:>7} {n * 4 / 2**20:>7.1f} {d:>7.2f}"
        ok = True
        sent = union = ""
        for s in systems:
            r = by_key.get((w, n, d, s))
            if r is None:
                line += f" | {'-':>16} {'-':>7}" + (f" {'-':>9} {'-':>7}" if s in predicted else "")
                continue
            ok = ok and r.get("ok", True) is not False
            sp = r.get("speedup_vs_gloo")
            line += f" | {r['median_s'] * 1e3:>16.1f} {(f'{sp:.2f}' if sp else '-'):>7}"
            if s in predicted:
                pred, err = r.get("predicted_s"), r.get("model_error")
                line += f" {(f'{pred * 1e3:.1f}' if pred is not None else '-'):>9}"
                line += f" {(f'{err * 100:+.0f}%' if err is not None else '-'):>7}"
            if s.startswith("omnireduce"):
                if r.get("sent_fraction") is not None:
                    sent = f"{r['sent_fraction'] * 100:.1f}%"
                if r.get("union_fraction") is not None:
                    union = f"{r['union_fraction'] * 100:.1f}%"
        line += f" | {sent:>6} {union:>6} {'yes' if ok else 'NO':>3}"
        lines.append(line)
    return "\n".join(lines)


def write_outputs(rows: list[dict[str, Any]], out_dir: str, meta: dict[str, Any], plot: bool = True) -> list[str]:
    """Writes ``results.json``, ``results.csv`` and (with matplotlib) ``results.png`` into ``out_dir``.

    Args:
        rows: result rows (see :func:`row_from_event`).
        out_dir: the output folder; created if missing.
        meta: the run's parameters and machine, stored in the JSON.
        plot: also draw the PNG.

    Returns:
        The paths written.
    """
    os.makedirs(out_dir, exist_ok=True)
    _speedups(rows)
    paths = []
    jpath = os.path.join(out_dir, "results.json")
    with open(jpath + ".tmp", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    os.replace(jpath + ".tmp", jpath)
    paths.append(jpath)
    cpath = os.path.join(out_dir, "results.csv")
    cols = [
        "workers", "elements", "density", "system", "median_s", "min_s", "max_s", "speedup_vs_gloo",
        "ok", "sent_fraction", "union_fraction", "skew", "repeats", "predicted_s", "model_error",
    ]
    with open(cpath, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        wr.writeheader()
        for r in rows:
            wr.writerow({**r, "repeats": len(r.get("times", []))})
    paths.append(cpath)
    if plot and rows:
        ppath = os.path.join(out_dir, "results.png")
        _plot(rows, ppath, meta.get("title", "allreduce"))
        paths.append(ppath)
        if len({r["workers"] for r in rows}) > 1:
            wpath = os.path.join(out_dir, "results-workers.png")
            _plot_workers(rows, wpath, meta.get("title", "allreduce"))
            paths.append(wpath)
    return paths


def _plot_workers(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Median time against the number of workers, every system on one axis per size and density."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["elements"], r["density"]) for r in rows})
    fig, axes = plt.subplots(len(cases), 1, figsize=(6.5, 3.6 * len(cases)), squeeze=False)
    for (n, d), (ax,) in zip(cases, axes, strict=True):
        for s in SYSTEMS:
            pts = sorted((r["workers"], r["median_s"]) for r in rows
                         if r["system"] == s and r["elements"] == n and r["density"] == d)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker="o", label=s)
        ax.set_xticks(sorted({r["workers"] for r in rows}))
        ax.set_xlabel("workers")
        ax.set_ylabel("median time (ms)")
        ax.set_yscale("log")
        ax.set_title(f"{n * 4 / 2**20:.1f} MB, density {d:g}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["workers"], r["elements"]) for r in rows})
    fig, axes = plt.subplots(len(cases), 2, figsize=(11, 3.8 * len(cases)), squeeze=False)
    for (w, n), (ax_t, ax_s) in zip(cases, axes, strict=True):
        for s in SYSTEMS:
            pts = sorted((r["density"], r["median_s"], r.get("speedup_vs_gloo")) for r in rows
                         if r["system"] == s and r["workers"] == w and r["elements"] == n)
            if not pts:
                continue
            ax_t.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker="o", label=s)
            sp = [(p[0], p[2]) for p in pts if p[2]]
            ax_s.plot([p[0] for p in sp], [p[1] for p in sp], marker="o", label=s)
        case = f"{w} workers, {n * 4 / 2**20:.1f} MB"
        for ax, ylabel in ((ax_t, "median time (ms)"), (ax_s, "speedup over gloo dense")):
            ax.set_xscale("log")
            ax.set_xlabel("block density")
            ax.set_ylabel(ylabel)
            ax.set_title(case)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        ax_t.set_yscale("log")
        ax_s.axhline(1.0, color="gray", lw=0.8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
