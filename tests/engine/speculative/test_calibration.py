"""Calibration: per-position temperatures fitted on prefix survival lower its ECE; AUROC; JSON round trip."""

from __future__ import annotations

import numpy as np
import pytest

from engine.speculative.calibration import Calibration, Record, auroc, ece, fit, report, temper

POSITIONS = 5


def overconfident_records(n: int, sharpen: float, seed: int) -> list[Record]:
    """Each draft k is accepted with a true probability p_k; the raw confidence reports p_k sharpened in
    logit space (× `sharpen`), a known miscalibration that a temperature of `sharpen` undoes."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(n):
        true = rng.beta(4, 2, POSITIONS)  # (5,) per-draft acceptance probabilities, given the ones before
        raw = temper(true, 1 / sharpen)  # σ(sharpen · logit p)
        accepted = 0
        while accepted < POSITIONS and rng.random() < true[accepted]:
            accepted += 1
        records.append(Record(tuple(raw.tolist()), accepted))
    return records


def test_fitting_lowers_the_ece_of_every_position() -> None:
    train = overconfident_records(4000, sharpen=3.0, seed=0)
    held_out = overconfident_records(4000, sharpen=3.0, seed=1)
    calibration = fit(train, POSITIONS)
    before = report(Calibration(()), held_out, POSITIONS)
    after = report(calibration, held_out, POSITIONS)
    for raw_row, fitted_row in zip(before, after):
        assert fitted_row.samples == raw_row.samples == 4000
        assert fitted_row.ece < raw_row.ece / 2, (raw_row, fitted_row)
        assert fitted_row.ece < 0.05
    # the first position's miscalibration is a pure temperature: the fit finds about it
    assert calibration.temperatures[0] == pytest.approx(3.0, rel=0.25)


def test_well_calibrated_confidences_keep_a_temperature_near_one() -> None:
    calibration = fit(overconfident_records(4000, sharpen=1.0, seed=2), POSITIONS)
    assert calibration.temperatures[0] == pytest.approx(1.0, rel=0.25)


def test_survivals_are_cumulative_products_of_the_tempered_confidences() -> None:
    calibration = Calibration((2.0, 0.5))
    raw = [0.9, 0.6, 0.7]
    expected = np.cumprod([temper(np.array(0.9), 2.0), temper(np.array(0.6), 0.5), temper(np.array(0.7), 0.5)])
    assert calibration.survivals(raw) == pytest.approx(expected.tolist())
    assert all(a >= b for a, b in zip(calibration.survivals(raw), calibration.survivals(raw)[1:]))
    assert Calibration(()).survivals(raw) == pytest.approx(np.cumprod(raw).tolist())


def test_auroc_by_hand() -> None:
    # positives 0.35, 0.8; negatives 0.1, 0.4: of the four pairs 0.35 > 0.1, 0.8 > 0.1, 0.8 > 0.4 -> 3/4
    assert auroc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == pytest.approx(0.75)
    assert auroc(np.array([0.5, 0.5]), np.array([1, 0])) == pytest.approx(0.5)  # a tie counts half
    assert auroc(np.array([0.2, 0.9]), np.array([0, 1])) == 1.0
    assert np.isnan(auroc(np.array([0.2, 0.9]), np.array([1, 1])))


def test_auroc_equals_the_share_of_correctly_ordered_pairs() -> None:
    rng = np.random.default_rng(4)
    score = rng.integers(0, 10, 200) / 10  # many ties
    label = rng.random(200) < 0.4
    pos, neg = score[label], score[~label]
    pairs = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    assert auroc(score, label) == pytest.approx(pairs / (pos.size * neg.size))


def test_ece_by_hand() -> None:
    # bin [0.2, 0.267): confidences 0.2, 0.25, labels 0, 1 -> |0.225 - 0.5|; bin of 0.9: |0.9 - 1|
    assert ece(np.array([0.2, 0.25, 0.9]), np.array([0, 1, 1])) == pytest.approx((2 * 0.275 + 0.1) / 3)
    assert ece(np.array([1.0, 1.0]), np.array([1, 1])) == 0.0


def test_json_round_trip(tmp_path) -> None:
    calibration = fit(overconfident_records(500, sharpen=2.0, seed=3), POSITIONS)
    assert Calibration.from_json(calibration.to_json()) == calibration
    calibration.save(tmp_path / "profiles" / "calibration.json")
    assert Calibration.load(tmp_path / "profiles" / "calibration.json") == calibration
    with pytest.raises(ValueError):
        Calibration.from_json('{"format": 999, "temperatures": [1.0]}')
    with pytest.raises(ValueError):
        Calibration.from_json('{"format": 1, "temperatures": [-1.0]}')


def test_positions_never_verified_keep_the_raw_confidence() -> None:
    calibration = fit([Record((0.9,), 1), Record((0.8,), 0)], 3)
    assert calibration.temperatures[1:] == (1.0, 1.0)
    with pytest.raises(ValueError):
        Record((0.5,), 2)


def test_a_calibrated_but_useless_constant_loses_to_an_informative_fit() -> None:
    # raw 0.8 is accepted 3 times in 4, raw 0.2 once in 4: T = logit(0.8) / logit(0.75) ≈ 1.26 calibrates both
    # exactly (ECE 0), and so does a huge T that maps both to about 0.5 (one bin, mean 0.5): the Brier
    # score tells them apart, and the informative one is kept
    records = [Record((0.8,), int(i % 4 != 0)) for i in range(40)] + [Record((0.2,), int(i % 4 == 0))
                                                                       for i in range(40)]
    calibration = fit(records, 1)
    assert calibration.temperatures[0] == pytest.approx(np.log(4) / np.log(3), rel=0.05)
    assert calibration.calibrated([0.8])[0] == pytest.approx(0.75, abs=0.01)
    assert calibration.calibrated([0.2])[0] == pytest.approx(0.25, abs=0.01)
