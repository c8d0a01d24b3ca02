"""Property: for random shapes, layouts, world sizes and densities, every worker gets the exact sum."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from omnireduce.dtypes import DType
from tests.helpers import run_allreduce, sparse


@settings(max_examples=150, deadline=None)
@given(
    length=st.integers(0, 3000),
    block_size=st.integers(1, 64),
    message_blocks=st.integers(1, 9),
    streams=st.integers(1, 5),
    world=st.integers(1, 6),
    density=st.one_of(st.just(0.0), st.just(1.0), st.floats(0.0, 1.0)),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_worker_gets_the_float64_sum(length, block_size, message_blocks, streams, world, density, seed) -> None:
    rng = np.random.default_rng(seed)
    # Integer values keep float32 sums exact, so they must equal the float64 sum.
    inputs = [sparse(rng, length, density, block_size, low=-1000, high=1000) for _ in range(world)]
    outs, ops, _ = run_allreduce(
        inputs, DType.FLOAT32, block_size, message_blocks, streams, shuffle=random.Random(seed)
    )
    expected = np.sum(np.stack(inputs).astype(np.float64), axis=0) if world else None
    for out in outs:
        assert out.dtype == np.float32 and out.shape == (length,)
        np.testing.assert_array_equal(out.astype(np.float64), expected)
