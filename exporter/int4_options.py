"""The int4 settings an export takes (``--int4-*``, API ``int4=``), apart from the quantizer that
applies them so that reading them costs no import of onnx_ir or ONNX Runtime."""

from __future__ import annotations

from dataclasses import dataclass


INT4_METHODS = ("rtn", "k_quant")


@dataclass(frozen=True)
class Int4Options:
    """block_size: weights per scale (a power of two >= 16). symmetric: no zero points (the
    WebGPU EP's GatherBlockQuantized also refuses zero points over an odd number of blocks).
    accuracy_level: MatMulNBits' compute type (0 = the activation dtype, 4 = int8, faster on CPU).
    method: how each block's scale (and zero point) is chosen: "rtn", round to nearest over the
    block's range (ONNX Runtime's DefaultWeightOnlyQuantizer); "k_quant", llama.cpp's K-quant
    search, a scale and minimum fitted to the block by weighted least squares (ONNX Runtime's
    ``quant_tensor_k_quant_cpu``), which always has zero points."""

    block_size: int = 32
    symmetric: bool = True
    accuracy_level: int = 0
    method: str = "rtn"

    @property
    def zero_points(self) -> bool:
        return not self.symmetric or self.method == "k_quant"

    def __post_init__(self):
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"int4 block size must be a power of two >= 16, not {self.block_size}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"int4 accuracy level must be 0-4, not {self.accuracy_level}")
        if self.method not in INT4_METHODS:
            raise ValueError(f"int4 method must be one of {', '.join(INT4_METHODS)}, not '{self.method}'")
