"""bench/train_models.py: the training benchmark's models and synthetic data, at a tiny scale.

The sparse- and dense-gradient variants of each model start and stay equal; batches are deterministic
per (seed, rank, step); the loss falls (and does not without learning); sizes match the parameters.
"""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
import torch

from bench import train_models as tm

NAMES = sorted(tm.MODELS)
SCALE = 0.01
# Small batches keep each test within a few seconds on one core.
SMALL_BATCH = {"ctr": 128, "ncf": 256, "lm": 8}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _embedding_ids(model: torch.nn.Module) -> set[int]:
    return {id(p) for m in model.modules() if tm.is_embedding(m) for p in m.parameters(recurse=False)}


def _train(spec: tm.ModelSpec, model: torch.nn.Module, steps: int, batch_size: int) -> list[float]:
    opt = spec.optimizer(model.parameters())
    losses = []
    for step in range(steps):
        loss, _ = spec.loss(model, spec.batch(0, 1, step, batch_size))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", NAMES)
def test_sparse_and_dense_variants_stay_equal(name: str) -> None:
    spec = tm.get(name, scale=SCALE)
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    dense, sparse = spec.build(sparse=False, seed=7), spec.build(sparse=True, seed=7)
    assert torch.equal(torch.rand(3), expected_next), "build() must leave the global RNG as it was"

    initial = {k: v.clone() for k, v in dense.state_dict().items()}
    for (kd, vd), (ks, vs) in zip(dense.state_dict().items(), sparse.state_dict().items(), strict=True):
        assert kd == ks and torch.equal(vd, vs), kd
    assert not torch.equal(spec.build(sparse=False, seed=8).state_dict()[kd], vd), "seed must matter"

    emb = _embedding_ids(dense)
    assert emb, "the model has embedding tables"
    opt_d, opt_s = spec.optimizer(dense.parameters()), spec.optimizer(sparse.parameters())
    for step in range(3):
        batch = spec.batch(0, 1, step, SMALL_BATCH[name])
        for model, opt in ((dense, opt_d), (sparse, opt_s)):
            opt.zero_grad()
            loss, metric = spec.loss(model, batch)
            assert loss.dim() == 0 and math.isfinite(loss.item()) and math.isfinite(metric)
            loss.backward()
            opt.step()
        if step == 0:
            sparse_emb = _embedding_ids(sparse)
            for (n, pd), ps in zip(dense.named_parameters(), sparse.parameters(), strict=True):
                assert pd.grad is not None and ps.grad is not None, n
                assert not pd.grad.is_sparse, n
                assert ps.grad.is_sparse == (id(ps) in sparse_emb), n

    for (n, pd), ps in zip(dense.named_parameters(), sparse.parameters(), strict=True):
        torch.testing.assert_close(ps, pd, msg=lambda m, n=n: f"{n}: {m}")
    moved = [n for n, p in dense.named_parameters() if id(p) in emb and not torch.equal(p, initial[n])]
    assert len(moved) == len([p for p in dense.parameters() if id(p) in emb]), "every table was trained"


@pytest.mark.parametrize("name", NAMES)
def test_batches_are_deterministic_and_differ_by_rank_and_step(name: str) -> None:
    spec = tm.get(name, scale=SCALE)
    a = spec.batch(1, 4, 5, 16)
    b = tm.get(name, scale=SCALE).batch(1, 4, 5, 16)  # a fresh spec: nothing hangs on cached state
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert a[0].shape[0] == 16
    other_seed = tm.get(name, scale=SCALE, seed=1)
    for other in (spec.batch(2, 4, 5, 16), spec.batch(1, 4, 6, 16), other_seed.batch(1, 4, 5, 16)):
        assert not torch.equal(a[0], other[0])
    with pytest.raises(ValueError):
        spec.batch(4, 4, 0, 16)
    with pytest.raises(ValueError):
        spec.batch(0, 1, 0, 0)


def test_spec_pickles_without_its_cache() -> None:
    # Specs travel to worker processes: the cached teacher (tens of MB at scale 1) stays behind.
    spec = tm.get("ctr", scale=SCALE)
    batch = spec.batch(0, 1, 3, 8)
    data = pickle.dumps(spec)
    assert len(data) < 10_000
    copy = pickle.loads(data)
    assert copy == spec
    assert all(torch.equal(x, y) for x, y in zip(batch, copy.batch(0, 1, 3, 8), strict=True))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_falls(name: str, seed: int) -> None:
    # Measured over seeds 0-5 at 150 steps: last/first ratio 0.69-0.83 when learning, 0.985-1.011 at lr 0.
    spec = tm.get(name, scale=SCALE, seed=seed)
    losses = _train(spec, spec.build(sparse=seed == 0, seed=seed), 150, SMALL_BATCH[name])
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    assert last < 0.9 * first, (first, last)


@pytest.mark.parametrize("name", NAMES)
def test_loss_does_not_fall_without_learning(name: str) -> None:
    # The control of test_loss_falls: its margin is not met by batch-to-batch noise alone.
    spec = dataclasses.replace(tm.get(name, scale=SCALE), lr=0.0)
    losses = _train(spec, spec.build(sparse=True), 150, SMALL_BATCH[name])
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    assert last > 0.95 * first, (first, last)


@pytest.mark.parametrize("name", NAMES)
def test_bytes_match_the_parameters(name: str) -> None:
    spec = tm.get(name, scale=SCALE)
    model = spec.build(sparse=True)
    emb = _embedding_ids(model)
    assert spec.embedding_bytes() == sum(p.numel() * p.element_size() for p in model.parameters() if id(p) in emb)
    assert spec.dense_bytes() == sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in emb)
    # scale multiplies the tables, not the dense layers.
    big = tm.get(name, scale=2 * SCALE)
    assert big.dense_bytes() == spec.dense_bytes()
    assert 1.8 < big.embedding_bytes() / spec.embedding_bytes() < 2.2


def test_sizes_at_full_scale() -> None:
    # The sizes the module docstring documents (computed on the meta device: no memory).
    sizes = {n: (tm.get(n).embedding_bytes(), tm.get(n).dense_bytes()) for n in NAMES}
    assert sizes == {"ctr": (132_434_944, 572_420), "ncf": (115_200_000, 107_652), "lm": (102_800_000, 1_712_640)}


def test_get_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="ctr.*lm.*ncf"):
        tm.get("resnet")
    for scale in (0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="scale"):
            tm.get("ctr", scale=scale)
    spec = tm.get("lm", scale=0.5, seed=3)
    assert (spec.name, spec.scale, spec.seed, spec.higher_is_better) == ("lm", 0.5, 3, False)
    assert all(tm.get(n).default_batch > 0 and tm.get(n).lr > 0 and tm.get(n).description for n in NAMES)


def _skew(ids: torch.Tensor, rows: int) -> tuple[int, float]:
    counts = torch.bincount(ids, minlength=rows)
    return int(counts.max()), float(counts.float().median())


def test_ids_are_skewed() -> None:
    n = 8192
    ctr = tm.get("ctr", scale=SCALE)
    ids = ctr.batch(0, 1, 0, n)[0]
    for field in (2, 9, 23):  # three large fields
        top, median = _skew(ids[:, field], ctr.vocab[field])
        assert top > 100 * max(median, 1.0), (field, top, median)
        # Hashed features: the hot rows are scattered, not the first rows of the table.
        hot = torch.bincount(ids[:, field], minlength=ctr.vocab[field]).topk(5).indices
        assert hot.max() > ctr.vocab[field] // 10

    ncf = tm.get("ncf", scale=SCALE)
    users, items, labels = ncf.batch(0, 1, 0, n)
    for x, rows in ((users, ncf.users), (items, ncf.items)):
        top, median = _skew(x, rows)
        assert top > 50 * max(median, 1.0), (top, median)
    assert 0.3 < labels.mean().item() < 0.7

    lm = tm.get("lm", scale=SCALE)
    inputs, targets, negatives = lm.batch(0, 1, 0, n // 20)
    top, median = _skew(inputs.reshape(-1), lm.vocab)
    assert top > 50 * max(median, 1.0), (top, median)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert negatives.shape == (lm.negatives,) and int(negatives.max()) < lm.vocab
