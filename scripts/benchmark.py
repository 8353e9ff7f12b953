"""Export and generation benchmark (not a test): stage times and peak memory of one export, then
ONNX Runtime GenAI on CPU: time to first token for given prompt lengths and decode tokens/s.

    python scripts/benchmark.py                       # gemma-4-e2b-shape, prompts of 128 and 512
    python scripts/benchmark.py tiny-llama --prompt-lengths 32 64 --decode-tokens 16

Prompts are random token ids (fixed seed), so the numbers measure the graph, not the text.
Each TTFT is the median of --repeats runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exporter import export  # noqa: E402
from exporter.stages import StageRecord  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="gemma-4-e2b-shape", help="preset, folder or hub id")
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, help="keep the package here (default: a temporary folder)")
    return parser.parse_args()


def benchmark_export(model: str, output: Path) -> tuple[list[StageRecord], object]:
    records: list[StageRecord] = []

    def on_stage(name: str, record: StageRecord | None) -> None:
        if record is None:
            print(f"  {name} ...", file=sys.stderr, flush=True)
        else:
            records.append(record)

    package = export(model, ep="cpu", output_dir=output, overwrite=True, on_stage=on_stage)
    return records, package


def benchmark_generation(package_dir: Path, vocab_size: int, prompt_lengths, decode_tokens, repeats):
    import onnxruntime_genai as og

    model = og.Model(str(package_dir))
    rng = np.random.default_rng(0)
    rows = []
    for length in prompt_lengths:
        prompt = rng.integers(3, vocab_size, size=(1, length), dtype=np.int32)
        ttfts, decode_rates = [], []
        for _ in range(repeats):
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=length + decode_tokens, do_sample=False)
            generator = og.Generator(model, params)
            start = time.perf_counter()
            generator.append_tokens(prompt)  # runs prefill and picks the first token
            generator.get_next_tokens()
            ttfts.append(time.perf_counter() - start)
            start = time.perf_counter()
            steps = 0
            while not generator.is_done() and steps < decode_tokens:
                generator.generate_next_token()
                steps += 1
            decode_rates.append(steps / (time.perf_counter() - start))
            del generator
        rows.append((length, statistics.median(ttfts), statistics.median(decode_rates)))
    return rows


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        output = args.output or Path(scratch) / "package"
        wall = time.perf_counter()
        records, package = benchmark_export(args.model, output)
        wall = time.perf_counter() - wall
        print(f"\n## Export of {args.model} ({package.layout.num_layers} layers), wall {wall:.1f} s\n")
        print("| stage | seconds | peak RSS GiB |\n|---|---:|---:|")
        for r in records:
            print(f"| {r.name} | {r.seconds:.1f} | {r.peak_rss_bytes / 2**30:.2f} |")
        print(f"| **total** | **{sum(r.seconds for r in records):.1f}** | "
              f"**{max(r.peak_rss_bytes for r in records) / 2**30:.2f}** |")
        rows = benchmark_generation(
            output, package.layout.vocab_size, args.prompt_lengths, args.decode_tokens, args.repeats
        )
        print(f"\n## ONNX Runtime GenAI, CPU, fp32 (median of {args.repeats})\n")
        print(f"| prompt tokens | TTFT ms | decode tokens/s ({args.decode_tokens} tokens) |\n|---:|---:|---:|")
        for length, ttft, rate in rows:
            print(f"| {length} | {ttft * 1000:.0f} | {rate:.1f} |")


if __name__ == "__main__":
    main()
