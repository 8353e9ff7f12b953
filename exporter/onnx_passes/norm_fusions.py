"""Norm fusions into ONNX Runtime's contrib ops, where the EP profile's ``norm_fusions`` lists them.

onnxscript's rewrite rules do the matching (``ort_fusions``: RMSNorm -> SimplifiedLayerNormalization,
Add + SimplifiedLayerNormalization -> SkipSimplifiedLayerNormalization, whose check requires both
Add inputs to be [batch, seq, hidden]: the rank guard that keeps Add(MatMul output, 1-D bias) +
RMSNorm unfused, a pattern ONNX Runtime rejects with "skip is expected to have 3 or 2 dimensions").
Written here, what onnxscript lacks: ``x ** -0.5 -> 1 / sqrt(x)``, because Gemma's RMSNorm traces
to ``pow(-0.5)`` and onnxscript's RMSNorm pattern expects Sqrt + Reciprocal; an RMSNorm without a
scale (Gemma 4's value norm, Llama 4's q/k norms) as a norm with a scale of ones; a
half-precision norm computed in float32 as one norm in the input's dtype.

Only the given rules run, not onnxscript's default set, whose matching cost grows with the square of
the node count.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import common
from onnxscript.rewriter import RewritePass, _ir_utils, pattern
from onnxscript.rewriter.ort_fusions.rms_normalization import rms_normalization_rules
from onnxscript.rewriter.ort_fusions.skip_normalization import SkipRmsNormFusion

from exporter.onnx_passes.base import count_nodes, run_in_place


class PowNegativeHalfToRsqrt(pattern.RewriteRuleClassBase):
    """``Pow(x, -0.5)`` as ``Reciprocal(Sqrt(x))``, the form onnxscript's RMSNorm rules match."""

    def pattern(self, op, x, exponent):
        return op.Pow(x, exponent)

    def check(self, op, x, exponent, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if _ir_utils.get_singleton_value(exponent) != -0.5:
            return result.fail("exponent is not -0.5")
        return result

    def rewrite(self, op, x, exponent, **_):
        return op.Reciprocal(op.Sqrt(x))


class UnscaledRmsNorm(pattern.RewriteRuleClassBase):
    """An RMSNorm with no scale, ``x / sqrt(mean(x**2) + eps)``, as SimplifiedLayerNormalization
    with a scale of ones: one kernel for the eight nodes of a half-precision model's float32-inside
    form (Cast, Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Cast back), or five in float32. The
    output is the same up to rounding: multiplying by 1 is exact.

    ``cast_inside``: x is cast to float32 for the statistics and the result cast back to x's dtype;
    otherwise x itself is float32 or float64. Runs after the scaled rules, whose norms hold this
    pattern as their first part (``FuseRmsNorms``).
    """

    def __init__(self, name: str, cast_inside: bool):
        super().__init__(name)
        self._cast_inside = cast_inside

    def pattern(self, op, x, epsilon, compute_dtype, target_dtype):
        computed = op.Cast(x, to=compute_dtype) if self._cast_inside else x
        mean_square = op.ReduceMean(op.Pow(computed, 2.0), [-1], keepdims=1, noop_with_empty_axes=0)
        normalized = op.Mul(computed, op.Reciprocal(op.Sqrt(op.Add(mean_square, epsilon))))
        return op.Cast(normalized, to=target_dtype) if self._cast_inside else normalized

    def check(self, op, x, epsilon, compute_dtype=None, target_dtype=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if not isinstance(_ir_utils.get_singleton_value(epsilon), float):
            return result.fail("epsilon is not a constant float")
        if x.shape is None or not isinstance(x.shape[-1], int):
            return result.fail("the normalized dim's size is not known")
        if self._cast_inside:
            if x.dtype not in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
                return result.fail("x is not half precision")
            if compute_dtype.as_int() != ir.DataType.FLOAT.value or target_dtype.as_int() != x.dtype.value:
                return result.fail("not float32 statistics cast back to x's dtype")
        elif x.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE):
            return result.fail("x is not float32 or float64")
        existing = _initializer(x, _unit_scale_name(x))
        if existing is not None and not _holds_ones(existing, x.shape[-1], x.dtype):
            return result.fail(f"an initializer named {_unit_scale_name(x)} holds other values")
        return result

    def rewrite(self, op, x, epsilon, **_):
        name = _unit_scale_name(x)
        unit_scale = _initializer(x, name) or op.initializer(
            ir.tensor(np.ones(x.shape[-1], dtype=x.dtype.numpy())), name=name)
        return op.SimplifiedLayerNormalization(
            x,
            unit_scale,
            axis=-1,
            epsilon=_ir_utils.get_singleton_value(epsilon),
            stash_type=ir.DataType.FLOAT.value if self._cast_inside else x.dtype.value,
        )


def _unit_scale_name(x: ir.Value) -> str:
    """One initializer of ones per size and dtype, shared by every unscaled norm."""
    return f"unit_scale_{x.dtype.name.lower()}_{x.shape[-1]}"


def _initializer(x: ir.Value, name: str) -> ir.Value | None:
    graph = x.producer().graph if x.producer() is not None else x.graph
    return graph.initializers.get(name)


def _holds_ones(value: ir.Value, size: int, dtype: ir.DataType) -> bool:
    array = value.const_value.numpy() if value.const_value is not None else None
    return array is not None and array.dtype == dtype.numpy() and array.shape == (size,) and bool((array == 1).all())


class NormInInputDtype(pattern.RewriteRuleClassBase):
    """``Cast(SimplifiedLayerNormalization(x, scale), to=x.dtype)`` with a float32 scale as one
    SimplifiedLayerNormalization in x's dtype (scale cast once, statistics still in float32).

    A half-precision model that normalizes in float32 (Gemma: ``x.float()``, times
    ``weight.float()``, cast back) fuses into a norm with a float32 output and scale; ONNX Runtime's
    SkipSimplifiedLayerNormalization needs input, skip, scale and output in one dtype, so without
    this rule the skip fusion would build a node ONNX Runtime refuses to load. The result differs
    from the float32 product only by rounding the scale and the product to x's dtype.
    """

    def pattern(self, op, x, scale):
        normalized = op.SimplifiedLayerNormalization(x, scale, _allow_other_attributes=True, _outputs=["norm"])
        return op.Cast(normalized, _allow_other_attributes=True, _outputs=["cast"])

    def check(self, op, x, scale, norm, cast, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        target = cast.producer().attributes.get_int("to")
        if x.dtype is None or target != x.dtype.value or x.dtype == norm.dtype:
            return result.fail("not a cast back to the norm's input dtype")
        if scale.const_value is None:
            return result.fail("scale is not a constant")
        return result

    def rewrite(self, op, x, scale, norm, cast, **_):
        attributes = norm.producer().attributes
        cast_scale = op.Cast(scale, to=x.dtype.value)  # folded into an initializer after the fusions
        cast_scale.dtype, cast_scale.shape = x.dtype, scale.shape
        output = op.SimplifiedLayerNormalization(
            x,
            cast_scale,
            axis=attributes.get_int("axis", -1),
            epsilon=attributes.get_float("epsilon", 1e-5),
            stash_type=attributes.get_int("stash_type", ir.DataType.FLOAT.value),
        )
        output.dtype, output.shape = x.dtype, x.shape  # the skip fusion's guards read them
        return output


class _SameDtypeSkipRmsNormFusion(SkipRmsNormFusion):
    """onnxscript's skip-RMSNorm fusion, guarded also on one dtype for input, skip and scale
    (ONNX Runtime's SkipSimplifiedLayerNormalization binds them to one type)."""

    def check(self, op, input, skip, gamma, bias, simplified_layer_norm, **kwargs) -> pattern.MatchResult:
        result = super().check(op, input, skip, gamma, bias, simplified_layer_norm, **kwargs)
        if result and len({input.dtype, skip.dtype, gamma.dtype, simplified_layer_norm.dtype}) != 1:
            return pattern.MatchResult().fail("input, skip, scale and output dtypes differ")
        return result


SIMPLIFIED_LAYER_NORM = "SimplifiedLayerNormalization"
SKIP_SIMPLIFIED_LAYER_NORM = "SkipSimplifiedLayerNormalization"
KNOWN_NORM_FUSIONS = (SIMPLIFIED_LAYER_NORM, SKIP_SIMPLIFIED_LAYER_NORM)


class FusionDidNotApply(RuntimeError):
    pass


class _NormFusion:
    """Rewrite the graph into ``op_type`` with ``rules()`` where the profile fuses that op."""

    op_type: str

    def applies(self, settings, session) -> str | None:
        return f"{settings.profile.name} runs {self.op_type}" if self.op_type in settings.profile.norm_fusions else None

    def rules(self) -> list:
        raise NotImplementedError

    def __call__(self, model: ir.Model, settings, session) -> dict[str, int]:
        before = count_nodes(model, self.op_type)
        run_in_place(RewritePass(self.rules()), model)
        run_in_place(common.RemoveUnusedNodesPass(), model)
        return {"fused": count_nodes(model, self.op_type) - before}


class FuseRmsNorms(_NormFusion):
    """RMSNorm -> SimplifiedLayerNormalization (Gemma's ``pow(-0.5)`` form too, and a half-precision
    model's fp32-inside norm as one norm in its dtype). Matching nothing while the graph has
    RMSNorm-like subgraphs is an error, not a silent no-op."""

    name = "fuse_rms_norms"
    op_type = SIMPLIFIED_LAYER_NORM

    def rules(self) -> list:
        return [PowNegativeHalfToRsqrt.rule(), *rms_normalization_rules, NormInInputDtype.rule()]

    def __call__(self, model: ir.Model, settings, session) -> dict[str, int]:
        changes = super().__call__(model, settings, session)
        # Only once the scaled norms are fused: each holds the unscaled pattern. The half-precision
        # form first: its float32 middle is the float32 form.
        before = count_nodes(model, self.op_type)
        for cast_inside in (True, False):
            run_in_place(RewritePass([UnscaledRmsNorm.rule(f"UnscaledRmsNorm{cast_inside}", cast_inside=cast_inside)]),
                         model)
        run_in_place(common.RemoveUnusedNodesPass(), model)
        changes["without_scale"] = count_nodes(model, self.op_type) - before
        changes["fused"] += changes["without_scale"]
        squares_averaged = [
            node for node in model.graph.all_nodes()
            if node.op_type == "ReduceMean"
            and (producer := node.inputs[0].producer()) is not None
            and producer.op_type == "Pow"
            and _ir_utils.get_singleton_value(producer.inputs[1]) == 2.0
        ]
        if changes["fused"] == 0 and squares_averaged:
            raise FusionDidNotApply(
                f"SimplifiedLayerNormalization fusion matched nothing, but the graph has {len(squares_averaged)} "
                f"mean-of-squares (RMSNorm-like) subgraphs, e.g. at {squares_averaged[0].name}"
            )
        changes["mean_of_squares_left"] = len(squares_averaged)  # a partial fusion shows in the report
        return changes


class FuseSkipRmsNorms(_NormFusion):
    """Residual Add + SimplifiedLayerNormalization -> SkipSimplifiedLayerNormalization, with the
    rank guard (both Add inputs [batch, seq, hidden]) and the one-dtype guard."""

    name = "fuse_skip_rms_norms"
    op_type = SKIP_SIMPLIFIED_LAYER_NORM

    def rules(self) -> list:
        # The same three rules as onnxscript's skip_rms_normalization_ruleset, with the dtype guard.
        return [
            _SameDtypeSkipRmsNormFusion.rule("SkipRmsNormPreAddBias", has_bias=True, bias_pre_add=True),
            _SameDtypeSkipRmsNormFusion.rule("SkipRmsNormAddBias", has_bias=True, bias_pre_add=False),
            _SameDtypeSkipRmsNormFusion.rule("SkipRmsNorm", has_bias=False),
        ]
