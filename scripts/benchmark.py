"""Export and generation benchmark (not a test): stage times and peak memory of one export, then
ONNX Runtime GenAI on CPU: time to first token for given prompt lengths and decode tokens/s.

    python scripts/benchmark.py                       # gemma-4-e2b-shape, prompts of 128 and 512
    python scripts/benchmark.py tiny-llama --prompt-lengths 32 64 --decode-tokens 16
    python scripts/benchmark.py --truncation          # prefill truncation on vs off, 128/512/1024
    python scripts/benchmark.py --fusions             # norm fusions on vs off (attention unchanged)
    python scripts/benchmark.py --attention           # GroupQueryAttention vs plain attention
    python scripts/benchmark.py --transposed-matmul   # weights read as stored vs transposed copies
    python scripts/benchmark.py --kv-shared-attention # KV-shared layers: GroupQueryAttention vs MatMul/Softmax
    python scripts/benchmark.py tiny-gemma-4 --graph-capture   # WebGPU decode, graph capture on vs off
    python scripts/benchmark.py tiny-gemma2 --attention-routing --prompt-lengths 24   # WebGPU attention routing
    python scripts/benchmark.py tiny-gemma-4 --max-lengths 1024 8192   # WebGPU decode at each max_length
    python scripts/benchmark.py --reexport            # re-export with other weights: graph cache (and the
                                                      # command line's replay) vs none

--truncation exports the model twice (last-token passes on, and off via full_logits), then times
time-to-first-token for both packages alternately in one run, next to the ratio predicted from
the FLOPs each variant's program does (counted by torch's FlopCounterMode on the FX programs).

Prompts are random token ids (fixed seed), so the numbers measure the graph, not the text.
Each TTFT is the median of --repeats runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exporter import export
from exporter.stages import StageRecord


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="gemma-4-e2b-shape", help="preset, folder or hub id")
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, help="keep the package here (default: a temporary folder)")
    parser.add_argument("--fusions", action="store_true",
                        help="compare TTFT with the profile's norm fusions on vs off (attention unchanged)")
    parser.add_argument("--attention", action="store_true",
                        help="compare GroupQueryAttention with plain attention: TTFT and decode at 512 tokens")
    parser.add_argument("--truncation", action="store_true",
                        help="compare prefill with the last-token passes on vs off (prompts 128/512/1024)")
    parser.add_argument("--transposed-matmul", action="store_true",
                        help="compare linear weights stored as transposed copies (a tied LM head twice) with "
                             "read as stored (FusedMatMul transB): load time, weights, TTFT and decode at the "
                             "longest prompt")
    parser.add_argument("--kv-shared-attention", action="store_true",
                        help="KV-shared layers' attention as GroupQueryAttention vs MatMul/Softmax (the cpu "
                             "profile's): TTFT and decode at the last --prompt-lengths, GenAI at prompt + decoded "
                             "tokens and at the packages' own max_length, alternating")
    parser.add_argument("--moe", action="store_true",
                        help="compare routed experts as MatMuls over gathered weights (plain) with ONNX Runtime's "
                             "MoE op: TTFT and decode at the longest prompt (default model: qwen3-moe-shape)")
    parser.add_argument("--reexport", action="store_true",
                        help="re-export another checkpoint of the model (a save_pretrained folder, and the model in "
                             "memory after a training step) with the graph cache vs without: wall seconds, "
                             "alternating, and whether the packages are byte-identical")
    parser.add_argument("--attention-routing", action="store_true",
                        help="WebGPU decode with attention as shipped vs GroupQueryAttention trusted with a softcap "
                             "(before) vs every layer attending in the graph, graph capture on")
    parser.add_argument("--graph-capture", action="store_true",
                        help="WebGPU EP (needs onnxruntime-ep-webgpu and an adapter): TTFT and decode with graph "
                             "capture on vs off (--no-graph-capture)")
    parser.add_argument("--max-lengths", type=int, nargs="+", metavar="N",
                        help="WebGPU EP with graph capture: TTFT and decode of packages exported with each "
                             "--max-length N, generating under their own max_length (GenAI then allocates N KV "
                             "slots), a table per --prompt-lengths; the model's context is raised to the largest N "
                             "where it is shorter")
    parser.add_argument("--precision", default="fp16", help="the --max-lengths and --attention-routing packages' precision (default fp16)")
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


def streamed_bytes_per_token(model_path: Path) -> int:
    """Weight bytes one decode step reads: every initializer but those only Gather reads (embedding
    tables, of which a step reads one row). A tied LM head's table counts: its MatMul reads it all."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    readers: dict[str, set[str]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.op_type)
    total = 0
    for tensor in graph.initializer:
        if readers.get(tensor.name, set()) <= {"Gather"}:
            continue
        elements = int(np.prod(tensor.dims)) if tensor.dims else 1
        total += elements * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return total


def genai_threads() -> int:
    """The intra-op threads ONNX Runtime GenAI gives a CPU session whose genai_config names none:
    half the logical cores, at most 16 (``Model::CreateSessionOptionsFromConfig``), so 1 on a 2-core
    machine."""
    import os

    return min(16, max(1, (os.cpu_count() or 2) // 2))


def gemv_bandwidth(megabytes: int = 512, repeats: int = 20) -> float:
    """Bytes per second ONNX Runtime's CPU MatMul streams in a float32 matrix-vector product over a
    weight far larger than the caches (the floor a decode step is bound by), median of runs, on
    the threads GenAI decodes with."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    rows = 4096
    cols = megabytes * 2**20 // (4 * rows)
    weight = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "gemv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, cols])],
        [onnx.numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = genai_threads()
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = np.ones((1, rows), dtype=np.float32)
    session.run(None, {"x": x})
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, {"x": x})
        times.append(time.perf_counter() - start)
    return weight.nbytes / statistics.median(times)


def _time_to_first_token(model, prompt) -> float:
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=prompt.shape[1] + 1, do_sample=False)
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(prompt)
    generator.get_next_tokens()
    return time.perf_counter() - start


def predicted_flops(model, prompt_lengths) -> dict[str, dict[int, int]]:
    """FLOPs of one prefill (batch 1, no past) for the program without and with the passes."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode, register_flop_formula, sdpa_flop_count

    from ep_profiles import get_profile
    from exporter.load.layout import derive_layout
    from exporter.plan import export_settings, make_plan
    from exporter.sessions import SESSIONS
    from exporter.trace.decoder import make_inputs, trace
    from fx_passes import FX_PASSES, run_fx_passes

    # CPU attention with a mask runs this kernel, which FlopCounterMode does not count by itself.
    @register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
    def _sdpa_cpu_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    layout = derive_layout(model)
    program, _ = trace(model, layout)
    settings = export_settings(get_profile("cpu"), layout, "fp32")
    flops: dict[str, dict[int, int]] = {"off": {}, "on": {}}
    for variant in ("off", "on"):
        if variant == "on":
            # Only the truncation passes: FlopCounterMode cannot count the attention marker's FLOPs.
            planned = make_plan(export_settings(get_profile("cpu"), layout, "fp32")).sessions[0].fx_passes
            extra = [p.name for p in planned if p.name in ("gather_last_token", "truncate_shared_kv_layers")]
            program, _ = run_fx_passes(program, [FX_PASSES[n] for n in extra], settings, SESSIONS["decoder"])
        for length in prompt_lengths:
            inputs = make_inputs(layout, 1, length, 0, generator=torch.Generator().manual_seed(0))
            with torch.no_grad(), FlopCounterMode(display=False) as counter:
                program.module()(*inputs)
            flops[variant][length] = counter.get_total_flops()
    return flops


def alternating_ttft(packages: dict, lengths, repeats) -> dict[str, dict[int, list[float]]]:
    """TTFT of each package for each prompt length, the variants taking turns (order flipped every
    repeat) so that machine noise falls on all of them alike; one discarded warm-up each."""
    import onnxruntime_genai as og

    models = {variant: og.Model(str(package.path)) for variant, package in packages.items()}
    vocab_size = next(iter(packages.values())).layout.vocab_size
    rng = np.random.default_rng(0)
    times: dict[str, dict[int, list[float]]] = {variant: {} for variant in models}
    for length in lengths:
        prompt = rng.integers(3, vocab_size, size=(1, length), dtype=np.int32)
        for model in models.values():
            _time_to_first_token(model, prompt)
        for repeat in range(repeats):
            order = list(models) if repeat % 2 == 0 else list(reversed(models))
            for variant in order:
                times[variant].setdefault(length, []).append(_time_to_first_token(models[variant], prompt))
    return times


def export_variants(loaded, variants: dict, scratch: str, what: str = "") -> dict:
    """One package per profile variant of the same loaded model, into ``scratch``."""
    packages = {}
    for index, (variant, profile) in enumerate(variants.items()):
        print(f"exporting {what}{variant} ...", file=sys.stderr, flush=True)
        packages[variant] = export(loaded.model, loaded.tokenizer, ep=profile, output_dir=Path(scratch) / str(index))
    return packages


def alternating_generation(packages: dict, length: int, decode_tokens: int, repeats: int,
                           search_max_length: int | None = None):
    """TTFT and decode tokens/s of each package for one prompt length, variants taking turns
    (order flipped every repeat), one discarded warm-up each. GenAI generates under
    ``search_max_length``, by default just what the prompt and the decoded tokens need; 0 means
    each package's own genai_config (under graph capture GenAI sizes the KV buffers by it)."""
    import onnxruntime_genai as og

    models = {variant: og.Model(str(package.path)) for variant, package in packages.items()}
    vocab_size = next(iter(packages.values())).layout.vocab_size
    prompt = np.random.default_rng(0).integers(3, vocab_size, size=(1, length), dtype=np.int32)
    results: dict[str, dict[str, list[float]]] = {v: {"ttft": [], "decode": []} for v in models}

    def run(model):
        params = og.GeneratorParams(model)
        # min_length: every package decodes the same number of tokens. One that picks its
        # end-of-sequence token early would otherwise be timed over its first cheap steps alone
        # (a real Qwen2.5-Coder int4 package stopped after 2 and "decoded" at 2x the rate of
        # another that ran 16).
        if search_max_length == 0:
            params.set_search_options(do_sample=False, min_length=length + decode_tokens)
        else:
            params.set_search_options(max_length=search_max_length or length + decode_tokens, do_sample=False,
                                      min_length=length + decode_tokens)
        generator = og.Generator(model, params)
        start = time.perf_counter()
        generator.append_tokens(prompt)
        generator.get_next_tokens()
        ttft = time.perf_counter() - start
        start, steps = time.perf_counter(), 0
        while not generator.is_done() and steps < decode_tokens:
            generator.generate_next_token()
            steps += 1
        return ttft, steps / (time.perf_counter() - start)

    for model in models.values():
        run(model)
    for repeat in range(repeats):
        for variant in (list(models) if repeat % 2 == 0 else list(reversed(models))):
            ttft, rate = run(models[variant])
            results[variant]["ttft"].append(ttft)
            results[variant]["decode"].append(rate)
    return results


def print_generation_table(heading: str, column: str, packages: dict, results: dict, base: str, base_label: str,
                           extra: tuple[str, object] | None = None) -> None:
    """One row per variant of ``alternating_generation``'s results: an optional column ``extra``
    (header, value of a package), TTFT and decode tokens/s (medians), decode against ``base``."""
    extra_header = f" {extra[0]} |" if extra else ""
    print(f"\n## {heading}\n")
    print(f"| {column} |{extra_header} TTFT ms | decode tokens/s | decode vs {base_label} |\n"
          f"|---|{'---:|' if extra else ''}---:|---:|---:|")
    base_rate = statistics.median(results[base]["decode"])
    for variant, package in packages.items():
        ttft, rate = statistics.median(results[variant]["ttft"]), statistics.median(results[variant]["decode"])
        value = f" {extra[1](package)} |" if extra else ""
        print(f"| {variant} |{value} {ttft * 1000:.0f} | {rate:.1f} | {rate / base_rate:.2f}x |")


def _nodes(package) -> int:
    return sum(package.report.op_counts.values())


def benchmark_attention(args) -> None:
    """Plain attention (the cpu profile without GroupQueryAttention, separate past/present
    buffers) vs GroupQueryAttention on rotated q/k vs GroupQueryAttention applying the rotary
    itself, alternating in one run."""
    import dataclasses

    from ep_profiles import get_profile
    from exporter.load.sources import load

    loaded = load(args.model)
    cpu = get_profile("cpu")
    variants = {
        "plain": cpu.with_plain_attention(),
        "gqa, rotated q/k": dataclasses.replace(cpu, name="cpu-gqa-rotated-inputs", attention_rotary=False),
        "gqa + rotary": cpu,
    }
    length = args.prompt_lengths[-1]
    with tempfile.TemporaryDirectory() as scratch:
        packages = export_variants(loaded, variants, scratch, "with attention: ")
        results = alternating_generation(packages, length, args.decode_tokens, args.repeats)
        print(f"\n## Attention, {args.model}, ONNX Runtime GenAI CPU fp32, {length}-token prompt, "
              f"{args.decode_tokens} decoded tokens (median of {args.repeats}, alternating)\n")
        print("| attention | ONNX nodes | TTFT ms | decode tokens/s | TTFT vs plain | decode vs plain |\n"
              "|---|---:|---:|---:|---:|---:|")
        base_ttft = statistics.median(results["plain"]["ttft"])
        base_rate = statistics.median(results["plain"]["decode"])
        for variant, package in packages.items():
            ttft, rate = statistics.median(results[variant]["ttft"]), statistics.median(results[variant]["decode"])
            print(f"| {variant} | {sum(package.report.op_counts.values())} | {ttft * 1000:.0f} | {rate:.1f} | "
                  f"{base_ttft / ttft:.2f}x | {rate / base_rate:.2f}x |")


def benchmark_graph_capture(args) -> None:
    """The webgpu profile as exported by default (graph capture on, with Dawn's validation off) vs
    --no-graph-capture (the EP's default validation), both on the WebGPU EP, alternating in one run. On a software adapter (lavapipe) the GPU work is CPU work
    too, so this measures what capture saves on dispatch, not a real GPU's speed."""
    from ep_profiles import get_profile
    from exporter.load.sources import load
    from exporter.verify.ep_runtime import register

    webgpu = get_profile("webgpu")
    register(webgpu, genai=True)
    loaded = load(args.model)
    length = args.prompt_lengths[0]
    with tempfile.TemporaryDirectory() as scratch:
        packages = {}
        for variant, capture in (("capture off", False), ("capture on", True)):
            print(f"exporting for webgpu, {variant} ...", file=sys.stderr, flush=True)
            packages[variant] = export(loaded.model, loaded.tokenizer, ep="webgpu", graph_capture=capture,
                                       output_dir=Path(scratch) / variant.replace(" ", "-"))
        results = alternating_generation(packages, length, args.decode_tokens, args.repeats)
        print_generation_table(
            f"WebGPU graph capture (with validationMode disabled) vs none, {args.model}, ONNX Runtime GenAI on the "
            f"WebGPU EP fp32, {length}-token prompt, "
            f"{args.decode_tokens} decoded tokens (median of {args.repeats}, alternating)",
            "variant", packages, results, "capture off", "off", ("ONNX nodes", _nodes))


def benchmark_attention_routing(args) -> None:
    """WebGPU packages whose attention the plan routes by the profile's kernel facts, alternating
    in one run with graph capture on: as shipped; as before those facts, with GroupQueryAttention
    trusted with a softcap (it drops it: wrong, shown for its speed); and with every layer attending
    in the graph over the KV buffer's slots (what routing around the lavapipe fault from 32 query
    rows would cost: a full-attention layer reads max_length slots at every step)."""
    import dataclasses

    from ep_profiles import get_profile
    from exporter.load.sources import load
    from exporter.verify.ep_runtime import register

    webgpu = get_profile("webgpu")
    register(webgpu, genai=True)

    def told(**facts):
        return dataclasses.replace(webgpu, attention_kernel=dataclasses.replace(webgpu.attention_kernel, **facts))

    loaded = load(args.model)
    variants = {"as shipped": webgpu, "softcap trusted to the kernel (before)": told(softcap=True),
                "every layer in the graph": told(exact_query_rows=31)}
    with tempfile.TemporaryDirectory() as scratch:
        packages = {}
        for number, (variant, profile) in enumerate(variants.items()):
            print(f"exporting for webgpu, {variant} ...", file=sys.stderr, flush=True)
            packages[variant] = export(loaded.model, loaded.tokenizer, ep=profile, precision=args.precision,
                                       output_dir=Path(scratch) / str(number))
        for length in args.prompt_lengths:
            results = alternating_generation(packages, length, args.decode_tokens, args.repeats, search_max_length=0)
            print_generation_table(
                f"WebGPU attention routing, {args.model}, ONNX Runtime GenAI on the WebGPU EP with graph capture, "
                f"{args.precision}, {length}-token prompt, {args.decode_tokens} decoded tokens (median of "
                f"{args.repeats}, alternating)", "variant", packages, results, "as shipped", "as shipped",
                ("ONNX nodes", _nodes))


def benchmark_max_length(args) -> None:
    """The webgpu profile (graph capture on) exported with each --max-length, each package
    generating under its own max_length, alternating in one run: how decode cost grows with the
    KV buffer GenAI allocates. On lavapipe GPU work is CPU work, so the ratio, not the speed, is
    what carries to a real GPU."""
    from ep_profiles import get_profile
    from exporter.load.sources import load
    from exporter.verify.ep_runtime import register

    register(get_profile("webgpu"), genai=True)
    loaded = load(args.model)
    text = loaded.model.config.get_text_config(decoder=True)
    longest = max(args.max_lengths)
    if text.max_position_embeddings < longest:
        print(f"raising {args.model}'s context from {text.max_position_embeddings} to {longest} positions",
              file=sys.stderr)
        text.max_position_embeddings = longest
    with tempfile.TemporaryDirectory() as scratch:
        packages = {}
        for max_length in args.max_lengths:
            print(f"exporting for webgpu, max_length {max_length} ...", file=sys.stderr, flush=True)
            packages[f"max_length {max_length}"] = export(
                loaded.model, loaded.tokenizer, ep="webgpu", precision=args.precision, max_length=max_length,
                output_dir=Path(scratch) / str(max_length))
        first = next(iter(packages))
        for length in args.prompt_lengths:  # a table per prompt length, the packages alternating in each
            results = alternating_generation(packages, length, args.decode_tokens, args.repeats, search_max_length=0)
            print_generation_table(
                f"WebGPU decode by max_length, {args.model}, ONNX Runtime GenAI on the WebGPU EP with graph capture, "
                f"{args.precision}, {length}-token prompt, {args.decode_tokens} decoded tokens (median of "
                f"{args.repeats}, alternating)", "package", packages, results, first, first,
                ("KV buffer MiB", lambda package: f"{package.report.kv_cache['bytes'] / 2**20:.1f}"))


def benchmark_fusions(args) -> None:
    """TTFT with the profile's norm fusions vs without them (attention unchanged), alternating in
    one run."""
    import dataclasses

    from ep_profiles import get_profile
    from exporter.load.sources import load

    loaded = load(args.model)
    cpu = get_profile("cpu")
    variants = {"unfused": dataclasses.replace(cpu, name="cpu-unfused", norm_fusions=()), "fused": cpu}
    with tempfile.TemporaryDirectory() as scratch:
        packages = export_variants(loaded, variants, scratch)
        times = alternating_ttft(packages, args.prompt_lengths, args.repeats)
        nodes = {v: sum(p.report.op_counts.values()) for v, p in packages.items()}
        print(f"\n## ONNX fusions, {args.model}, ONNX Runtime GenAI CPU fp32 (median of {args.repeats}, alternating)\n")
        print(f"ONNX nodes: unfused {nodes['unfused']}, fused {nodes['fused']}\n")
        print("| prompt | TTFT unfused ms | TTFT fused ms | unfused/fused |\n|---:|---:|---:|---:|")
        for length in args.prompt_lengths:
            unfused, fused = (statistics.median(times[v][length]) for v in ("unfused", "fused"))
            print(f"| {length} | {unfused * 1000:.0f} | {fused * 1000:.0f} | {unfused / fused:.2f} |")


def benchmark_transposed_matmul(args) -> None:
    """Linear weights stored as transposed copies for MatMul (a tied LM head then twice: the
    table and its transpose) vs read as stored by FusedMatMul with transB (the cpu profile):
    session load seconds, package weights, TTFT and decode tokens/s, alternating in one run."""
    import dataclasses

    from ep_profiles import get_profile
    from exporter.load.sources import load

    loaded = load(args.model)
    cpu = get_profile("cpu")
    variants = {"transposed copies": dataclasses.replace(cpu, name="cpu-transposed-copies", transposed_matmul=False),
                "read as stored": cpu}
    length = args.prompt_lengths[-1]
    with tempfile.TemporaryDirectory() as scratch:
        packages = export_variants(loaded, variants, scratch, "with its weights ")
        loads = alternating_load_seconds(packages, args.repeats)
        load_of = {id(packages[variant]): statistics.median(seconds) for variant, seconds in loads.items()}
        results = alternating_generation(packages, length, args.decode_tokens, args.repeats)
        print_generation_table(
            f"Linear weights, {args.model}, ONNX Runtime GenAI CPU fp32, {length}-token prompt, {args.decode_tokens} "
            f"decoded tokens (median of {args.repeats}, alternating)",
            "weights", packages, results, "transposed copies", "copies",
            ("weights MiB / load s", lambda package: f"{package.report.initializers['total_bytes'] / 2**20:.1f} / "
                                                      f"{load_of[id(package)]:.2f}"))


def benchmark_kv_shared_attention(args) -> None:
    """KV-shared layers' attention as GroupQueryAttention (without presents) vs MatMul/Softmax over
    the owner's slots (the cpu profile): TTFT and decode tokens/s with GenAI's KV buffer sized for
    the prompt and decoded tokens, then at the packages' own max_length (the buffer
    GroupQueryAttention's past spans), alternating in one run."""
    import dataclasses

    from ep_profiles import get_profile
    from exporter.load.sources import load

    loaded = load(args.model)
    cpu = get_profile("cpu")
    # The same profile told its kernel reads each KV head once: the plan then keeps GroupQueryAttention.
    once = dataclasses.replace(cpu.attention_kernel, reads_kv_head_per_query_head=False)
    variants = {"GroupQueryAttention": dataclasses.replace(cpu, name="cpu-kv-shared-gqa", attention_kernel=once),
                "MatMul/Softmax": cpu}
    length = args.prompt_lengths[-1]
    with tempfile.TemporaryDirectory() as scratch:
        packages = export_variants(loaded, variants, scratch, "with KV-shared attention as ")
        if not packages["MatMul/Softmax"].report.onnx_pass_changes("matmul_kv_shared_attention").get("layers"):
            raise SystemExit(f"error: {args.model} has no KV-shared layer the MatMul form takes; the packages are equal")
        own = packages["MatMul/Softmax"].report.kv_cache["max_length"]
        for search_max_length, slots in ((None, length + args.decode_tokens), (0, own)):
            results = alternating_generation(packages, length, args.decode_tokens, args.repeats, search_max_length)
            print_generation_table(
                f"KV-shared attention, {args.model}, ONNX Runtime GenAI CPU fp32, {length}-token prompt, "
                f"{args.decode_tokens} decoded tokens, max_length {slots} (median of {args.repeats}, alternating)",
                "KV-shared layers", packages, results, "GroupQueryAttention", "GroupQueryAttention")


def alternating_load_seconds(packages: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds ONNX Runtime GenAI takes to load each package (sessions created, weights packed),
    variants taking turns, one discarded warm-up each."""
    import gc

    import onnxruntime_genai as og

    def seconds(package) -> float:
        start = time.perf_counter()
        model = og.Model(str(package.path))
        elapsed = time.perf_counter() - start
        del model
        gc.collect()
        return elapsed

    for package in packages.values():
        seconds(package)
    loads: dict[str, list[float]] = {variant: [] for variant in packages}
    for repeat in range(repeats):
        for variant in (list(packages) if repeat % 2 == 0 else list(reversed(packages))):
            loads[variant].append(seconds(packages[variant]))
    return loads


def benchmark_mixture_of_experts(args) -> None:
    """Routed experts as traced (each routed token gathers its experts' weights for batched
    MatMuls) vs ONNX Runtime's MoE op: TTFT and decode tokens/s, alternating in one run."""
    import dataclasses

    from ep_profiles import get_profile
    from exporter.load.sources import load

    model = "qwen3-moe-shape" if args.model == "gemma-4-e2b-shape" else args.model
    loaded = load(model)
    cpu = get_profile("cpu")
    variants = {"plain": dataclasses.replace(cpu, name="cpu-plain-experts", mixture_of_experts_precisions=()),
                "MoE op": cpu}
    length = args.prompt_lengths[-1]
    with tempfile.TemporaryDirectory() as scratch:
        packages = export_variants(loaded, variants, scratch, "with experts ")
        fused = packages["MoE op"].report.op_counts.get("com.microsoft.MoE", 0)
        if not fused:
            raise SystemExit(f"{model}: no experts block became ONNX Runtime's MoE (see its report's notes)")
        results = alternating_generation(packages, length, args.decode_tokens, args.repeats)
        print_generation_table(
            f"Mixture of experts, {model} ({fused} MoE blocks), ONNX Runtime GenAI CPU fp32, {length}-token prompt, "
            f"{args.decode_tokens} decoded tokens (median of {args.repeats}, alternating)",
            "experts", packages, results, "plain", "plain", ("ONNX nodes", _nodes))


def benchmark_truncation(args) -> None:
    from exporter.load.sources import load

    lengths = args.prompt_lengths if args.prompt_lengths != [128, 512] else [128, 512, 1024]
    loaded = load(args.model)
    with tempfile.TemporaryDirectory() as scratch:
        packages = {}
        for variant, full_logits in (("off", True), ("on", False)):
            print(f"exporting with the last-token passes {variant} ...", file=sys.stderr, flush=True)
            packages[variant] = export(loaded.model, loaded.tokenizer, output_dir=Path(scratch) / variant,
                                       full_logits=full_logits)
        note = next((n for n in packages["on"].report.notes if "truncation" in n), "no truncation note")
        print("counting FLOPs ...", file=sys.stderr, flush=True)
        flops = predicted_flops(loaded.model, lengths)
        times = alternating_ttft(packages, lengths, args.repeats)
        print(f"\n## Prefill truncation, {args.model}, ONNX Runtime GenAI CPU fp32 "
              f"(median of {args.repeats}, alternating)\n")
        print(f"{note}\n")
        print("| prompt | TTFT off ms | TTFT on ms | measured off/on | GFLOP off | GFLOP on | predicted off/on "
              "| measured vs predicted |\n|---:|---:|---:|---:|---:|---:|---:|---:|")
        for length in lengths:
            off, on = statistics.median(times["off"][length]), statistics.median(times["on"][length])
            predicted = flops["off"][length] / flops["on"][length]
            print(f"| {length} | {off * 1000:.0f} | {on * 1000:.0f} | {off / on:.2f} | "
                  f"{flops['off'][length] / 1e9:.1f} | {flops['on'][length] / 1e9:.1f} | {predicted:.2f} | "
                  f"{(off / on) / predicted - 1:+.0%} |")


def command_line_reexport(root: Path, cache: Path, repeats: int) -> tuple[float, float, float, bool]:
    """``python -m exporter`` on the second checkpoint's folder, replayed (``exporter.cache.replay``) from
    the first's command-line export and without any cache, taking turns, each a fresh process:
    the first export's seconds, the medians, and whether the packages are byte-identical."""
    import hashlib
    import subprocess

    def timed(folder: str, output: str, *flags: str) -> tuple[float, dict]:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "exporter", str(root / folder), "-o", str(root / output),
                               "--overwrite", "--json", *flags], capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"python -m exporter {folder} exited {done.returncode}: {done.stderr[-2000:]}")
        return seconds, json.loads(done.stdout)

    def digest(output: str) -> str:
        package, sha = root / output, hashlib.sha256()
        for path in sorted(p for p in package.rglob("*") if p.is_file() and not p.name.startswith("export_report")):
            sha.update(path.relative_to(package).as_posix().encode() + path.read_bytes())
        return sha.hexdigest()

    print("command line: exporting the first checkpoint, recording its replay ...", file=sys.stderr, flush=True)
    first, _ = timed("step1", "cli-first", "--cache-dir", str(cache))
    times = {"replayed": [], "uncached": []}
    for repeat in range(repeats):
        for variant in (("replayed", "uncached") if repeat % 2 == 0 else ("uncached", "replayed")):
            print(f"  command line: re-export {variant} ...", file=sys.stderr, flush=True)
            flags = ("--cache-dir", str(cache)) if variant == "replayed" else ("--no-cache",)
            seconds, summary = timed("step2", f"cli-{variant}", *flags)
            if variant == "replayed" and set(summary["graph_cache"]["sessions"].values()) != {"replayed"}:
                raise SystemExit(f"the command-line re-export did not replay: {summary['graph_cache']}")
            times[variant].append(seconds)
    return (first, statistics.median(times["uncached"]), statistics.median(times["replayed"]),
            digest("cli-replayed") == digest("cli-uncached"))


def benchmark_reexport(args) -> None:
    """A training run's second checkpoint exported with the graph cache (filled by the first) and
    without it, taking turns, from a save_pretrained folder and from the model in memory; and by the
    command line, replayed and without any cache, each a fresh process."""
    import hashlib

    import torch

    from exporter.load.sources import load

    def nudge(model, seed: int) -> None:  # a training step: every parameter moves (buffers are not trained)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for tensor in {t.data_ptr(): t for t in model.parameters()}.values():
                tensor.add_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype) * 1e-3)

    def timed_export(source, tokenizer, output: Path, cache) -> tuple[float, object]:
        start = time.perf_counter()
        package = export(source, tokenizer, output_dir=output, overwrite=True, cache=cache)
        return time.perf_counter() - start, package

    def package_digest(package) -> str:  # every file but the report (timings, cache state)
        digest = hashlib.sha256()
        for path in sorted(p for p in package.path.rglob("*") if p.is_file() and not p.name.startswith("export_report")):
            digest.update(path.relative_to(package.path).as_posix().encode() + path.read_bytes())
        return digest.hexdigest()

    loaded = load(args.model)
    if loaded.multimodal:  # its folder would need the processor's files too
        raise SystemExit(f"--reexport takes a text model; {args.model} is multimodal")
    model, tokenizer = loaded.model, loaded.tokenizer
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        cache = root / "cache"
        print("saving two checkpoints ...", file=sys.stderr, flush=True)
        model.save_pretrained(root / "step1")
        tokenizer.save_pretrained(root / "step1")
        nudge(model, 1)
        model.save_pretrained(root / "step2")
        tokenizer.save_pretrained(root / "step2")
        rows = []
        for where, first, second, token_source in (("folder", str(root / "step1"), str(root / "step2"), None),
                                                    ("in memory", model, model, tokenizer)):
            print(f"exporting the first checkpoint ({where}), filling the cache ...", file=sys.stderr, flush=True)
            if where == "in memory":
                nudge(model, 2)  # the in-memory model trains on past the saved checkpoint
            filled, _ = timed_export(first, token_source, root / "first", cache)
            if where == "in memory":
                nudge(model, 3)
            times = {"cached": [], "uncached": []}
            digests = {}
            for repeat in range(args.repeats):
                for variant in (("cached", "uncached") if repeat % 2 == 0 else ("uncached", "cached")):
                    print(f"  {where}: re-export {variant} ...", file=sys.stderr, flush=True)
                    seconds, package = timed_export(second, token_source, root / variant,
                                                    cache if variant == "cached" else False)
                    times[variant].append(seconds)
                    digests[variant] = package_digest(package)
                    if variant == "cached" and set(package.report.graph_cache["sessions"].values()) != {"hit"}:
                        raise SystemExit(f"the cached re-export missed: {package.report.graph_cache}")
            rows.append((where, filled, statistics.median(times["uncached"]), statistics.median(times["cached"]),
                         digests["cached"] == digests["uncached"]))
        rows.append(("folder, command line (a replay)", *command_line_reexport(root, cache, args.repeats)))
    print(f"\n## Re-export of {args.model} with other weights, cpu fp32 (median of {args.repeats}, alternating)\n")
    print("A replay copies the first export's package with the second checkpoint's bytes; the other rows reuse "
          "the lowered graph and run the ONNX passes.\n")
    print("| source | first export (fills the cache) s | re-export, no cache s | re-export, cache s | "
          "cache / no cache | byte-identical |\n|---|---:|---:|---:|---:|---|")
    for where, filled, uncached, cached, identical in rows:
        print(f"| {where} | {filled:.1f} | {uncached:.1f} | {cached:.1f} | {cached / uncached:.2f} | "
              f"{'yes' if identical else 'NO'} |")


def main() -> None:
    args = parse_args()
    if args.reexport:
        benchmark_reexport(args)
        return
    if args.truncation:
        benchmark_truncation(args)
        return
    if args.fusions:
        benchmark_fusions(args)
        return
    if args.attention:
        benchmark_attention(args)
        return
    if args.attention_routing:
        benchmark_attention_routing(args)
        return
    if args.graph_capture:
        benchmark_graph_capture(args)
        return
    if args.max_lengths:
        benchmark_max_length(args)
        return
    if args.transposed_matmul:
        benchmark_transposed_matmul(args)
        return
    if args.moe:
        benchmark_mixture_of_experts(args)
        return
    if args.kv_shared_attention:
        benchmark_kv_shared_attention(args)
        return
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
        streamed = streamed_bytes_per_token(package.model_path)
        bandwidth = gemv_bandwidth()
        floor = bandwidth / streamed  # tokens/s if a step did nothing but stream its weights once
        print(f"\n## ONNX Runtime GenAI, CPU, fp32 (median of {args.repeats})\n")
        print(f"A decode step streams {streamed / 2**20:.1f} MiB of weights; ONNX Runtime's MatMul streams "
              f"{bandwidth / 2**30:.1f} GiB/s on this machine (float32 GEMV, 512 MiB weight, on "
              f"{genai_threads()} intra-op thread(s) as GenAI decodes here), so the "
              f"bandwidth floor is {floor:.1f} tokens/s.\n")
        print(f"| prompt tokens | TTFT ms | decode tokens/s ({args.decode_tokens} tokens) | decode / floor |\n"
              "|---:|---:|---:|---:|")
        for length, ttft, rate in rows:
            print(f"| {length} | {ttft * 1000:.0f} | {rate:.1f} | {rate / floor:.0%} |")


if __name__ == "__main__":
    main()
