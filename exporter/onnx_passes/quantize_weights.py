"""Weight-only block quantization (int4, int8, and int4 with some weights at 8 bits): MatMul ->
MatMulNBits, embedding Gather -> GatherBlockQuantized, MoE -> QMoE (4-bit only).

The numbers come from ONNX Runtime's own block quantizer (``DefaultWeightOnlyQuantizer``'s
``qbits_block_quant``, the kernel behind ``MatMulNBitsQuantizer``). What this module adds, and why
it does not run ``MatMulNBitsQuantizer`` on the model: that tool needs the whole model as an
``onnx.ModelProto`` with every weight in memory (E2B's do not fit on a 24 GiB machine next to their
quantized copies), and it quantizes a Gather table into a layout MatMulNBits cannot read, so a tied
embedding / LM head would be stored twice. Here each weight is quantized lazily, when the package is
written (one weight in memory at a time), and a table that is also the LM head is stored once: the
MatMulNBits blob [vocab, blocks, block/2] reshaped to [vocab, blocks * block/2] is exactly
GatherBlockQuantized's uint8 data (ONNX Runtime GenAI's model builder shares it the same way).

Quantized: every MatMul whose weight is a 2-D initializer (or the Transpose of one, the form
torch.onnx leaves for weights too large to fold), and every Gather along axis 0 of a 2-D
initializer table (embeddings, per-layer tables and their pieces). Each weight's bits come from
the precision (``int8``: all 8) and, at int4, from ``Int4Options.eight_bit``: the LM head is the
MatMul that computes the ``logits`` output, and a layer's value and down projections are found by
the checkpoint tensor their initializer reads (``exporter.weights.origins.made_from``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import common

from exporter.errors import ExporterBug, ExporterError
from exporter.int4_options import Int4Options
from exporter.weights.block_rounding import ORT_QUANTIZER, rtn_blocks


MICROSOFT = "com.microsoft"
# Marks the Div by AWQ's s before a MatMulNBits (onnx_passes.fold_awq_divisions folds it away).
AWQ_DIVISION = "exporter.awq_division"


@dataclass(frozen=True)
class BlockFormat:
    """How one weight is stored: ``bits`` per value, a scale per ``block_size`` values along K,
    zero points unless ``symmetric`` (K-quant and HQQ always have them; HQQ's are floats of the
    scales' dtype, one per block, not packed integers)."""

    bits: int
    block_size: int
    symmetric: bool
    method: str = "rtn"

    @property
    def zero_points(self) -> bool:
        return not self.symmetric or self.method in ("k_quant", "hqq")

    @property
    def float_zero_points(self) -> bool:
        return self.method == "hqq"

    def blob_width(self) -> int:
        """Bytes of one block."""
        return self.block_size * self.bits // 8

    def zero_point_width(self, blocks: int) -> int:
        """Bytes of one row's zero points: two per byte at 4 bits."""
        return -(-blocks * self.bits // 8)


class _Blocks:
    """One weight's quantized parts (blob, scales, zero points), computed on first read and
    dropped once each part has been read, so saving holds one weight's parts at a time."""

    def __init__(self, weight: ir.TensorProtocol, transposed: bool, block_format: BlockFormat,
                 input_scale: np.ndarray | None = None):
        self.weight, self.transposed, self.format = weight, transposed, block_format
        self.input_scale = input_scale  # AWQ's s [k]: the blocks hold weight * s
        self.wanted = ("blob", "scales", "zero_points") if block_format.zero_points else ("blob", "scales")
        self.parts: dict[str, np.ndarray] | None = None
        self.unread: set[str] = set()

    def part(self, name: str) -> ir.Tensor:
        if self.parts is None:
            values = self.weight.numpy()
            if self.input_scale is not None:
                scale = self.input_scale.astype(values.dtype)
                values = values * (scale if self.transposed else scale[:, None])
            if self.format.method == "k_quant":
                blob, scales, zero_points = k_quant_blocks(values if self.transposed else values.T,
                                                           self.format.block_size)
            elif self.format.method == "hqq":
                assert self.format.bits == 4, "HQQ blocks are 4-bit (8-bit roles are round-to-nearest)"
                blob, scales, zero_points = hqq_blocks(values if self.transposed else values.T, self.format.block_size)
            else:
                blob, scales, zero_points = rtn_blocks(values if self.transposed else values.T, self.format.bits,
                                                       self.format.block_size, self.format.symmetric)
            self.parts = dict(zip(("blob", "scales", "zero_points"), (blob, scales, zero_points), strict=True))
            self.unread = set(self.wanted)
        array = self.parts[name]
        self.unread.discard(name)
        if not self.unread:
            self.parts = None
        return ir.tensor(array)


K_QUANT_ROWS = 4096  # output rows quantized at once: the K-quant search holds ~8 float copies of them


def k_quant_blocks(n_by_k: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MatMulNBits' parts of a weight [n, k] quantized by ONNX Runtime's K-quant search
    (``quant_tensor_k_quant_cpu``: per block a scale and minimum fitted by weighted least squares,
    as llama.cpp's Q4_K): blob uint8 [n, blocks, block / 2] (low nibble first), scales [n, blocks]
    in the weight's dtype, zero points uint8 [n, ceil(blocks / 2)] (two per byte, low first), so
    that each weight is ``scale * (q - zero_point)``. Rows go K_QUANT_ROWS at a time."""
    from onnxruntime.quantization.neural_compressor.weight_only import quant_tensor_k_quant_cpu

    n, k = n_by_k.shape
    blocks = -(-k // block)
    blob = np.empty((n, blocks, block // 2), np.uint8)
    scales = np.empty((n, blocks), n_by_k.dtype)
    zero_points = np.zeros((n, blocks + blocks % 2), np.uint8)
    for start in range(0, n, K_QUANT_ROWS):
        rows = np.asarray(n_by_k[start:start + K_QUANT_ROWS], np.float32)
        if k % block:  # zeros fill the last block, as MatMulNBits' K pads
            rows = np.pad(rows, ((0, 0), (0, blocks * block - k)))
        # A block whose candidate fit is degenerate (D = 0) divides by zero; its NaN error never
        # beats the running best, so that candidate is never taken.
        with np.errstate(invalid="ignore", divide="ignore"):
            q, scale, zero = quant_tensor_k_quant_cpu(rows, 4, block)
        if not np.isfinite(scale).all():
            raise ExporterError(f"K-quant gave a non-finite scale in rows {start}-{start + len(rows)} of a weight")
        q = q.astype(np.uint8).reshape(len(rows), blocks, block)
        blob[start:start + len(rows)] = q[..., 0::2] | (q[..., 1::2] << 4)
        scales[start:start + len(rows)] = scale.reshape(len(rows), blocks)
        zero_points[start:start + len(rows), :blocks] = zero.reshape(len(rows), blocks)
    return blob, scales, zero_points[:, 0::2] | (zero_points[:, 1::2] << 4)


HQQ_ROWS = 4096  # output rows quantized at once: the solver holds ~5 float32 copies of them


def hqq_blocks(n_by_k: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MatMulNBits' parts of a weight [n, k] quantized by ONNX Runtime's Half-Quadratic
    Quantization (``HQQWeightOnlyQuantizer.quantize_internal``: each block's scale from its range,
    its zero point fitted by a proximal solver to the l_0.7 norm of the rounding error, so that
    outliers cost less than under a least-squares fit): blob uint8 [n, blocks, block / 2] (low
    nibble first), scales and float zero points [n, blocks] in the weight's dtype, so that each
    weight is ``scale * (q - zero_point)``. Rows go HQQ_ROWS at a time (each block's fit is its
    own; only the solver's early stop looks at the whole batch)."""
    import torch

    quantizer = ORT_QUANTIZER.HQQWeightOnlyQuantizer(ORT_QUANTIZER.HQQWeightOnlyQuantConfig(block_size=block, bits=4))
    n, k = n_by_k.shape
    blocks = -(-k // block)
    blob = np.empty((n, blocks, block // 2), np.uint8)
    scales = np.empty((n, blocks), n_by_k.dtype)
    zero_points = np.empty((n, blocks), n_by_k.dtype)
    for start in range(0, n, HQQ_ROWS):
        rows = torch.from_numpy(np.array(n_by_k[start:start + HQQ_ROWS], dtype=np.float32))  # a writable copy
        with torch.no_grad():
            q, scale, zero = quantizer.quantize_internal(rows, bits=4, group_size=block)  # pads k to whole blocks
        scale, zero = scale.numpy().reshape(len(rows), blocks), zero.numpy().reshape(len(rows), blocks)
        if not (np.isfinite(scale).all() and np.isfinite(zero).all()):
            raise ExporterError(f"HQQ gave a non-finite scale or zero point in rows {start}-{start + len(rows)} of a weight")
        q = q.numpy().astype(np.uint8).reshape(len(rows), blocks, block)
        blob[start:start + len(rows)] = q[..., 0::2] | (q[..., 1::2] << 4)
        scales[start:start + len(rows)] = scale
        zero_points[start:start + len(rows)] = zero
    return blob, scales, zero_points


class _ExpertBlocks:
    """One experts weight [experts, out, in] quantized expert by expert on first read (blob
    [experts, out, in/2], scales [experts, out, in/block]), dropped once both parts are read."""

    def __init__(self, weight: ir.TensorProtocol, options: Int4Options):
        self.weight, self.options = weight, options
        self.parts: dict[str, np.ndarray] | None = None
        self.unread: set[str] = set()

    def part(self, name: str) -> ir.Tensor:
        if self.parts is None:
            blobs, scales = [], []
            for expert in self.weight.numpy():  # [out, in]
                blob, scale, _ = rtn_blocks(expert, 4, self.options.block_size, True)
                blobs.append(blob.reshape(expert.shape[0], -1))
                scales.append(scale.reshape(expert.shape[0], -1))
            self.parts = {"blob": np.stack(blobs), "scales": np.stack(scales)}
            self.unread = {"blob", "scales"}
        array = self.parts[name]
        self.unread.discard(name)
        if not self.unread:
            self.parts = None
        return ir.tensor(array)


@dataclass
class _Quantized:
    blob: ir.Value  # uint8 [n, blocks, block * bits / 8]
    scales: ir.Value  # [n, blocks], the weight's dtype
    zero_points: ir.Value | None  # uint8 [n, ceil(blocks * bits / 8)], or HQQ's floats [n, blocks]
    n: int
    k: int
    format: BlockFormat
    input_divisor: ir.Value | None = None  # AWQ's s [k]: the blocks hold weight * s, so x / s is fed


class QuantizeWeights:
    """The pass: every MatMul with a constant weight and every embedding Gather, at the plan's
    precision and int4 options; a quantized export with nothing to quantize is an error."""

    name = "quantize_weights"

    def applies(self, settings, session) -> str | None:
        if not settings.quantized(session):
            return None
        options, bits = settings.int4, settings.weight_bits
        if bits == 8:
            return f"8-bit weights (rtn): block size {options.block_size}, symmetric, accuracy level {options.accuracy_level}"
        eight = f"; 8-bit {', '.join(options.eight_bit)}" if options.eight_bit else ""
        # Measured here (docs/measurements.md): a real 270M model decodes 14x slower.
        slow = ("; float zero points, which ONNX Runtime 1.32's CPU EP runs on a slow kernel"
                if options.method == "hqq" else "")
        return (f"4-bit weights ({options.method}): block size {options.block_size}, "
                f"{'asymmetric' if options.zero_points else 'symmetric'}, accuracy level {options.accuracy_level}{eight}{slow}")

    def __call__(self, model: ir.Model, settings, session) -> dict[str, int]:
        quantizer = _Quantizer(settings.int4, settings.weight_bits, settings.layout.num_layers,
                               settings.profile.max_buffer_size, settings.activation_aware_scales)
        quantizer.run(model)
        if session.is_decoder and quantizer.input_scales and not quantizer.scales_found:
            # The search's names and the graph's checkpoint names disagree: the export would be
            # round-to-nearest under AWQ's name.
            raise ExporterBug(f"AWQ searched {len(quantizer.input_scales)} linear layers and the decoder's graph "
                              "carries none of their weights under their checkpoint names")
        if not quantizer.matmuls and not quantizer.gathers:
            raise ExporterError("weight quantization found no MatMul with a constant weight and no embedding table to quantize")
        return {"matmuls": quantizer.matmuls, "gathers": quantizer.gathers,
                "tables_shared_with_lm_head": quantizer.shared_tables, "experts_blocks": quantizer.experts_blocks,
                # MoE blocks QMoE cannot take here (a width the block size does not divide, biased
                # experts, int8): their experts stay float.
                "float_experts_blocks": quantizer.float_experts_blocks,
                "tables_without_zero_points": quantizer.tables_without_zero_points,
                # Under HQQ: tables (and a head tied to one) quantized round-to-nearest, with
                # integer zero points, because GatherBlockQuantized takes no float ones.
                **({"tables_round_to_nearest": quantizer.tables_round_to_nearest} if settings.int4.method == "hqq" else {}),
                # Under AWQ: the MatMuls fed x / s, the Divs computing it (one per input and s shared
                # by its layers), and the 4-bit ones without a measured s (attention
                # output projections, the LM head, layers outside the decoder's), round-to-nearest;
                # in the decoder, the scales searched that no MatMul took (a checkpoint name the
                # graph's weights do not carry: each would be a layer left round-to-nearest).
                **({"awq_scaled": quantizer.awq_scaled, "awq_unscaled": quantizer.awq_unscaled,
                    "awq_divisions": quantizer.awq_divisions}
                   if settings.int4.method == "awq" and settings.weight_bits == 4 else {}),
                **({"awq_scales_not_applied": len(quantizer.input_scales) - len(quantizer.scales_found)}
                   if session.is_decoder and settings.int4.method == "awq" and settings.weight_bits == 4 else {}),
                # Weights stored at 8 bits in an int4 export (Int4Options.eight_bit), by role, and
                # those kept at 4 because their 8-bit blob would pass the profile's buffer limit.
                **{f"eight_bit_{role}": count for role, count in quantizer.eight_bit.items()},
                **({"eight_bit_over_buffer_limit": quantizer.over_buffer_limit} if quantizer.over_buffer_limit else {})}


_LAYER_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.*\.)?(v_proj|down_proj)\.weight$")


def sensitive_layer(index: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the layers, and every third
    layer between."""
    eighth = layers // 8
    return index < eighth or index >= 7 * layers // 8 or (index - eighth) % 3 == 2


class _Quantizer:
    def __init__(self, options: Int4Options, bits: int, layers: int, max_buffer_size: int | None,
                 input_scales: dict[str, np.ndarray] | None = None):
        self.options, self.bits, self.layers, self.max_buffer_size = options, bits, layers, max_buffer_size
        self.input_scales = input_scales or {}
        self.awq_scaled = self.awq_unscaled = self.awq_divisions = 0
        self.scales_found: set[str] = set()  # the searched layers the graph carries
        self._divisors: dict[tuple[int, ir.DataType], ir.Value] = {}  # (id of an s, dtype) -> its initializer
        self._divided: dict[tuple[int, int], ir.Value] = {}  # (id of an input, id of its divisor) -> x / s
        self.over_buffer_limit = 0
        self.matmuls = self.gathers = self.shared_tables = self.experts_blocks = self.float_experts_blocks = 0
        self.tables_without_zero_points = self.tables_round_to_nearest = 0
        self.eight_bit: dict[str, int] = {role: 0 for role in options.eight_bit} if bits == 4 else {}

    def run(self, model: ir.Model) -> None:
        graph = model.graph
        quantized: dict[int, _Quantized] = {}  # id of the source [n, k] initializer -> its parts
        tables = {}
        for node in list(graph):
            if node.op_type == "Gather" and node.domain == "" and (table := _table_of(node)) is not None:
                tables[id(table)] = table
        self.lm_head = _lm_head(graph)
        for node in list(graph):
            if node.op_type != "MatMul" or node.domain != "":
                continue
            weight = _matmul_weight(node)
            if weight is None:
                continue
            source, transposed = weight
            k, n = (source.shape[1], source.shape[0]) if transposed else tuple(source.shape)
            if k < self.options.block_size:
                continue
            # A folded transpose of a gathered table (small tied models) is the table itself.
            if not transposed and (twin := _transposed_twin(source, tables.values())) is not None:
                source, transposed = twin, True
            key = id(source)
            if key not in quantized:
                quantized[key] = self._quantize(graph, source, transposed, k, n,
                                                self._format_for(source, k, n, tables, lm_head=node is self.lm_head))
            q = quantized[key]
            if q.input_divisor is not None:
                self.awq_scaled += 1
            elif q.format.bits == 4 and self.options.method == "awq":
                self.awq_unscaled += 1
            self._replace_matmul(graph, node, q)
            self.matmuls += 1
        for node in list(graph):
            if node.op_type != "Gather" or node.domain != "" or (table := _table_of(node)) is None:
                continue
            rows, width = table.shape
            if width < self.options.block_size:
                continue
            if id(table) in quantized:
                # A table's rows are looked up as stored: blocks of W * s would decode to wrong rows.
                assert quantized[id(table)].input_divisor is None, "a gathered table with AWQ's scale"
                self.shared_tables += 1
            else:
                quantized[id(table)] = self._quantize(graph, table, True, width, rows,
                                                      self._format_for(table, width, rows, tables, lm_head=False))
            self._replace_gather(graph, node, quantized[id(table)])
            self.gathers += 1
        for node in list(graph):
            if node.op_type == "MoE" and node.domain == MICROSOFT:
                if self._quantize_experts(graph, node):
                    self.experts_blocks += 1
                else:
                    self.float_experts_blocks += 1
        # The float weights (and transposes of them) that nothing reads any more.
        common.RemoveUnusedNodesPass()(model)

    def _quantize_experts(self, graph: ir.Graph, node: ir.Node) -> bool:
        """``MoE`` -> ``QMoE`` with 4-bit experts: each expert's [out, in] matrix quantized by the
        same block quantizer as a MatMul's, its blob [out, blocks, block/2] read as [out, in/2] and
        its scales as [out, blocks] (QMoE's block-wise layout: value = (q - 8) * scale, low nibble
        first, measured against MoE on ONNX Runtime 1.32's CPU kernel): symmetric whatever the
        options say, since that layout has no zero points. The experts' biases (gpt-oss's) stay in
        the activation dtype. Only blocks that divide both widths and 4-bit exports; otherwise the
        block stays fp32."""
        block = self.options.block_size
        fc1, fc2 = node.inputs[2], node.inputs[4]
        fc1_bias, fc2_bias = (node.inputs[i] if len(node.inputs) > i else None for i in (3, 5))
        if (self.bits != 4 or len(node.inputs) > 6 or not _is_experts_weight(fc1) or not _is_experts_weight(fc2)
                or fc1.shape[2] % block or fc2.shape[2] % block):
            return False
        inputs = [node.inputs[0], node.inputs[1]]
        for weight in (fc1, fc2):
            experts, out, width = weight.shape
            parts = _ExpertBlocks(weight.const_value, self.options)
            for part, dtype, shape in (("blob", ir.DataType.UINT8, [experts, out, width // 2]),
                                       ("scales", weight.dtype, [experts, out, width // block])):
                value = ir.Value(name=unique_initializer_name(graph, f"{weight.name}.{'int4' if part == 'blob' else 'scales'}"),
                                 const_value=ir.LazyTensor(lambda part=part, parts=parts: parts.part(part), dtype=dtype,
                                                           shape=ir.Shape(shape)),
                                 type=ir.TensorType(dtype), shape=ir.Shape(shape))
                graph.register_initializer(value)
                inputs.append(value)
            inputs.append(fc1_bias if weight is fc1 else fc2_bias)
        while inputs[-1] is None:
            inputs.pop()
        attributes = {name: attr.value for name, attr in node.attributes.items()}
        attributes.update(expert_weight_bits=4, block_size=block)
        _swap(graph, node, [ir.node("QMoE", inputs, attributes, domain=MICROSOFT, name=f"{node.name}.int4")])
        return True

    def _format_for(self, source: ir.Value, k: int, n: int, tables: dict, lm_head: bool) -> BlockFormat:
        """The export's block format for this weight: 8 bits at int8 and for the roles the int4
        options name (unless the 8-bit blob would pass the profile's buffer limit, which the
        split before lowering sized for 4 bits: Gemma 4 E2B's tied head, 384 MiB at 8 bits),
        else the options' 4-bit format, but for a 4-bit gathered table (and a tied LM head
        reading it) whose rows span an odd number of blocks: GatherBlockQuantized refuses packed
        zero points there (ONNX Runtime 1.32, CPU and WebGPU: "scales and zero_points must have
        the same shape"), so it is quantized round-to-nearest without them."""
        options = self.options
        role = self._eight_bit_role(source, tables, lm_head)
        blocks = -(-k // options.block_size)
        if role and self.max_buffer_size is not None and n * blocks * options.block_size > self.max_buffer_size:
            self.over_buffer_limit += 1
            role = None
        if self.bits == 8:  # int8: symmetric (zero points buy little at 8 bits)
            return BlockFormat(8, options.block_size, True)
        if role:
            self.eight_bit[role] += 1
            return BlockFormat(8, options.block_size, options.symmetric)
        if options.zero_points and id(source) in tables and -(-k // options.block_size) % 2:
            self.tables_without_zero_points += 1
            return BlockFormat(4, options.block_size, True)
        if options.method == "hqq" and id(source) in tables:  # GatherBlockQuantized's zero points are integers
            self.tables_round_to_nearest += 1
            return BlockFormat(4, options.block_size, False)
        if options.method == "awq":  # AWQ's scale is applied in _quantize; its blocks are round-to-nearest
            return BlockFormat(4, options.block_size, options.symmetric)
        return BlockFormat(4, options.block_size, options.symmetric, options.method)

    def _eight_bit_role(self, source: ir.Value, tables: dict, lm_head: bool) -> str | None:
        """The first role of ``Int4Options.eight_bit`` this weight plays at int4, or None."""
        roles = self.eight_bit
        if "lm_head" in roles and (lm_head or (self.lm_head is not None and _weight_of(self.lm_head) is source)):
            return "lm_head"
        if "embeddings" in roles and id(source) in tables:
            return "embeddings"
        if "sensitive_layers" in roles and (name := _checkpoint_name(source.const_value)):
            match = _LAYER_TENSOR.search(name)
            if match and sensitive_layer(int(match.group(1)), self.layers):
                return "sensitive_layers"
        return None

    def _quantize(self, graph: ir.Graph, source: ir.Value, transposed: bool, k: int, n: int,
                  block_format: BlockFormat) -> _Quantized:
        """``source`` is the weight as stored: [k, n] (x @ w), or [n, k] when ``transposed``."""
        blocks = -(-k // block_format.block_size)
        scale = self._awq_scale(source, k, block_format)
        parts = _Blocks(source.const_value, transposed, block_format, scale)
        dtype = source.dtype

        def initializer(part: str, suffix: str, part_dtype: ir.DataType, shape: list[int]) -> ir.Value:
            tensor = ir.LazyTensor(lambda: parts.part(part), dtype=part_dtype, shape=ir.Shape(shape))
            value = ir.Value(name=unique_initializer_name(graph, f"{source.name}.{suffix}"), const_value=tensor,
                             type=ir.TensorType(part_dtype), shape=ir.Shape(shape))
            graph.register_initializer(value)
            return value

        blob = initializer("blob", f"int{block_format.bits}", ir.DataType.UINT8, [n, blocks, block_format.blob_width()])
        scales = initializer("scales", "scales", dtype, [n, blocks])
        if not block_format.zero_points:
            zero_points = None
        elif block_format.float_zero_points:
            zero_points = initializer("zero_points", "zero_points", dtype, [n, blocks])
        else:
            zero_points = initializer("zero_points", "zero_points", ir.DataType.UINT8, [n, block_format.zero_point_width(blocks)])
        divisor = None
        if scale is not None:
            # The layers that read one input share one s (activation_aware_scales): one initializer.
            divisor = self._divisors.get((id(scale), dtype))
            if divisor is None:
                divisor = ir.Value(name=unique_initializer_name(graph, f"{source.name}.awq_divisor"),
                                   const_value=ir.tensor(scale.astype(dtype.numpy())))
                graph.register_initializer(divisor)
                self._divisors[(id(scale), dtype)] = divisor
        return _Quantized(blob, scales, zero_points, n, k, block_format, divisor)

    def _awq_scale(self, source: ir.Value, k: int, block_format: BlockFormat) -> np.ndarray | None:
        """AWQ's measured s [k] for a MatMul weight of an int4 package read from a decoder linear
        layer's checkpoint tensor (``exporter.load.activation_aware_scales``; a graph not read from
        a checkpoint: by the initializer's name), else None. An 8-bit role takes its s too, stored
        ``W * s`` at 8 bits: a value projection's group then divides its input once, and on the
        real Gemma 3 270M scaling the 8-bit down projections too gave KL 0.230 against 0.234
        unscaled (Qwen2.5-Coder 0.5B: 0.0330 against 0.0329)."""
        if self.options.method != "awq" or self.bits != 4 or not self.input_scales:
            return None
        name = _checkpoint_name(source.const_value) or source.name
        scale = self.input_scales.get(name)
        if scale is None or scale.shape != (k,):
            return None
        self.scales_found.add(name)
        return scale

    def _replace_matmul(self, graph: ir.Graph, node: ir.Node, q: _Quantized) -> None:
        new_nodes, x = [], node.inputs[0]
        key = (id(x), id(q.input_divisor))
        if q.input_divisor is not None and key in self._divided:
            x = self._divided[key]  # a layer sharing its input and s with one already divided
        elif q.input_divisor is not None:
            division = ir.node("Div", [x, q.input_divisor], name=f"{node.name}.awq")
            division.metadata_props[AWQ_DIVISION] = "true"
            self.awq_divisions += 1
            new_nodes.append(division)
            divided = division.outputs[0]
            divided.dtype, divided.shape = x.dtype, x.shape
            x = self._divided[key] = divided
        inputs = [x, q.blob, q.scales] + ([q.zero_points] if q.zero_points is not None else [])
        attributes = {"K": q.k, "N": q.n, "bits": q.format.bits, "block_size": q.format.block_size}
        if self.options.accuracy_level:
            attributes["accuracy_level"] = self.options.accuracy_level
        new_nodes.append(ir.node("MatMulNBits", inputs, attributes, domain=MICROSOFT,
                                 name=f"{node.name}.int{q.format.bits}"))
        _swap(graph, node, new_nodes)

    def _replace_gather(self, graph: ir.Graph, node: ir.Node, q: _Quantized) -> None:
        block = q.format.block_size
        blocks = q.blob.shape[1]
        flat_shape = ir.Value(name=unique_initializer_name(graph, f"{q.blob.name}.rows"),
                              const_value=ir.tensor(np.array([q.n, blocks * q.format.blob_width()], dtype=np.int64)))
        graph.register_initializer(flat_shape)
        rows = ir.node("Reshape", [q.blob, flat_shape], name=f"{node.name}.rows")
        inputs = [rows.outputs[0], node.inputs[1], q.scales] + ([q.zero_points] if q.zero_points is not None else [])
        gather = ir.node(
            "GatherBlockQuantized", inputs,
            {"bits": q.format.bits, "block_size": block, "gather_axis": 0, "quantize_axis": 1},
            domain=MICROSOFT, name=f"{node.name}.int{q.format.bits}",
        )
        new_nodes = [rows, gather]
        if q.k % block:  # blocks are padded; the padding decodes to garbage
            ends = ir.Value(name=unique_initializer_name(graph, f"{q.blob.name}.width"),
                            const_value=ir.tensor(np.array([q.k], dtype=np.int64)))
            starts = ir.Value(name=unique_initializer_name(graph, f"{q.blob.name}.start"),
                              const_value=ir.tensor(np.array([0], dtype=np.int64)))
            axes = ir.Value(name=unique_initializer_name(graph, f"{q.blob.name}.last_axis"),
                            const_value=ir.tensor(np.array([-1], dtype=np.int64)))
            for value in (ends, starts, axes):
                graph.register_initializer(value)
            new_nodes.append(ir.node("Slice", [gather.outputs[0], starts, ends, axes], name=f"{node.name}.unpad"))
        _swap(graph, node, new_nodes)


def _swap(graph: ir.Graph, old: ir.Node, new_nodes: list[ir.Node]) -> None:
    result, original = new_nodes[-1].outputs[0], old.outputs[0]
    # An inlined function's MatMul (a Linear with a bias) leaves its output untyped: it has its
    # first input's type (MatMul's A, Gather's table), which the serializer needs.
    result.dtype = original.dtype or old.inputs[0].dtype
    result.shape = original.shape
    ir.convenience.replace_nodes_and_values(graph, old, [old], new_nodes, [original], [result])


def unique_initializer_name(graph: ir.Graph, name: str) -> str:
    if name not in graph.initializers:
        return name
    index = 1
    while f"{name}.{index}" in graph.initializers:
        index += 1
    return f"{name}.{index}"


def _is_weight(value: ir.Value | None) -> bool:
    return (
        value is not None and value.is_initializer() and value.const_value is not None
        and value.shape is not None and len(value.shape) == 2 and value.dtype in _FLOATS
    )


_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16)


def _is_experts_weight(value: ir.Value | None) -> bool:
    """A constant [experts, out, in] float weight."""
    return (
        value is not None and value.is_initializer() and value.const_value is not None
        and value.shape is not None and len(value.shape) == 3 and value.dtype in _FLOATS
    )


def _matmul_weight(node: ir.Node) -> tuple[ir.Value, bool] | None:
    """(initializer, transposed) for MatMul(x, w) or MatMul(x, Transpose(w, perm=[1, 0]))."""
    weight = node.inputs[1]
    if _is_weight(weight):
        return weight, False
    producer = weight.producer() if weight is not None else None
    if (
        producer is not None and producer.op_type == "Transpose" and producer.domain == ""
        and list(producer.attributes.get_ints("perm", [1, 0])) == [1, 0] and _is_weight(producer.inputs[0])
    ):
        return producer.inputs[0], True
    return None


def _checkpoint_name(tensor: ir.TensorProtocol | None) -> str | None:
    """The checkpoint tensor a lazy initializer is made from, through the steps passes put on it
    (transposes, reshapes, casts, the residual stream's power-of-two scale); None for another."""
    from exporter.weights.placeholders import WeightReader

    while isinstance(tensor, ir.LazyTensor):
        made = tensor.raw
        if isinstance(made, WeightReader):
            return made.tensor_name
        tensor = getattr(made, "tensor", None)
    return None


def _weight_of(matmul: ir.Node) -> ir.Value | None:
    found = _matmul_weight(matmul)
    return found[0] if found else None


def _lm_head(graph: ir.Graph) -> ir.Node | None:
    """The MatMul that computes the ``logits`` output: found from it back through the first
    input of what follows the head (a soft cap's Div/Tanh/Mul, a cast)."""
    value = next((v for v in graph.outputs if v.name == "logits"), None)
    while value is not None and (node := value.producer()) is not None:
        if node.op_type == "MatMul" and node.domain == "":
            return node if _matmul_weight(node) is not None else None
        value = node.inputs[0] if node.inputs else None
    return None


def _table_of(node: ir.Node) -> ir.Value | None:
    table = node.inputs[0]
    if not _is_weight(table) or node.attributes.get_int("axis", 0) != 0:
        return None
    return table


def _transposed_twin(weight: ir.Value, tables) -> ir.Value | None:
    """The gathered table whose transpose ``weight`` is (constant folding copies a small tied
    LM head out of its embedding)."""
    k, n = weight.shape
    for table in tables:
        if tuple(table.shape) == (n, k) and table.dtype == weight.dtype:
            if np.array_equal(table.const_value.numpy(), weight.const_value.numpy().T):
                return table
    return None
