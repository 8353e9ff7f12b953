"""How far a package's next-token distributions are from transformers' on the same text: the
measure ``check --against`` judges quantized packages by, and ``scripts/quality_benchmark.py``
reports.

Per position: KL(transformers || package) in nats, whether the package's best token is
transformers' best (top-1), or within ``near_tie`` logits of it, and the log-likelihood each gives
the text's next token (for perplexity). Logits that are not finite are refused (``ValueError``;
callers name the step first): a NaN would make every mean NaN, and an all-NaN row's argmax, 0,
would count as agreeing. The bounds per precision (``exporter.precisions.DistributionBounds``) also
fail a NaN (they are written as ``not value <= bound``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Along the last axis, in float64 (a vocabulary of 262144 sums too loosely in float32)."""
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


@dataclass
class DistributionTotals:
    """Sums over positions, so that several texts and generations add up."""

    positions: int = 0
    kl: float = 0.0
    top1: int = 0
    top1_near_tie: int = 0
    # Over the positions whose next token is known (real text, not the package's own picks).
    scored: int = 0
    nll: float = 0.0
    reference_nll: float = 0.0

    def add(self, reference_logits: np.ndarray, package_logits: np.ndarray, targets: np.ndarray | None = None,
            near_tie: float = 0.0) -> None:
        """``*_logits`` [positions, vocab] (logits or log-probabilities); ``targets`` [positions]:
        the token each position predicts, where known."""
        if not (np.isfinite(reference_logits).all() and np.isfinite(package_logits).all()):
            raise ValueError("logits not finite: a NaN would make every mean NaN and agree as top-1")
        want, got = log_softmax(reference_logits), log_softmax(package_logits)
        self.positions += len(want)
        self.kl += float((np.exp(want) * (want - got)).sum())
        best, picked = want.argmax(-1), got.argmax(-1)
        rows = np.arange(len(want))
        self.top1 += int((best == picked).sum())
        self.top1_near_tie += int((want[rows, best] - want[rows, picked] <= near_tie).sum())
        if targets is not None:
            targets = np.asarray(targets)
            self.scored += len(targets)
            self.nll -= float(got[rows, targets].sum())
            self.reference_nll -= float(want[rows, targets].sum())

    @property
    def mean_kl(self) -> float:
        return self.kl / self.positions

    @property
    def top1_share(self) -> float:
        return self.top1 / self.positions

    @property
    def top1_near_tie_share(self) -> float:
        return self.top1_near_tie / self.positions

    @property
    def perplexity(self) -> float:
        return float(np.exp(self.nll / self.scored))

    @property
    def reference_perplexity(self) -> float:
        return float(np.exp(self.reference_nll / self.scored))

    @property
    def perplexity_ratio(self) -> float:
        return float(np.exp((self.nll - self.reference_nll) / self.scored))


def nonfinite(values: np.ndarray) -> str | None:
    """How many of ``values`` are NaN or infinite ("512 NaN of 512 values"); None when all are finite."""
    values = np.asarray(values)
    if np.isfinite(values).all():
        return None
    counts = {"NaN": np.isnan(values).sum(), "+Inf": np.isposinf(values).sum(), "-Inf": np.isneginf(values).sum()}
    return ", ".join(f"{int(count)} {kind}" for kind, count in counts.items() if count) + f" of {values.size} values"
