"""Where a decode step's time goes: ONNX Runtime's profiler on one package's decoder (CPU EP), one
new token over a past of --past tokens, time per op type per step (not a test).

    python scripts/profile_decode.py PACKAGE [--past 128] [--steps 20]

The package is one this exporter wrote (its export_report.json gives the KV layout). The decoder
runs through a plain InferenceSession with the graph's own inputs, so GenAI's own overhead
(sampling, KV bookkeeping) is not in these numbers: compare their total with GenAI's decode time
to see it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import onnxruntime as ort
import torch

from exporter.layout import DecoderLayout, KvLayer
from exporter.trace import input_names, make_inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("package", type=Path)
    parser.add_argument("--past", type=int, default=128, help="tokens already in the KV cache")
    parser.add_argument("--steps", type=int, default=20, help="decode steps profiled (after 3 warm-up steps)")
    args = parser.parse_args()

    report = json.loads((args.package / "export_report.json").read_text())
    fields = dict(report["layout"])
    fields["kv_layers"] = tuple(KvLayer(**layer) for layer in fields["kv_layers"])
    layout = DecoderLayout(**fields)
    model_file = args.package / report["sessions"]["decoder"]["filename"]

    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(Path("/tmp") / "decode_profile")
    session = ort.InferenceSession(str(model_file), options, providers=["CPUExecutionProvider"])
    dtype = {"tensor(float16)": torch.float16}.get(session.get_inputs()[3].type, torch.float32)
    inputs = make_inputs(layout, 1, 1, args.past, dtype=dtype, generator=torch.Generator().manual_seed(0))
    feeds = dict(zip(input_names(layout), [t.numpy() for t in (*inputs[:3], *inputs[3])], strict=True))
    for _ in range(3):
        session.run(None, feeds)
    walls = []
    for _ in range(args.steps):
        start = time.perf_counter()
        session.run(None, feeds)
        walls.append(time.perf_counter() - start)
    profile = json.loads(Path(session.end_profiling()).read_text())

    per_op: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    runs = 0
    for event in profile:
        if event.get("cat") == "Session" and event.get("name") == "model_run":
            runs += 1
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            op = event["args"]["op_name"]
            per_op[op] += event["dur"] / 1000
            counts[op] += 1
    total = sum(per_op.values())
    print(f"\n## Decode step of {args.package.name}: past {args.past}, {runs} runs "
          f"(median wall {statistics.median(walls) * 1000:.1f} ms per step)\n")
    print("| op type | nodes per step | ms per step | share |\n|---|---:|---:|---:|")
    for op, ms in sorted(per_op.items(), key=lambda item: -item[1]):
        print(f"| {op} | {counts[op] // runs} | {ms / runs:.2f} | {ms / total:.0%} |")
    print(f"| **all kernels** | | **{total / runs:.2f}** | |")


if __name__ == "__main__":
    main()
