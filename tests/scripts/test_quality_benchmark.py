"""L1: the quality benchmark's metrics (scripts/quality_benchmark.py) on distributions whose
perplexity, top-1 agreement and KL are known by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.l1, pytest.mark.unit]

_SPEC = importlib.util.spec_from_file_location(
    "quality_benchmark", Path(__file__).resolve().parents[2] / "scripts" / "quality_benchmark.py")
quality_benchmark = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(quality_benchmark)


def _log(probabilities) -> np.ndarray:
    return np.log(np.array(probabilities, dtype=np.float64))


def test_a_package_that_is_the_reference_scores_as_it():
    reference = [_log([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [1 / 3, 1 / 3, 1 / 3]])]
    result = quality_benchmark.quality(reference, reference, [[0, 1, 1]])
    # Positions 0 and 1 predict tokens 1 and 1 (the last predicts past the window): p = 0.25, 0.8.
    assert result["positions"] == 2 and result["top1"] == 1.0 and result["kl"] == pytest.approx(0.0, abs=1e-12)
    assert result["perplexity"] == pytest.approx(np.exp(-(np.log(0.25) + np.log(0.8)) / 2))
    assert result["perplexity"] == result["reference_perplexity"]


def test_a_package_that_parts_from_the_reference_pays_for_it():
    reference = [_log([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])]
    package = [_log([[0.2, 0.7, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])]
    result = quality_benchmark.quality(reference, package, [[0, 0, 1]])
    assert result["top1"] == 0.5  # position 0's best moved from token 0 to token 1
    kl = 0.7 * np.log(0.7 / 0.2) + 0.2 * np.log(0.2 / 0.7)
    assert result["kl"] == pytest.approx(kl / 2)
    assert result["perplexity"] == pytest.approx(np.exp(-(np.log(0.2) + np.log(0.8)) / 2))
    assert result["reference_perplexity"] == pytest.approx(np.exp(-(np.log(0.7) + np.log(0.8)) / 2))
