"""The int4 settings an export takes (``--int4-*``, API ``int4=``), apart from the quantizer that
applies them so that reading them costs no import of onnx_ir or ONNX Runtime."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Int4Options:
    """block_size: weights per scale (a power of two >= 16). symmetric: no zero points (the
    WebGPU EP's GatherBlockQuantized also refuses zero points over an odd number of blocks).
    accuracy_level: MatMulNBits' compute type (0 = the activation dtype, 4 = int8, faster on CPU)."""

    block_size: int = 32
    symmetric: bool = True
    accuracy_level: int = 0

    def __post_init__(self):
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"int4 block size must be a power of two >= 16, not {self.block_size}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"int4 accuracy level must be 0-4, not {self.accuracy_level}")
