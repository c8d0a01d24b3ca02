"""The cost models against hand-computed cases, and calibration's fit and smoke run."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bench.calibrate import fit_alpha_beta
from bench.calibrate import main as calibrate_main
from bench.common import add_predictions, format_table, median_model_error
from omnireduce import model
from omnireduce.model import CostParams

S = 100e6
ALPHA, BETA, GAMMA = 1e-5, 1e-9, 2e-10


def _p(full_duplex: bool = True, gamma: float = 0.0, **kw: float) -> CostParams:
    return CostParams(alpha=ALPHA, beta=BETA, add_s_per_byte=gamma, full_duplex=full_duplex, **kw)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_matches_hockney(n: int) -> None:
    want = 2 * (n - 1) / n * S * BETA + 2 * (n - 1) * ALPHA
    assert model.ring_time(S, n, _p()) == pytest.approx(want)
    # Half duplex: each step's send and receive add; the reduction adds (n-1)/n of the tensor.
    half = 2 * (n - 1) * (ALPHA + 2 * S / n * BETA) + (n - 1) / n * S * GAMMA
    assert model.ring_time(S, n, _p(False, GAMMA)) == pytest.approx(half)
    assert model.ring_time(S, 1, _p()) == 0.0


def test_recursive_doubling() -> None:
    assert model.recursive_doubling_time(S, 4, _p(gamma=GAMMA)) == pytest.approx(2 * (ALPHA + S * BETA + S * GAMMA))
    # 6 ranks: the 4-rank exchange plus two whole-tensor messages and one sum for the extra ranks.
    want = 2 * (ALPHA + S * BETA + S * GAMMA) + 2 * (ALPHA + S * BETA) + S * GAMMA
    assert model.recursive_doubling_time(S, 6, _p(gamma=GAMMA)) == pytest.approx(want)


def test_rabenseifner() -> None:
    want = 2 * (2 * ALPHA + 0.75 * S * BETA) + 0.75 * S * GAMMA
    assert model.rabenseifner_time(S, 4, _p(gamma=GAMMA)) == pytest.approx(want)
    # Large tensors: Rabenseifner moves 2(n-1)/n of the tensor, recursive doubling log2(n) times it.
    assert model.rabenseifner_time(S, 8, _p()) < model.recursive_doubling_time(S, 8, _p())


def test_parameter_server() -> None:
    n = 4
    assert model.parameter_server_time(S, n, _p(gamma=GAMMA)) == pytest.approx(2 * ALPHA + n * S * BETA + n * S * GAMMA)
    assert model.parameter_server_time(S, n, _p(False)) == pytest.approx(2 * ALPHA + 2 * n * S * BETA)
    assert model.parameter_server_time(S, n, _p(False), shards=4) == pytest.approx(2 * ALPHA + 2 * S * BETA)


def test_union_density() -> None:
    assert model.union_density(0.1, 2) == pytest.approx(0.19)
    assert model.union_density([0.5, 0.5, 0.0]) == pytest.approx(0.75)
    assert model.union_density(1.0, 3) == 1.0
    with pytest.raises(ValueError):
        model.union_density(0.1)


def test_expected_max_rounds_edges() -> None:
    assert model.expected_max_rounds(1000, 100, 0.0) == 0.0
    assert model.expected_max_rounds(1000, 100, 1.0) == 10.0
    # 1050 blocks over 100 columns: 50 columns of 11 rows, so a stream of 10 holds some (on average 5).
    assert model.expected_max_rounds(1050, 100, 1.0) == 11.0
    assert model.expected_max_rounds(1050, 100, 1.0, group=10) == 11.0
    # 1005 blocks: 5 long columns, on average half of one per stream of 10: the short rows count.
    assert model.expected_max_rounds(1005, 100, 1.0, group=10) == 10.0


@pytest.mark.parametrize("union", [0.01, 0.05, 0.2, 0.6])
def test_expected_max_rounds_against_monte_carlo(union: float) -> None:
    nb, cols, group = 102_400, 1024, 256
    rng = np.random.default_rng(7)
    trials = 200
    rows = nb // cols
    counts = (rng.random((trials, rows, cols)) < union).sum(axis=1)  # per trial, per column
    mc_all = counts.max(axis=1).mean()
    mc_group = counts[:, :group].max(axis=1).mean()
    assert model.expected_max_rounds(nb, cols, union) == pytest.approx(mc_all, rel=0.05, abs=0.1)
    assert model.expected_max_rounds(nb, cols, union, group) == pytest.approx(mc_group, rel=0.05, abs=0.1)


def test_sparse_hand_worked_small_case() -> None:
    # 1024 float32 in blocks of 256: 4 blocks; 2 blocks per message, 1 stream: 2 columns of 2 rows.
    p = _p(False, GAMMA, per_message_s=1e-5, cores=1)
    e = model.sparse_estimate(1024, 2, p, 1.0, block_size=256, message_blocks=2, streams=1)
    assert e.union == 1.0 and e.critical_rounds == 3.0 and e.stream_rounds == 3.0
    assert e.messages == 2 * 2 * 3
    # Each worker: 4 KiB of blocks, an 8-byte pointer per block, and START's pointer per column.
    assert e.bytes_in == pytest.approx(2 * (4096 + 4 * 8 + 2 * 8))
    # Each worker gets the 4 KiB of sums and one instruction pointer per block of the union.
    assert e.bytes_out == pytest.approx(2 * (4096 + 4 * 8))
    assert e.mask == pytest.approx(4096 * p.mask_dense_s_per_byte)
    assert e.transfer == pytest.approx((e.bytes_in + e.bytes_out) * BETA)
    assert e.total >= e.mask + e.result_pages + e.transfer


def test_an_op_of_one_row_is_one_round_trip() -> None:
    # 4 blocks in 4 columns (2 streams of 2): eager, its START carries the blocks. At half
    # density a worker's 2 blocks fit in one START (one stream's worth), answered by one RESULT.
    p = _p(False, GAMMA, per_message_s=1e-5, cores=1)
    e = model.sparse_estimate(1024, 2, p, 0.5, block_size=256, message_blocks=2, streams=2)
    assert e.critical_rounds == 1.0 and e.stream_rounds == 2.0 and e.messages == 2 * 2 * 1
    # Dense, its 4 blocks take a START per stream.
    assert model.sparse_estimate(1024, 2, p, 1.0, block_size=256, message_blocks=2, streams=2).messages == 2 * 2 * 2
    assert e.rounds == pytest.approx(2.0 * (p.alpha + p.per_message_s))
    # One row fewer column: two rows, a round 0 and up to two data rounds.
    two = model.sparse_estimate(1024, 2, p, 0.5, block_size=256, message_blocks=1, streams=2)
    assert two.critical_rounds > 2.0


def test_sparse_density_zero_and_one() -> None:
    p = CostParams()
    n = 26_214_400
    zero = model.sparse_estimate(n, 2, p, 0.0)
    one = model.sparse_estimate(n, 2, p, 1.0)
    # Density 0: only round 0 (no data), every zero block read by the mask.
    assert zero.critical_rounds == 1.0 and zero.union == 0.0
    assert zero.bytes_out == 0.0  # only finite pointers travel: nothing at all
    assert zero.mask == pytest.approx(4 * n * p.mask_s_per_byte)
    # Density 1: 102,400 blocks in 1024 columns: 100 data rounds plus round 0.
    assert one.critical_rounds == 101.0 and one.union == 1.0
    assert one.bytes_in > 2 * 4 * n and one.bytes_out > 2 * 4 * n
    assert zero.total < model.sparse_time(n, 2, p, 0.01) < model.sparse_time(n, 2, p, 0.1) < one.total
    # Shards divide the aggregator's traffic.
    assert model.sparse_estimate(n, 2, p, 1.0, shards=4).transfer == pytest.approx(one.transfer / 4)


def test_cost_params_json_round_trip(tmp_path) -> None:
    p = CostParams(alpha=3e-5, beta=2e-10, cores=8, full_duplex=True, meta={"host": "x"})
    q = CostParams.from_json(p.to_json())
    assert q == p
    path = p.save(str(tmp_path / "sub" / "costs.json"))
    assert CostParams.load(path) == p
    doc = json.loads(p.to_json())
    doc["future_field"] = 1
    assert CostParams.from_json(json.dumps(doc)) == p


def test_choose_path() -> None:
    p = CostParams()
    path, sparse, dense = model.choose_path(26_214_400, 1.0, 2, p, ring_available=True)
    assert path == "dense" and dense < sparse
    slow = CostParams(beta=1e-8)  # 100 MB/s
    path, sparse, dense = model.choose_path(26_214_400, 0.01, 4, slow, ring_available=False)
    assert path == "sparse" and sparse < dense


def test_fit_alpha_beta_recovers_known_line() -> None:
    sizes = np.array([1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22], dtype=float)
    alpha, beta = 2e-5, 3e-10
    noise = 1 + 0.01 * np.random.default_rng(0).standard_normal(len(sizes))
    a, b = fit_alpha_beta(sizes, (alpha + beta * sizes) * noise)
    assert a == pytest.approx(alpha, rel=0.1) and b == pytest.approx(beta, rel=0.05)
    # A line through the origin or below it: clipped to positive values, never negative.
    a, b = fit_alpha_beta(sizes, beta * sizes - 1e-6)
    assert a > 0 and b > 0


def test_add_predictions_and_table() -> None:
    rows = [
        {"workers": 2, "elements": 1 << 20, "density": 0.1, "system": s, "median_s": 0.01, "ok": True}
        for s in ("gloo", "gloo-sparse", "omnireduce")
    ]
    add_predictions(rows, CostParams())
    assert "predicted_s" not in rows[1]
    for r in (rows[0], rows[2]):
        assert r["predicted_s"] > 0 and r["model_error"] == pytest.approx(r["predicted_s"] / 0.01 - 1)
    assert "model ms" in format_table(rows)
    assert median_model_error(rows) == pytest.approx(abs(rows[2]["model_error"]))
    assert math.isnan(median_model_error(rows, "nothing"))


def test_calibrate_quick_writes_valid_json(tmp_path, capsys, monkeypatch) -> None:
    # Without --out, where auto mode reads first: $OMNIREDUCE_COSTS (it wrote ~/.cache's file).
    # OMNIREDUCE_MODE must not make it time another path than the sparse one.
    out = tmp_path / "costs.json"
    monkeypatch.setenv("OMNIREDUCE_COSTS", str(out))
    monkeypatch.setenv("OMNIREDUCE_MODE", "dense")
    assert calibrate_main(["--quick"]) == 0
    p = CostParams.load(str(out))
    for name in ("alpha", "beta", "mask_s_per_byte", "mask_dense_s_per_byte", "copy_s_per_byte",
                 "zero_s_per_byte", "add_s_per_byte", "per_message_s", "page_fault_s"):
        v = getattr(p, name)
        assert math.isfinite(v) and v > 0, name
    assert "wrote" in capsys.readouterr().out


def test_in_place_results_and_the_mask_kernels_dense_probe() -> None:
    p = CostParams()
    n = 26_214_400
    fresh = model.sparse_estimate(n, 2, p, 0.01)
    inplace = model.sparse_estimate(n, 2, p, 0.01, inplace=True)
    assert inplace.result_pages == 0 < fresh.result_pages
    assert inplace.total == pytest.approx(fresh.total - fresh.result_pages)
    # The kernel streams every word below the dense probe's threshold, stops early above it;
    # the slowest worker's mask counts.
    for d, per_byte in [(0.5, p.mask_s_per_byte), (0.9, p.mask_dense_s_per_byte)]:
        assert model.sparse_estimate(n, 2, p, d).mask == pytest.approx(4 * n * per_byte)
    assert model.sparse_estimate(n, 2, p, [0.9, 0.1]).mask == pytest.approx(4 * n * p.mask_s_per_byte)


@pytest.mark.parametrize("text, why", [
    ("[]", "JSON object"),
    ("null", "JSON object"),
    ('{"per_message_s": "4e-5"}', "per_message_s"),
    ('{"alpha": NaN}', "alpha"),
    ('{"beta": -1}', "beta"),
    ('{"full_duplex": "no"}', "full_duplex"),
    ('{"cores": 0}', "cores"),
])
def test_a_cost_file_of_the_wrong_shape_is_refused_and_auto_mode_takes_the_defaults(tmp_path, text: str,
                                                                                      why: str) -> None:
    # A list made connect() raise AttributeError; a string value failed every auto op of every
    # rank with a TypeError naming no file; NaN sent every op dense; "no" read as true.
    from worker.auto import load_costs

    with pytest.raises(ValueError, match=why):
        model.CostParams.from_json(text)
    path = tmp_path / "costs.json"
    path.write_text(text)
    assert load_costs(str(path)) == model.CostParams()


def test_cost_files_written_at_once_are_each_whole(tmp_path) -> None:
    import threading

    path = str(tmp_path / "costs.json")
    errors: list[BaseException] = []

    def write(n: int) -> None:
        try:
            for i in range(50):
                model.CostParams(alpha=n + i * 1e-6).save(path)
        except BaseException as e:  # noqa: BLE001 - the test checks there was none
            errors.append(e)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    reads = 0
    while any(t.is_alive() for t in threads):
        try:
            model.CostParams.load(path)  # whole, or not there yet
            reads += 1
        except FileNotFoundError:
            pass
    for t in threads:
        t.join()
    assert errors == [] and model.CostParams.load(path).alpha >= 0
    assert [p.name for p in tmp_path.iterdir()] == ["costs.json"]  # no temporary file left
