"""Round-to-nearest block quantization, as ONNX Runtime's ``MatMulNBits`` stores it, and its
decoding: what the int4 pass writes (``exporter.onnx_passes.quantize_weights``) and what AWQ's
search rounds with (``exporter.load.activation_aware_scales``), so both use the same numbers."""

from __future__ import annotations

import logging

import numpy as np


def _import_quantizer():
    """onnxruntime's quantizer module calls ``logging.basicConfig(level=INFO)`` on import, which
    would make every library's INFO lines print; the root logger is put back as it was."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        from onnxruntime.quantization import matmul_nbits_quantizer
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return matmul_nbits_quantizer


ORT_QUANTIZER = _import_quantizer()


def rtn_blocks(n_by_k: np.ndarray, bits: int, block_size: int,
               symmetric: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MatMulNBits' parts of a weight [n, k] rounded to nearest over each block's range by ONNX
    Runtime's ``DefaultWeightOnlyQuantizer.qbits_block_quant``: blob uint8 [n, blocks, block * bits
    / 8], scales [n, blocks], zero points packed uint8 (unused when symmetric)."""
    config = ORT_QUANTIZER.DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=symmetric, bits=bits)
    return ORT_QUANTIZER.DefaultWeightOnlyQuantizer(config).qbits_block_quant(np.ascontiguousarray(n_by_k.T))


def round_trip(n_by_k: np.ndarray, bits: int, block_size: int, symmetric: bool) -> np.ndarray:
    """The weight [n, k] a round-to-nearest ``MatMulNBits`` of these blocks computes with:
    ``rtn_blocks`` decoded, ``scale * (q - zero_point)`` (symmetric: the zero point is the range's
    middle, 2**(bits - 1))."""
    n, k = n_by_k.shape
    blob, scales, zero_points = rtn_blocks(n_by_k, bits, block_size, symmetric)
    blocks = scales.size // n
    scales = scales.reshape(n, blocks)
    if bits == 4:
        q = np.stack([blob & 0xF, blob >> 4], axis=-1).reshape(n, blocks, -1)
    else:
        q = blob.reshape(n, blocks, -1)
    if symmetric:
        zeros = np.full((n, blocks), 1 << (bits - 1), np.float32)
    elif bits == 4:
        zeros = np.stack([zero_points & 0xF, zero_points >> 4], axis=-1).reshape(n, -1)[:, :blocks]
    else:
        zeros = zero_points.reshape(n, blocks)
    values = (q.astype(np.float32) - zeros[..., None].astype(np.float32)) * scales[..., None].astype(np.float32)
    return values.reshape(n, -1)[:, :k]
