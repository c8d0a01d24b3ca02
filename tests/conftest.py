"""Fixtures shared by the tests; helpers (functions) are in :mod:`tests.helpers`."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from aggregator import Aggregator
from omnireduce import auth

# Re-exported for test modules that import them from here (tests/test_integers.py, tests/test_rows.py);
# new code imports them from tests.helpers.
from tests.helpers import run_ranks, sparse  # noqa: F401


@pytest.fixture
def aggregator() -> Iterator[Aggregator]:
    """An aggregator on a free loopback port, serving in a thread, with a short op timeout."""
    agg = Aggregator(listen="tcp://127.0.0.1:0", timeout=20.0).start()
    try:
        yield agg
    finally:
        agg.close()


@pytest.fixture
def shards() -> Iterator[list[Aggregator]]:
    """Three aggregators on free loopback ports; a test uses the first N of them."""
    aggs: list[Aggregator] = []
    try:
        for _ in range(3):
            aggs.append(Aggregator(listen="tcp://127.0.0.1:0", timeout=20.0).start())
        yield aggs
    finally:
        for a in aggs:
            a.close()


@pytest.fixture(autouse=True)
def _log_level(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """CURVE key files (``omnireduce-keygen``): the aggregator's pair, two allowed workers, a stranger."""
    root = tmp_path_factory.mktemp("keys")
    assert auth.main([str(root / "server"), "aggregator"]) == 0
    assert auth.main([str(root / "workers"), "w0", "w1"]) == 0
    assert auth.main([str(root / "strangers"), "eve"]) == 0
    return {
        "server_secret": root / "server" / "aggregator.key_secret",
        "server_public": root / "server" / "aggregator.key",
        "allowed": root / "workers",
        "w0": root / "workers" / "w0.key_secret",
        "w1": root / "workers" / "w1.key_secret",
        "eve": root / "strangers" / "eve.key_secret",
    }
