"""The int4 settings an export takes (``--int4-*``, API ``int4=``), apart from the quantizer that
applies them so that reading them costs no import of onnx_ir or ONNX Runtime."""

from __future__ import annotations

from dataclasses import dataclass


INT4_METHODS = ("rtn", "k_quant", "hqq", "awq")
# Weights an int4 export may store at 8 bits instead (``eight_bit``), those whose rounding costs
# most: "lm_head", the logits' MatMul (and the table it is tied to); "embeddings", every gathered
# table (and a head tied to one); "sensitive_layers", the attention value and MLP down projections
# of the first and last eighth of the layers and every third layer between (llama.cpp's Q4_K_M
# rule, which ONNX Runtime GenAI's builder also uses for ``mixed_layers``).
EIGHT_BIT_ROLES = ("lm_head", "embeddings", "sensitive_layers")


@dataclass(frozen=True)
class Int4Options:
    """The defaults are the best measured on real checkpoints at the decode speed of plain
    round-to-nearest (docs/measurements.md, "int4 and int8 on real weights"): asymmetric round-to-nearest blocks
    of 32, every weight 4-bit. ``eight_bit=("lm_head", "sensitive_layers")`` buys more quality for
    decode speed (real Qwen2.5-Coder 0.5B on the CPU: KL 0.059 -> 0.039 for 0.80x decode).

    block_size: weights per scale (a power of two >= 16). symmetric: no zero points (a gathered
    table over an odd number of blocks never has them: GatherBlockQuantized refuses them there).
    accuracy_level: MatMulNBits' compute type (0 = the activation dtype, 4 = int8, faster on CPU);
    None: the profile's (``int4_accuracy_level``; on the CPU 4, where 8-bit blocks at level 0 or 1
    run ONNX Runtime 1.32's reference kernel, about 70x slower for a 151936 x 896 head).
    method: how each block's scale (and zero point) is chosen: "rtn", round to nearest over the
    block's range (ONNX Runtime's DefaultWeightOnlyQuantizer); "k_quant", llama.cpp's K-quant
    search, a scale and minimum fitted to the block by weighted least squares (ONNX Runtime's
    ``quant_tensor_k_quant_cpu``), which always has zero points; "hqq", Half-Quadratic
    Quantization (ONNX Runtime's ``HQQWeightOnlyQuantizer``): the range's scale, and a float zero
    point per block fitted by a proximal solver to the weights' l_0.7 error, so always with zero
    points, of the activation dtype, which only some EPs' MatMulNBits run
    (``EpProfile.weight_float_zero_points``). GatherBlockQuantized takes integer zero points
    only, so under "hqq" the gathered tables (and a head tied to one) are round-to-nearest. "awq",
    activation-aware scaling (AWQ): each decoder linear layer stores ``W * s`` round-to-nearest and
    is fed ``x / s``, with s per input channel searched at export time on the decoder's float32
    activations over a few built-in prompts (``exporter.load.activation_aware_scales``); integer
    zero points, so it runs on the kernels round-to-nearest runs on; the layers reading one input
    share one s, and its division is folded into the norm (or up projection) before them where
    nothing else reads that input (``exporter.onnx_passes.fold_awq_divisions``), else a Div.
    eight_bit: the roles (``EIGHT_BIT_ROLES``) stored as 8-bit blocks, round-to-nearest with the
    same block size and symmetry (8 bits leave little for a better search to win); under "awq" they
    take their layer's s too (stored ``W * s``). Layers' value
    and down projections are found by their checkpoint names (``layers.N. ... v_proj`` /
    ``down_proj``): a family with other names (fused qkv, GPT-NeoX's) gets fewer of them; the
    report counts what was found."""

    block_size: int = 32
    symmetric: bool = False
    accuracy_level: int | None = None
    method: str = "rtn"
    eight_bit: tuple[str, ...] = ()

    @property
    def zero_points(self) -> bool:
        return not self.symmetric or self.method in ("k_quant", "hqq")

    def __post_init__(self):
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"int4 block size must be a power of two >= 16, not {self.block_size}")
        if self.accuracy_level not in (None, 0, 1, 2, 3, 4):
            raise ValueError(f"int4 accuracy level must be 0-4, not {self.accuracy_level}")
        if self.method not in INT4_METHODS:
            raise ValueError(f"int4 method must be one of {', '.join(INT4_METHODS)}, not '{self.method}'")
        unknown = [role for role in self.eight_bit if role not in EIGHT_BIT_ROLES]
        if unknown:
            raise ValueError(f"unknown 8-bit role '{unknown[0]}'; use any of: {', '.join(EIGHT_BIT_ROLES)}")
        object.__setattr__(self, "eight_bit", tuple(sorted(set(self.eight_bit), key=EIGHT_BIT_ROLES.index)))
