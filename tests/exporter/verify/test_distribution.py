"""L1: the distribution measure ``check --against`` judges quantized packages by
(``exporter.verify.distribution``), on distributions whose KL, top-1 and perplexity are known by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from exporter.precisions import DistributionBounds
from exporter.verify.distribution import DistributionTotals

pytestmark = [pytest.mark.l1, pytest.mark.unit]

BOUNDS = DistributionBounds(mean_kl=0.1, top1=0.5, perplexity_ratio=1.2)


def _logits(probabilities) -> np.ndarray:
    return np.log(np.array(probabilities, dtype=np.float64)) + 7.0  # logits: any shift


def test_pooled_positions_give_the_means_of_all_of_them():
    reference = _logits([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1]])
    package = _logits([[0.2, 0.7, 0.1], [0.1, 0.8, 0.1]])
    totals = DistributionTotals()
    totals.add(reference[:1], package[:1], np.array([0]))
    totals.add(reference[1:], package[1:], np.array([1]))
    kl = 0.7 * math.log(0.7 / 0.2) + 0.2 * math.log(0.2 / 0.7)
    assert totals.positions == 2 and totals.mean_kl == pytest.approx(kl / 2)
    assert totals.top1_share == 0.5
    assert totals.perplexity_ratio == pytest.approx(math.exp((math.log(0.7) - math.log(0.2)) / 2))
    assert totals.perplexity == pytest.approx(math.exp(-(math.log(0.2) + math.log(0.8)) / 2))


def test_a_pick_within_the_near_tie_bound_agrees():
    reference = np.array([[2.0, 1.9, -5.0], [3.0, 0.0, 0.0]])
    package = np.array([[1.0, 2.0, -5.0], [0.0, 3.0, 0.0]])  # picks token 1 at both
    totals = DistributionTotals()
    totals.add(reference, package, near_tie=0.5)
    assert totals.top1_share == 0.0
    assert totals.top1_near_tie_share == 0.5  # 0.1 below the best agrees, 3.0 below does not


def test_generated_steps_add_to_kl_and_top1_but_not_to_perplexity():
    reference = _logits([[0.5, 0.5], [0.9, 0.1]])
    totals = DistributionTotals()
    totals.add(reference[:1], reference[:1], np.array([1]))
    totals.add(reference[1:], _logits([[0.1, 0.9]]))
    assert totals.positions == 2 and totals.scored == 1
    assert totals.perplexity_ratio == pytest.approx(1.0)


def test_bounds_pass_a_close_package_and_name_each_failure():
    reference = _logits([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1]])
    close, far = DistributionTotals(), DistributionTotals()
    close.add(reference, _logits([[0.65, 0.25, 0.1], [0.1, 0.75, 0.15]]), np.array([0, 1]))
    far.add(reference, _logits([[0.05, 0.05, 0.9], [0.9, 0.05, 0.05]]), np.array([0, 1]))
    assert BOUNDS.failures(close) == []
    failures = BOUNDS.failures(far)
    assert [f.split()[0] for f in failures] == ["mean", "top-1", "perplexity"]


def test_non_finite_logits_are_refused_and_fail_every_bound():
    """A NaN compares false with any bound, and an all-NaN row's argmax (0) would agree as top-1:
    ``add`` refuses non-finite logits, and totals that are NaN fail all three bounds."""
    totals = DistributionTotals()
    with pytest.raises(ValueError, match="not finite"):
        totals.add(np.array([[1.0, 0.0]]), np.array([[np.nan, np.nan]]), np.array([0]))
    with pytest.raises(ValueError, match="not finite"):
        totals.add(np.array([[np.inf, 0.0]]), np.array([[1.0, 0.0]]))
    poisoned = DistributionTotals(positions=1, kl=float("nan"), top1=0, top1_near_tie=0, scored=1,
                                  nll=float("nan"), reference_nll=0.0)
    assert len(BOUNDS.failures(poisoned)) == 3
