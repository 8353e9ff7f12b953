"""Measure which block-quantized weight formats an EP's kernels run: the facts behind a profile's
``weight_bit_widths``.

Each case is one ``com.microsoft`` node, ``MatMulNBits`` (x @ dequantized w) or
``GatherBlockQuantized`` (rows of a dequantized table), at 4 or 8 bits, without zero points, with
packed integer ones, or (MatMulNBits only: GatherBlockQuantized types its zero points as its data)
with float ones of the activation dtype (HQQ's, ``weight_float_zero_points``), computing in fp32 or fp16, run on the EP and compared with numpy's dequantization of the
same blob (``scale * (q - zero_point)``, zero point 2^(bits-1) when absent). A case is "exact"
within the activation dtype's rounding, "wrong" past it, "refused" where the session will not
build or run, and "moved" where ONNX Runtime placed the node on another EP (the EP does not
implement it).

    python scripts/probe_quantized_kernels.py --ep webgpu      # needs scripts/install_webgpu_stack.sh
    python scripts/probe_quantized_kernels.py --ep cpu --json
    python scripts/probe_quantized_kernels.py --ep cpu --time   # decode-sized timings per zero-point form

Re-run it on each new release of an EP plugin; where a fact changed, change the profile
(``ep_profiles/registry.py``).
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
from exporter.verify.ep_runtime import EpUnavailable, inference_session, placement  # noqa: E402

# Relative to the output's largest |value|: fp32 kernels agree to ~1e-6; fp16 rounds at ~1e-3 and
# sums of K=256 products add a little. A misread blob or zero point is off by O(1).
EXACT = {"fp32": 1e-4, "fp16": 1e-2}
_NUMPY = {"fp32": np.float32, "fp16": np.float16}
_ONNX = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16}
K, N, BLOCK = 256, 64, 32
# MatMulNBits: one row (decode) and a prompt's worth (WebGPU picks other kernels past a few rows).
MATMUL_ROWS = (1, 40)
GATHER_ROWS = 5


@dataclass
class Case:
    op: str
    bits: int
    zero_points: str  # "none", "packed" (integers, two per byte at 4 bits) or "float"
    dtype: str
    rows: int
    result: str = ""
    max_error: float | None = None


def _blocks(rng, bits: int, zero_points: str, rows: int, dtype: str):
    """A random quantized [rows, K] matrix: packed blob [rows, blocks, BLOCK*bits/8], scales
    [rows, blocks], zero points as the node takes them (packed integers, or floats [rows, blocks]),
    and its numpy dequantization."""
    blocks = K // BLOCK
    top = 2 ** bits
    q = rng.integers(0, top, (rows, blocks, BLOCK), dtype=np.uint8)
    scales = (rng.random((rows, blocks)) * 0.1 + 0.01).astype(_NUMPY[dtype])
    if zero_points == "float":  # fractional, as HQQ's are: a kernel rounding them is caught
        zero = (rng.random((rows, blocks)) * (top - 1)).astype(_NUMPY[dtype])
    elif zero_points == "packed":
        zero = rng.integers(0, top, (rows, blocks), dtype=np.uint8)
    else:
        zero = np.full((rows, blocks), top // 2, np.uint8)
    weights = (scales.astype(np.float32)[..., None] * (q.astype(np.float32) - zero.astype(np.float32)[..., None])).reshape(rows, K)
    blob = q[..., 0::2] | (q[..., 1::2] << 4) if bits == 4 else q
    if zero_points == "packed" and bits == 4:
        zero = zero[:, 0::2] | (zero[:, 1::2] << 4)
    return blob, scales, zero, weights


def _model(case: Case, rng) -> tuple[onnx.ModelProto, dict[str, np.ndarray], np.ndarray]:
    blob, scales, zero, weights = _blocks(rng, case.bits, case.zero_points, N, case.dtype)
    inits = [onnx.numpy_helper.from_array(scales, "scales")]
    if case.op == "MatMulNBits":
        x = rng.standard_normal((1, case.rows, K)).astype(_NUMPY[case.dtype])
        inits.append(onnx.numpy_helper.from_array(blob, "blob"))
        inputs = ["x", "blob", "scales"] + (["zero"] if case.zero_points != "none" else [])
        node = helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=K, N=N,
                                bits=case.bits, block_size=BLOCK)
        graph_input = helper.make_tensor_value_info("x", _ONNX[case.dtype], [1, case.rows, K])
        feed, expected = {"x": x}, x.astype(np.float32) @ weights.T
        shape = [1, case.rows, N]
    else:
        ids = rng.integers(0, N, (1, case.rows)).astype(np.int64)
        inits.append(onnx.numpy_helper.from_array(blob.reshape(N, -1), "blob"))
        inputs = ["blob", "ids", "scales"] + (["zero"] if case.zero_points != "none" else [])
        node = helper.make_node("GatherBlockQuantized", inputs, ["y"], domain="com.microsoft", bits=case.bits,
                                block_size=BLOCK, gather_axis=0, quantize_axis=1)
        graph_input = helper.make_tensor_value_info("ids", TensorProto.INT64, [1, case.rows])
        feed, expected = {"ids": ids}, weights[ids]
        shape = [1, case.rows, K]
    if case.zero_points != "none":
        inits.append(onnx.numpy_helper.from_array(zero, "zero"))
    graph = helper.make_graph([node], case.op, [graph_input],
                              [helper.make_tensor_value_info("y", _ONNX[case.dtype], shape)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model, feed, expected


def run_case(case: Case, profile, folder: Path, rng) -> Case:
    model, feed, expected = _model(case, rng)
    path = folder / f"{case.op}-{case.bits}-{case.zero_points}-{case.dtype}-{case.rows}.onnx"
    onnx.save(model, path)
    try:
        session = inference_session(path, profile, {})
        got = session.run(None, feed)[0].astype(np.float32)
    except EpUnavailable:
        raise
    except Exception as error:  # noqa: BLE001 - a refused case is a measurement, not a failure
        case.result = f"refused: {str(error).splitlines()[0][:120]}"
        return case
    placed = placement(session)
    if case.op not in placed.get(profile.ort_provider, {}):
        case.result = "moved to " + ", ".join(ep for ep, ops in placed.items() if case.op in ops)
        return case
    if not np.isfinite(got).all():
        case.result, case.max_error = "wrong (non-finite)", float("inf")
        return case
    case.max_error = float(np.abs(got - expected).max() / max(np.abs(expected).max(), 1e-6))
    case.result = "exact" if case.max_error <= EXACT[case.dtype] else "wrong"
    return case


def probe(ep: str) -> list[Case]:
    profile = get_profile(ep)
    rng = np.random.default_rng(0)
    cases = [Case(op, bits, zero_points, dtype, rows)
             for op, all_rows, zero_point_kinds in (("MatMulNBits", MATMUL_ROWS, ("none", "packed", "float")),
                                                   ("GatherBlockQuantized", (GATHER_ROWS,), ("none", "packed")))
             for bits in (4, 8) for zero_points in zero_point_kinds for dtype in ("fp32", "fp16") for rows in all_rows]
    with tempfile.TemporaryDirectory() as folder:
        return [run_case(case, profile, Path(folder), rng) for case in cases]


TIMED_K, TIMED_N = 2048, 8192  # a decode step's projection of a ~2B model


def time_zero_point_forms(ep: str, runs: int = 20) -> list[tuple[int, str, float | None]]:
    """Milliseconds per one-row 4-bit MatMulNBits [TIMED_K x TIMED_N] at accuracy levels 0, 1
    and 4, for each zero-point form (an exact kernel can still be a slow one); None where ONNX
    Runtime placed the node on another EP."""
    import time

    profile = get_profile(ep)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 1, TIMED_K)).astype(np.float32)
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for level in (0, 1, 4):
            for zero_points in ("none", "packed", "float"):
                blocks = TIMED_K // BLOCK
                q = rng.integers(0, 16, (TIMED_N, blocks, BLOCK), dtype=np.uint8)
                inits = [onnx.numpy_helper.from_array(q[..., 0::2] | (q[..., 1::2] << 4), "blob"),
                         onnx.numpy_helper.from_array(rng.random((TIMED_N, blocks)).astype(np.float32), "scales")]
                if zero_points == "packed":
                    inits.append(onnx.numpy_helper.from_array(rng.integers(0, 256, (TIMED_N, blocks // 2), dtype=np.uint8), "zero"))
                elif zero_points == "float":
                    inits.append(onnx.numpy_helper.from_array((rng.random((TIMED_N, blocks)) * 15).astype(np.float32), "zero"))
                node = helper.make_node("MatMulNBits", ["x", "blob", "scales"] + (["zero"] if zero_points != "none" else []),
                                        ["y"], domain="com.microsoft", K=TIMED_K, N=TIMED_N, bits=4, block_size=BLOCK,
                                        accuracy_level=level)
                graph = helper.make_graph([node], "timed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, TIMED_K])],
                                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, TIMED_N])], initializer=inits)
                model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
                model.ir_version = 10
                path = Path(folder) / f"timed-{level}-{zero_points}.onnx"
                onnx.save(model, path)
                session = inference_session(path, profile, {})
                if "MatMulNBits" not in placement(session).get(profile.ort_provider, {}):
                    results.append((level, zero_points, None))  # another EP's kernel: not this one's time
                    continue
                for _ in range(3):
                    session.run(None, {"x": x})
                start = time.perf_counter()
                for _ in range(runs):
                    session.run(None, {"x": x})
                results.append((level, zero_points, (time.perf_counter() - start) / runs * 1e3))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", default="webgpu")
    parser.add_argument("--json", action="store_true", help="print the cases as JSON")
    parser.add_argument("--time", action="store_true",
                        help=f"time a one-row 4-bit MatMulNBits ({TIMED_K} x {TIMED_N}) per zero-point form instead")
    args = parser.parse_args(argv)
    try:
        timings = time_zero_point_forms(args.ep) if args.time else None
        cases = None if args.time else probe(args.ep)
    except UnknownProfileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except EpUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if timings is not None:
        print(f"{'accuracy level':<16}{'zero points':<13}{'ms per run':>10}")
        for level, zero_points, ms in timings:
            print(f"{level:<16}{zero_points:<13}{'placed on another EP' if ms is None else f'{ms:>10.2f}'}")
        return 0
    if args.json:
        print(json.dumps([asdict(c) for c in cases], indent=1))
        return 0
    print(f"{'op':<22}{'bits':>5}  {'zero points':<12}{'dtype':<6}{'rows':>5}{'max rel. error':>15}  result")
    for c in cases:
        error = "" if c.max_error is None else f"{c.max_error:.1e}"
        print(f"{c.op:<22}{c.bits:>5}  {c.zero_points:<12}{c.dtype:<6}{c.rows:>5}{error:>15}  {c.result}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
