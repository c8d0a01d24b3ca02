"""A worker process for the integration tests: reduces seeded sparse tensors and prints a JSON report."""

from __future__ import annotations

import argparse
import json

import numpy as np

from omnireduce.blocks import block_mask_numpy
from worker import Worker
from worker.demo import sparse_input


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--elements", type=int, required=True)
    p.add_argument("--density", type=float, required=True)
    p.add_argument("--ops", type=int, default=3)
    args = p.parse_args()
    report = []
    with Worker(args.address, rank=args.rank, world_size=args.world, job=args.job, timeout=60) as w:
        for op in range(args.ops):
            # Ops differ (seeded by op) so a mix-up between ops would show.
            x = sparse_input(args.rank + 100 * op, args.elements, args.density)
            expected = sum(sparse_input(r + 100 * op, args.elements, args.density) for r in range(args.world))
            y = w.allreduce(x)
            report.append({"exact": bool(np.array_equal(y, expected)), **w.stats.last.as_dict(),
                           "nonzero_blocks": int(block_mask_numpy(x, 256).sum())})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
