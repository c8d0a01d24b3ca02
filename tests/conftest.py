from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from aggregator import Aggregator


@pytest.fixture
def aggregator() -> Iterator[Aggregator]:
    """An aggregator on a free loopback port, serving in a thread, with a short op timeout."""
    agg = Aggregator(listen="tcp://127.0.0.1:0", timeout=20.0).start()
    try:
        yield agg
    finally:
        agg.close()


@pytest.fixture(autouse=True)
def _log_level(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)


def sparse(rng: np.random.Generator, n: int, density: float, block: int = 256, dtype=np.float32) -> np.ndarray:
    """Integer-valued random blocks (so sums are exact) with a ``density`` fraction of blocks nonzero."""
    nb = -(-n // block) if n else 0
    x = np.zeros(nb * block, dtype=dtype)
    keep = rng.random(nb) < density
    x.reshape(nb, block)[keep] = rng.integers(-50, 51, size=(int(keep.sum()), block)).astype(dtype)
    return x[:n]


def run_ranks(world: int, fn: Callable[[int], Any], timeout: float = 60) -> list[Any]:
    """Runs fn(rank) on one thread per rank; returns results, re-raising the first error."""
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "rank thread hung"
    if errors:
        raise errors[0]
    return results
