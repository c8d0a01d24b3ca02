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
    assert chooser.plan("k", n, 4) == ("sparse", None)
    chooser.record("k", 0.9)
    dense = [chooser.plan("k", n, 4) for _ in range(4)]
    assert dense == [("dense", 1)] * 4 and calls == [0.9]
    assert chooser.plan("k", n, 4) == ("sparse", None)  # the probe
    chooser.record("k", 0.01)
    assert chooser.plan("k", n, 4) == ("sparse", 2) and calls == [0.9, 0.01]
    # Another size of the same key is predicted afresh.
    assert chooser.plan("k", 4 * n, 4)[1] == 2 and calls == [0.9, 0.01, 0.01]
