"""A lazy weight for pass tests that counts its reads, as ``exporter.weights.placeholders.WeightReader``
does: a pass that must not read a weight is checked, not assumed."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


class CountingReader:
    def __init__(self, array: np.ndarray):
        self.array, self.reads = array, 0

    def __call__(self) -> ir.TensorProtocol:
        self.reads += 1
        return ir.tensor(self.array)
