"""Throughput of block detection + compaction (mask, then gather of the nonzero blocks).

Backends: NumPy (``blocks.block_mask_numpy`` + ``np.flatnonzero`` + ``blocks.gather``),
the Numba CPU kernels (mask parallel, or serial as ``blocks.block_mask`` uses it; the
compaction is the parallel one in both), torch on the GPU (``ne(0).any(1)``, ``nonzero``, ``index_select``),
and the Numba CUDA kernels; the GPU ones only where a GPU is present. Figures are
GB/s of input read (tensor bytes / time, GB = 1e9 bytes), median (and best) of
``--repeat`` timed runs after one warm-up. Reference lines: a plain copy of the tensor on the
same device (GB/s of bytes read), and for a GPU its theoretical memory bandwidth
from the device attributes.

    .venv/bin/python -m bench.kernels --max-mb 256
    .venv/bin/python -m bench.kernels --backends numba-cuda,torch-cuda --min-mb 64 --max-mb 1024 --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.common import make_tensor
from omnireduce import blocks, kernels
from omnireduce.layout import Layout

logger = logging.getLogger(__name__)

__all__ = ["BACKENDS", "main", "run"]

BACKENDS = ("numpy", "numba-cpu", "numba-cpu-serial", "torch-cuda", "numba-cuda")
_CPU = ("numpy", "numba-cpu", "numba-cpu-serial")
_MB = 1 << 20


def _time(fn: Callable[[], Any], repeat: int, sync: Callable[[], None]) -> tuple[float, float]:
    """(median, min) seconds of ``repeat`` runs after one warm-up."""
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def _cpu_cases(x: np.ndarray, bs: int, backend: str) -> dict[str, Callable[[], Any]]:
    layout = Layout(len(x), bs, 1, 1)
    if backend == "numpy":
        def mask_fn() -> np.ndarray:
            return blocks.block_mask_numpy(x, bs)

        mask = mask_fn()

        def compact() -> Any:
            ids = np.flatnonzero(mask)
            return ids, blocks.gather(x, ids, layout)

        def both() -> Any:
            m = blocks.block_mask_numpy(x, bs)
            ids = np.flatnonzero(m)
            return ids, blocks.gather(x, ids, layout)

        return {"mask": mask_fn, "compact": compact, "mask+compact": both, "copy": x.copy}
    par = backend == "numba-cpu"
    mask = kernels.block_mask_cpu(x, bs, parallel=par)
    return {
        "mask": lambda: kernels.block_mask_cpu(x, bs, parallel=par),
        "compact": lambda: kernels.compact_cpu(x, mask, bs),
        "mask+compact": lambda: kernels.compact_cpu(x, kernels.block_mask_cpu(x, bs, parallel=par), bs),
    }


def _gpu_cases(x: np.ndarray, bs: int, backend: str) -> tuple[dict[str, Callable[[], Any]], Callable[[], None]]:
    import torch

    xt = torch.from_numpy(x).cuda()
    sync = torch.cuda.synchronize
    nb = len(x) // bs  # sizes are whole blocks here
    if backend == "torch-cuda":
        rows = xt.view(nb, bs)

        def compact_t(m: Any) -> Any:
            ids = m.nonzero().squeeze(1)
            return ids, rows.index_select(0, ids)

        mask = rows.ne(0).any(1)
        return {
            "mask": lambda: rows.ne(0).any(1),
            "compact": lambda: compact_t(mask),
            "mask+compact": lambda: compact_t(rows.ne(0).any(1)),
            "copy": xt.clone,
        }, sync
    from omnireduce.kernels import cuda as kc

    mask = kc.cuda_block_mask(xt, bs)
    sync()
    return {
        "mask": lambda: kc.cuda_block_mask(xt, bs),
        "compact": lambda: kc.cuda_compact(xt, mask, bs),
        "mask+compact": lambda: kc.cuda_compact(xt, kc.cuda_block_mask(xt, bs), bs),
    }, sync


def _gpu_info() -> dict[str, Any]:
    from numba import cuda

    dev = cuda.get_current_device()
    info: dict[str, Any] = {"name": dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)}
    try:
        # Double data rate: two transfers per memory clock (kHz) over the bus (bits).
        info["peak_GBps"] = 2 * dev.MEMORY_CLOCK_RATE * 1e3 * dev.GLOBAL_MEMORY_BUS_WIDTH / 8 / 1e9
    except (AttributeError, TypeError) as e:  # attribute names vary between numba-cuda versions
        logger.warning("memory bandwidth attributes unavailable: %s", e)
    return info


def _available(backend: str) -> str | None:
    if backend in ("numpy",):
        return None
    if backend in ("numba-cpu", "numba-cpu-serial"):
        return None if kernels.HAVE_NUMBA else "numba is not installed"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if backend == "numba-cuda":
        try:
            from numba import cuda
        except ImportError as e:
            return f"numba.cuda unavailable: {e}"
        if not cuda.is_available():
            return "numba.cuda.is_available() is False"
    return None


def run(
    sizes_mb: list[int], backends: list[str], block_size: int, density: float, repeat: int, seed: int
) -> list[dict[str, Any]]:
    """Times every backend on every size; returns one row per (size, backend, case)."""
    rows: list[dict[str, Any]] = []
    rng = np.random.default_rng(seed)
    for mb in sizes_mb:
        n = mb * _MB // 4
        x = make_tensor(n, density, block_size, rng)
        for backend in backends:
            if backend in _CPU:
                cases, sync = _cpu_cases(x, block_size, backend), (lambda: None)
            else:
                cases, sync = _gpu_cases(x, block_size, backend)
            for case, fn in cases.items():
                t, best = _time(fn, repeat, sync)
                rows.append({
                    "size_MB": mb, "backend": backend, "case": case, "seconds": t, "min_seconds": best,
                    "GBps": x.nbytes / t / 1e9, "best_GBps": x.nbytes / best / 1e9,
                    "block_size": block_size, "density": density,
                })
                print(
                    f"{mb:>6} MB  {backend:<16} {case:<13} {t * 1e3:9.3f} ms  {x.nbytes / t / 1e9:8.2f} GB/s"
                    f"  (best {x.nbytes / best / 1e9:8.2f} GB/s)",
                    flush=True,
                )
            if backend not in _CPU:
                import torch

                torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-mb", type=int, default=1, help="smallest tensor, MB of float32 (default 1)")
    p.add_argument("--max-mb", type=int, default=1024, help="largest tensor, MB of float32 (default 1024)")
    p.add_argument("--sizes", type=str, default="", help="explicit comma-separated sizes in MB (overrides min/max)")
    p.add_argument("--backends", type=str, default=",".join(BACKENDS), help=f"comma-separated subset of {BACKENDS}")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--density", type=float, default=0.01, help="fraction of nonzero blocks (default 0.01)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=str, default="", help="also write the rows to this file")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.sizes:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    else:
        sizes = []
        mb = args.min_mb
        while mb <= args.max_mb:
            sizes.append(mb)
            mb *= 4
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in wanted:
        if b not in BACKENDS:
            p.error(f"unknown backend {b!r}; choose from {BACKENDS}")
    backends = []
    for b in wanted:
        why = _available(b)
        if why:
            print(f"skipping {b}: {why}", flush=True)
        else:
            backends.append(b)
    import numba

    print(f"numpy {np.__version__}, numba {numba.__version__}, numba threads {numba.get_num_threads()}, "
          f"block_size {args.block_size}, density {args.density}", flush=True)
    gpu = None
    if any(b in ("torch-cuda", "numba-cuda") for b in backends):
        gpu = _gpu_info()
        print(f"GPU: {gpu}", flush=True)
    rows = run(sizes, backends, args.block_size, args.density, args.repeat, args.seed)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
