"""Where a decode step's time goes: ONNX Runtime's profiler on one package's decoder (CPU EP), one
new token over a past of --past tokens, time per op type per step (not a test).

    python scripts/profile_decode.py PACKAGE [--past 128] [--steps 20]

The package may come from any exporter (this one's, mobius's, ONNX Runtime GenAI's builder): the
inputs are made from the decoder graph's own (``input_ids``, ``attention_mask``, ``position_ids``,
``past_key_values.*`` with the past length where the dim is symbolic). The decoder runs through a
plain InferenceSession, so GenAI's own overhead (sampling, KV bookkeeping) is not in these numbers:
compare their total with GenAI's decode time to see it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnxruntime as ort

_NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
                "tensor(int32)": np.int32}


def decode_feeds(session: ort.InferenceSession, past: int, vocab_size: int) -> dict[str, np.ndarray]:
    """One new token over ``past`` cached ones, batch 1, for the graph's own inputs."""
    rng = np.random.default_rng(0)
    feeds = {}
    for graph_input in session.get_inputs():
        name, dtype = graph_input.name, _NUMPY_TYPES.get(graph_input.type)
        if dtype is None:
            raise SystemExit(f"the decoder's input {name} is {graph_input.type}, which this script cannot make")
        if name == "input_ids":
            feeds[name] = rng.integers(0, vocab_size, (1, 1)).astype(dtype)
        elif name == "attention_mask":
            feeds[name] = np.ones((1, past + 1), dtype)
        elif name == "position_ids":
            feeds[name] = np.full((1, 1), past, dtype)
        elif name.startswith("past_key_values."):
            # [batch, kv heads, past, head dim]: the symbolic dims are the batch and the past.
            _, heads, _, head_dim = graph_input.shape
            feeds[name] = rng.standard_normal((1, heads, past, head_dim)).astype(dtype)
        else:
            raise SystemExit(f"the decoder has an input this script cannot make: {name} {graph_input.shape}")
    return feeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("package", type=Path)
    parser.add_argument("--past", type=int, default=128, help="tokens already in the KV cache")
    parser.add_argument("--steps", type=int, default=20, help="decode steps profiled (after 3 warm-up steps)")
    args = parser.parse_args()

    genai = json.loads((args.package / "genai_config.json").read_text())["model"]
    model_file = args.package / genai["decoder"]["filename"]

    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(Path("/tmp") / "decode_profile")
    session = ort.InferenceSession(str(model_file), options, providers=["CPUExecutionProvider"])
    feeds = decode_feeds(session, args.past, genai.get("vocab_size", 1000))
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
