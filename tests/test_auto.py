"""worker.auto.PathChooser: when it measures, what it rests on, and that a prediction is reused."""

from __future__ import annotations

from typing import Any

import pytest

from omnireduce import model
from worker.auto import PathChooser


def test_predicts_once_per_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float] = []
    real = model.choose_path

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["union"])
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "choose_path", counted)
    chooser = PathChooser(4, ring_available=True, costs=model.CostParams(), probe_every=5,
                          block_size=256, message_blocks=4096, streams=8)
    n = 1 << 20
    # The first op of a key measures (sparse, no basis); so does every probe_every-th.
    # The basis is the probe cycle, counted from calls alone (the same on every rank).
    assert chooser.plan("k", n, 4) == ("sparse", None)
    chooser.record("k", 0.9)
    dense = [chooser.plan("k", n, 4) for _ in range(4)]
    assert dense == [("dense", 0)] * 4 and calls == [0.9]
    assert chooser.plan("k", n, 4) == ("sparse", None)  # the probe
    chooser.record("k", 0.01)
    assert chooser.plan("k", n, 4) == ("sparse", 1) and calls == [0.9, 0.01]
    # Another size of the same key is predicted afresh.
    assert chooser.plan("k", 4 * n, 4)[1] == 1 and calls == [0.9, 0.01, 0.01]


def test_the_basis_follows_calls_not_records() -> None:
    """An op that failed on one rank records nothing there, while the others record its
    density: the ranks' bases must still change at the same op (else one votes alone)."""
    ranks = [PathChooser(2, ring_available=True, costs=model.CostParams(), probe_every=4) for _ in range(2)]
    plans: list[list[Any]] = [[], []]
    for _step in range(10):
        for r, chooser in enumerate(ranks):
            plans[r].append(chooser.plan("k", 1 << 20, 4)[1])
            if r == 0:  # rank 1's ops all failed there: it records nothing
                chooser.record("k", 0.9)
    assert plans[0] == plans[1] == [None, 0, 0, 0, None, 1, 1, 1, None, 2]
    # Rank 1 has no density: it votes sparse (the ranks' MIN), where rank 0 would say dense.
    assert ranks[1].plan("k", 1 << 20, 4) == ("sparse", 2)
    assert ranks[0].plan("k", 1 << 20, 4) == ("dense", 2)
