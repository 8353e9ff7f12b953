"""Measure what an EP's attention kernels honour: the facts behind a profile's ``attention_kernel``.

Each case is one ``com.microsoft`` node (GroupQueryAttention or MultiHeadAttention) run on the EP
and compared with a numpy reference of what the op's spec says it computes, on the same inputs.
Where the EP's output instead matches the reference without the feature (no window, no softcap),
the feature is reported "ignored"; an error or a refused session is reported as such. Scores are
made large (queries and keys scaled up) so that a dropped softcap or window shows.

    python scripts/probe_attention_kernels.py --ep webgpu      # needs scripts/install_webgpu_stack.sh
    python scripts/probe_attention_kernels.py --ep cpu --json

Re-run it on each new release of an EP plugin; where a fact changed, change the profile
(``ep_profiles/registry.py``) and the dated table in docs/measurements.md ("What the WebGPU attention kernel
honours").
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ep_profiles import get_profile  # noqa: E402
from ep_profiles.registry import UnknownProfileError  # noqa: E402
from exporter.verify.ep_runtime import EpUnavailable, inference_session  # noqa: E402

# An exact kernel agrees with the reference to float32 rounding (~1e-6 at these sizes); a dropped
# feature differs by O(1).
EXACT = {"fp32": 1e-4, "fp16": 2e-2}
HEADS, KV_HEADS, HEAD = 4, 2, 32
_ONNX_TYPES = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16}
_NUMPY_TYPES = {"fp32": np.float32, "fp16": np.float16}


@dataclass
class Result:
    case: str
    verdict: str  # "honoured", "ignored", "wrong", "fails at run time", "refused"
    error: float | None  # max |EP - reference|
    error_without: float | None  # max |EP - reference without the feature|, where that tells
    detail: str = ""


def _value_info(name: str, elem: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def gqa_model(feeds: dict[str, np.ndarray], attributes: dict, inputs: list[str], dtype: str) -> onnx.ModelProto:
    """One GroupQueryAttention node over ``inputs`` (its input names in schema order, "" for none)."""
    node = helper.make_node("GroupQueryAttention", inputs, ["output", "present_key", "present_value"],
                            domain="com.microsoft", **attributes)
    graph_inputs = [_value_info(name, _elem(feeds[name]), list(feeds[name].shape)) for name in inputs if name]
    outputs = [_value_info("output", _ONNX_TYPES[dtype], None)] + [
        _value_info(name, _elem(feeds[past]), None) for name, past in (("present_key", "past_key"), ("present_value", "past_value"))]
    return _model(helper.make_graph([node], "gqa", graph_inputs, outputs))


def mha_model(feeds: dict[str, np.ndarray], dtype: str) -> onnx.ModelProto:
    node = helper.make_node("MultiHeadAttention", ["query", "key", "value", "", "", "attention_bias"], ["output"],
                            domain="com.microsoft", num_heads=HEADS)
    graph_inputs = [_value_info(name, _elem(value), list(value.shape)) for name, value in feeds.items()]
    return _model(helper.make_graph([node], "mha", graph_inputs, [_value_info("output", _ONNX_TYPES[dtype], None)]))


def _elem(value: np.ndarray) -> int:
    return helper.np_dtype_to_tensor_dtype(value.dtype)


def _model(graph) -> onnx.ModelProto:
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


def reference_attention(query, keys, values, positions, real, window=0, softcap=0.0, sink=None, scale=None):
    """numpy attention of query [b, s, H*d] over keys/values [b, KV, slots, d]: query i of row b at
    ``positions[b, i]`` sees slots j <= position, j < real[b] and, with a window, j > position - window.
    ``sink`` [H]: a per-head logit that joins the softmax's denominator only."""
    batch, seq, width = query.shape
    kv, head = keys.shape[1], keys.shape[3]
    heads = width // head
    q = query.astype(np.float64).reshape(batch, seq, heads, head).transpose(0, 2, 1, 3)
    k = np.repeat(keys.astype(np.float64), heads // kv, axis=1)
    v = np.repeat(values.astype(np.float64), heads // kv, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) * (scale if scale is not None else head**-0.5)
    if softcap > 0:
        scores = softcap * np.tanh(scores / softcap)
    slots = np.arange(keys.shape[2])
    visible = (slots[None, None, :] <= positions[:, :, None]) & (slots[None, None, :] < real[:, None, None])
    if window > 0:
        visible &= slots[None, None, :] > positions[:, :, None] - window
    scores = np.where(visible[:, None], scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    if sink is not None:
        top = np.maximum(top, sink[None, :, None, None])
    weights = np.exp(scores - top)
    total = weights.sum(-1, keepdims=True)
    if sink is not None:
        total = total + np.exp(sink[None, :, None, None] - top)
    out = (weights / total) @ v
    return out.transpose(0, 2, 1, 3).reshape(batch, seq, width)


class Probe:
    def __init__(self, ep: str, scratch: Path):
        self.profile = get_profile(ep)
        self.scratch = scratch
        self.count = 0

    def run(self, model: onnx.ModelProto, feeds: dict[str, np.ndarray], provider_options=None,
            shared_buffer: bool = False) -> np.ndarray:
        """The node's output on the EP. ``shared_buffer``: bound as ONNX Runtime GenAI binds a
        shared KV buffer, every tensor in the EP's memory and present_key/value the very buffers
        past_key/value are (run twice, so that a captured graph is replayed)."""
        self.count += 1
        path = self.scratch / f"case{self.count}.onnx"
        onnx.save(model, path)
        session = inference_session(path, self.profile, provider_options or {})
        if not shared_buffer:
            return np.asarray(session.run(["output"], feeds)[0], dtype=np.float32)
        import onnxruntime as ort

        device = self.profile.genai_provider or "cpu"
        values = {name: ort.OrtValue.ortvalue_from_numpy(value, device, 0) for name, value in feeds.items()}
        query = feeds["query"]
        output = ort.OrtValue.ortvalue_from_shape_and_type(list(query.shape), query.dtype, device, 0)
        binding = session.io_binding()
        for name, value in values.items():
            binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output("output", output)
        binding.bind_ortvalue_output("present_key", values["past_key"])
        binding.bind_ortvalue_output("present_value", values["past_value"])
        for _ in range(2):
            session.run_with_iobinding(binding)
        return np.asarray(output.numpy(), dtype=np.float32)

    def compare(self, case: str, make, feeds, want, without=None, dtype="fp32", provider_options=None,
                shared_buffer=False, bound=None) -> Result:
        """Run ``make()`` on the EP: "honoured" within the dtype's bound of ``want``; "ignored" where it
        is instead within that bound of ``without`` (the reference without the feature)."""
        try:
            got = self.run(make(), feeds, provider_options, shared_buffer)
        except EpUnavailable:  # no EP to probe: not a fact about its kernel
            raise
        except Exception as error:  # a refused session or a failed run are both facts to report
            message = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
            refused = "NOT_IMPLEMENTED" in message or "not supported" in message.lower() or "Load model" in message
            return Result(case, "refused" if refused else "fails at run time", None, None, message)
        if not np.isfinite(got).all():
            return Result(case, "wrong", float("nan"), None, "output not finite")
        error = float(np.abs(got - want).max())
        error_without = float(np.abs(got - without).max()) if without is not None else None
        bound = bound or EXACT[dtype]
        if error <= bound:
            verdict = "honoured"
        elif error_without is not None and error_without <= bound:
            verdict = "ignored"
        else:
            verdict = "wrong"
        return Result(case, verdict, error, error_without)


def _random(rng, shape, dtype="fp32", scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(_NUMPY_TYPES[dtype])


def _gqa_feeds(rng, seq, new, past_slots, real, dtype="fp32", scale=1.0):
    return {
        "query": _random(rng, (1, seq, HEADS * HEAD), dtype, scale),
        "key": _random(rng, (1, new, KV_HEADS * HEAD), dtype, scale),
        "value": _random(rng, (1, new, KV_HEADS * HEAD), dtype),
        "past_key": _random(rng, (1, KV_HEADS, past_slots, HEAD), dtype, scale),
        "past_value": _random(rng, (1, KV_HEADS, past_slots, HEAD), dtype),
        "seqlens_k": np.array([real - 1], np.int32),
        "total_sequence_length": np.array(real, np.int32),
    }


_GQA_INPUTS = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"]


def _cache(feeds, real):
    """The present KV the kernel should leave: the past's real slots, then the new tokens."""
    new = feeds["key"].shape[1]
    keys, values = feeds["past_key"].copy(), feeds["past_value"].copy()
    slots = max(keys.shape[2], real)
    if slots > keys.shape[2]:
        pad = ((0, 0), (0, 0), (0, slots - keys.shape[2]), (0, 0))
        keys, values = np.pad(keys, pad), np.pad(values, pad)
    keys[:, :, real - new:real] = feeds["key"].reshape(1, new, KV_HEADS, HEAD).transpose(0, 2, 1, 3)
    values[:, :, real - new:real] = feeds["value"].reshape(1, new, KV_HEADS, HEAD).transpose(0, 2, 1, 3)
    return keys, values


def _gqa_reference(feeds, real, **features):
    seq = feeds["query"].shape[1]
    keys, values = _cache(feeds, real)
    positions = (real - seq + np.arange(seq))[None]
    return reference_attention(feeds["query"], keys, values, positions, np.array([real]), **features)


def probe_prefill_rows(probe: Probe, rows: int, dtype: str) -> Result:
    """A first prompt of ``rows`` tokens: plain causal attention, no window, no softcap."""
    rng = np.random.default_rng(rows)
    feeds = _gqa_feeds(rng, rows, rows, 0, rows, dtype)
    want = _gqa_reference(feeds, rows)
    return probe.compare(f"GQA prefill, {rows} query rows, {dtype}",
                         lambda: gqa_model(feeds, _attributes(), _GQA_INPUTS, dtype), feeds, want, dtype=dtype)


def _attributes(**extra):
    return {"num_heads": HEADS, "kv_num_heads": KV_HEADS, **extra}


def probe_window(probe: Probe, layout: str, capture: bool = False) -> Result:
    """local_window_size 16 at a decode step 40 tokens past the window. ``layout``: "separate" (a past
    of the real tokens only; present one longer), "shared" (GenAI's: past and present one buffer of
    max_length slots, real tokens first), "kv-shared" (the shared buffer and no new K/V: a layer
    reading another's cache)."""
    window, real, buffer = 16, 56, 64
    rng = np.random.default_rng(7)
    new = 0 if layout == "kv-shared" else 1
    past = real - new if layout == "separate" else buffer
    feeds = _gqa_feeds(rng, 1, new, past, real, scale=2.0)
    want = _gqa_reference(feeds, real, window=window)
    without = _gqa_reference(feeds, real)
    options = probe.profile.genai_provider_options(graph_capture=capture)
    label = f"GQA local_window_size, {layout} buffer" + (", graph capture" if capture else "")
    return probe.compare(label, lambda: gqa_model(feeds, _attributes(local_window_size=window), _GQA_INPUTS, "fp32"),
                         feeds, want, without, provider_options=options, shared_buffer=layout != "separate")


def probe_softcap(probe: Probe) -> Result:
    rng = np.random.default_rng(3)
    feeds = _gqa_feeds(rng, 8, 8, 0, 8, scale=3.0)  # scores of tens: a cap of 5 bends them all
    want, without = _gqa_reference(feeds, 8, softcap=5.0), _gqa_reference(feeds, 8)
    return probe.compare("GQA softcap", lambda: gqa_model(feeds, _attributes(softcap=5.0), _GQA_INPUTS, "fp32"),
                         feeds, want, without)


def probe_head_sink(probe: Probe, dtype: str) -> Result:
    rng = np.random.default_rng(5)
    feeds = _gqa_feeds(rng, 8, 8, 0, 8, dtype)
    feeds["head_sink"] = _random(rng, (HEADS,), dtype, 2.0)
    want = _gqa_reference(feeds, 8, sink=feeds["head_sink"].astype(np.float64))
    without = _gqa_reference(feeds, 8)
    inputs = _GQA_INPUTS + ["", "", "", "", "head_sink"]
    return probe.compare(f"GQA head_sink, {dtype}", lambda: gqa_model(feeds, _attributes(), inputs, dtype),
                         feeds, want, without, dtype=dtype)


def _rotary_caches(positions: int):
    inverse = 10000.0 ** (-np.arange(0, HEAD, 2) / HEAD)
    angles = np.arange(positions)[:, None] * inverse[None]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _rotate(x, heads, cos, sin):
    """transformers' rotate_half rotary of x [1, seq, heads * HEAD] at positions 0 .. seq - 1."""
    seq = x.shape[1]
    shaped = x.astype(np.float64).reshape(1, seq, heads, HEAD)
    c = np.concatenate([cos[:seq], cos[:seq]], -1)[None, :, None]
    s = np.concatenate([sin[:seq], sin[:seq]], -1)[None, :, None]
    half = HEAD // 2
    turned = np.concatenate([-shaped[..., half:], shaped[..., :half]], -1)
    return (shaped * c + turned * s).reshape(x.shape).astype(np.float32)


def probe_qk_norm(probe: Probe, epsilon_attribute: str, dtype: str = "fp32", scale: float = 1.0) -> Result:
    """Fused per-head RMS norms of query and new key (weights q_norm_weight, k_norm_weight [head]),
    then the rotary (a kernel may take the norms only with do_rotary), epsilon 0.5 (large, so that
    an epsilon read from the wrong attribute shows). ``scale``: the projections' magnitude (300 in
    fp16: a sum of squares past fp16's range, as real q/k projections reach)."""
    rng = np.random.default_rng(11)
    feeds = _gqa_feeds(rng, 8, 8, 0, 8, dtype, scale)
    cos, sin = _rotary_caches(64)
    feeds["cos_cache"], feeds["sin_cache"] = cos, sin
    feeds["q_norm_weight"] = (_random(rng, (HEAD,), scale=0.5) + 1).astype(_NUMPY_TYPES[dtype])
    feeds["k_norm_weight"] = (_random(rng, (HEAD,), scale=0.5) + 1).astype(_NUMPY_TYPES[dtype])
    cos, sin = cos.astype(_NUMPY_TYPES[dtype]), sin.astype(_NUMPY_TYPES[dtype])
    feeds["cos_cache"], feeds["sin_cache"] = cos, sin
    epsilon = 0.5

    def rms(x, weight, heads):
        shaped = x.astype(np.float64).reshape(*x.shape[:-1], heads, HEAD)
        normed = shaped / np.sqrt((shaped**2).mean(-1, keepdims=True) + epsilon) * weight
        return normed.reshape(x.shape).astype(x.dtype)

    def rotated(query, key):
        return dict(feeds, query=_rotate(query, HEADS, cos, sin), key=_rotate(key, KV_HEADS, cos, sin))

    normed = rotated(rms(feeds["query"], feeds["q_norm_weight"], HEADS), rms(feeds["key"], feeds["k_norm_weight"], KV_HEADS))
    want, without = _gqa_reference(normed, 8), _gqa_reference(rotated(feeds["query"], feeds["key"]), 8)
    inputs = _GQA_INPUTS[:7] + ["cos_cache", "sin_cache", "", "", "", "", "", "q_norm_weight", "k_norm_weight"]
    attributes = _attributes(do_rotary=1, **{epsilon_attribute: epsilon})
    label = f"GQA q/k norm weights, epsilon as {epsilon_attribute}, {dtype}" + (f", q/k of {scale:g}" if scale != 1 else "")
    return probe.compare(label, lambda: gqa_model(feeds, attributes, inputs, dtype), feeds, want, without, dtype=dtype)


def probe_kv_bits(probe: Probe, bits: int) -> Result:
    """A decode step over an int8 KV cache (``bits`` 8: one value per byte; 4: two), per-tensor
    scales k_scale/v_scale; the reference reads the dequantized cache (bound 0.05: the new token's
    own rounding)."""
    rng = np.random.default_rng(13)
    feeds = _gqa_feeds(rng, 1, 1, 7, 8)
    levels = 127 if bits == 8 else 7
    scale = np.float32(3.0 / levels)
    for name in ("past_key", "past_value"):
        feeds[name] = np.clip(np.round(feeds[name] / scale), -levels, levels).astype(np.int8)
    dequantized = dict(feeds, past_key=feeds["past_key"] * scale, past_value=feeds["past_value"] * scale)
    if bits == 4:  # two 4-bit values per byte, low nibble first
        for name in ("past_key", "past_value"):
            pairs = (feeds[name] & 0x0F).astype(np.uint8).reshape(*feeds[name].shape[:-1], -1, 2)
            feeds[name] = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)
    feeds["k_scale"] = feeds["v_scale"] = np.array([scale], np.float32)
    want = _gqa_reference(dequantized, 8)
    inputs = _GQA_INPUTS[:7] + ["", "", "", "", "", "k_scale", "v_scale"]
    attributes = _attributes(kv_cache_bit_width=bits, k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR")
    return probe.compare(f"GQA kv_cache_bit_width {bits}", lambda: gqa_model(feeds, attributes, inputs, "fp32"),
                         feeds, want, bound=0.05)


def probe_mha_rows(probe: Probe, rows: int) -> Result:
    """MultiHeadAttention with an additive attention bias [1, 1, rows, rows] (a causal mask)."""
    rng = np.random.default_rng(17)
    feeds = {"query": _random(rng, (1, rows, HEADS * HEAD)), "key": _random(rng, (1, rows, HEADS * HEAD)),
             "value": _random(rng, (1, rows, HEADS * HEAD))}
    causal = np.tril(np.ones((rows, rows), bool))
    feeds["attention_bias"] = np.where(causal, 0.0, -1e4).astype(np.float32)[None, None]
    keys = feeds["key"].reshape(1, rows, HEADS, HEAD).transpose(0, 2, 1, 3)
    values = feeds["value"].reshape(1, rows, HEADS, HEAD).transpose(0, 2, 1, 3)
    want = reference_attention(feeds["query"], keys, values, np.arange(rows)[None], np.array([rows]))
    return probe.compare(f"MHA with attention_bias, {rows} query rows", lambda: mha_model(feeds, "fp32"), feeds, want)


def probe_all(ep: str) -> list[Result]:
    with tempfile.TemporaryDirectory() as scratch:
        probe = Probe(ep, Path(scratch))
        results = [probe_prefill_rows(probe, rows, dtype) for dtype in ("fp32", "fp16") for rows in (8, 31, 32, 33, 64)]
        results += [probe_window(probe, layout) for layout in ("separate", "shared", "kv-shared")]
        if probe.profile.graph_capture_option:
            results += [probe_window(probe, layout, capture=True) for layout in ("shared", "kv-shared")]
        results.append(probe_softcap(probe))
        results += [probe_head_sink(probe, dtype) for dtype in ("fp32", "fp16")]
        results += [probe_qk_norm(probe, attribute) for attribute in ("qk_norm_epsilon", "q_norm_epsilon")]
        results += [probe_qk_norm(probe, "qk_norm_epsilon", "fp16", scale) for scale in (1.0, 300.0)]
        results += [probe_kv_bits(probe, bits) for bits in (8, 4)]
        results += [probe_mha_rows(probe, rows) for rows in (8, 31, 32, 64)]
        return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", default="webgpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        results = probe_all(args.ep)
    except (EpUnavailable, UnknownProfileError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
        return 0
    width = max(len(r.case) for r in results)
    print(f"{'case':<{width}}  {'verdict':<17}  {'|EP-ref|':>9}  {'|EP-ref w/o|':>12}")
    for r in results:
        error = "" if r.error is None else f"{r.error:.2g}"
        without = "" if r.error_without is None else f"{r.error_without:.2g}"
        print(f"{r.case:<{width}}  {r.verdict:<17}  {error:>9}  {without:>12}  {r.detail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
