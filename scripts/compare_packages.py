"""Compare ONNX Runtime GenAI packages from any exporter (not a test): time to first token and
decode tokens/s, the packages taking turns in one run (order flipped every repeat, one warm-up
each), so a shared, noisy machine slows them alike.

    python scripts/compare_packages.py ours=out/llama-int4 builder=/tmp/builder-int4 --prompt-length 512
    python scripts/compare_packages.py ours=out/webgpu mobius=/tmp/mobius-webgpu --ep webgpu --max-length 4096
    python scripts/compare_packages.py ours=out/webgpu mobius=/tmp/mobius-webgpu --ep webgpu --prompt-length 64 512

``--ep webgpu`` registers the WebGPU plugin with GenAI; each package then runs on the providers
its own genai_config names (graph capture included), printed beside the table. ``--max-length``
sets GenAI's max_length for every package (a package that shares one KV buffer gets one of that
many slots); 0 keeps each package's own.

``--processes N`` runs each package in N fresh processes, taking turns (each process: one warm-up,
then ``--repeats`` generations; the table gives the median over processes of each process's
median). Where a package's weights land in memory differs between processes, and on a shared
machine that moves decode speed by several percent: two byte-identical packages loaded side by
side in one process have decoded 4.6% apart. Use it to compare packages a few percent apart.

Give this exporter's package beside the same checkpoint's package from ONNX Runtime GenAI's model
builder (``python -m onnxruntime_genai.models.builder -i DIR -o OUT -e cpu -p int4 -c CACHE``) or
another exporter; their installs stay outside this project. Prompts are random token ids (fixed
seed), so the numbers measure the graphs, not the text.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark import alternating_generation, print_generation_table  # noqa: E402  (the benchmark's own)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("packages", nargs="+", metavar="[NAME=]PATH",
                        help="package folders (with genai_config.json), each optionally named NAME=PATH")
    parser.add_argument("--prompt-length", type=int, nargs="+", default=[512], metavar="N",
                        help="prompt length(s); one table each (a package's decode cost may grow with the context)")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ep", choices=("cpu", "webgpu"), default="cpu",
                        help="cpu: the packages' own providers, as installed; webgpu: register the WebGPU plugin first")
    parser.add_argument("--max-length", type=int, metavar="N",
                        help="GenAI's max_length for every package (default: the prompt and decoded tokens; "
                             "0: each package's own)")
    parser.add_argument("--processes", type=int, default=0, metavar="N",
                        help="run each package in N fresh processes, taking turns (default 0: all in this one)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one package, for --processes
    args = parser.parse_args()
    if args.processes < 0 or args.repeats < 1:
        parser.error("--processes takes 0 or more, --repeats 1 or more")
    return args


def read_packages(specs: list[str]) -> dict[str, SimpleNamespace]:
    packages = {}
    for spec in specs:
        name, _, path = spec.rpartition("=")
        folder = Path(path)
        config = folder / "genai_config.json"
        if not config.is_file():
            raise SystemExit(f"error: {folder} is not a package folder (no genai_config.json)")
        settings = json.loads(config.read_text())
        packages[name or folder.name] = SimpleNamespace(
            path=folder, layout=SimpleNamespace(vocab_size=settings["model"]["vocab_size"]), settings=settings)
    if len({p.layout.vocab_size for p in packages.values()}) != 1:
        raise SystemExit("error: the packages have different vocabularies; compare packages of one checkpoint")
    return packages


def run_settings(settings: dict) -> str:
    """What decides how a package runs besides its graph: providers with their options (graph
    capture among them), and whether GenAI shares one KV buffer of max_length slots."""
    options = settings["model"]["decoder"].get("session_options", {}).get("provider_options", []) or ["cpu"]
    shared = settings.get("search", {}).get("past_present_share_buffer", False)
    return f"providers {json.dumps(options)}, KV buffer of max_length slots: {'yes' if shared else 'no'}"


def in_fresh_processes(args, packages: dict, prompt_length: int) -> dict[str, dict[str, list[float]]]:
    """Each package's TTFT and decode medians from ``args.processes`` fresh processes (this script
    as a worker), packages taking turns, the order flipped every round."""
    results = {name: {"ttft": [], "decode": []} for name in packages}
    for round_ in range(args.processes):
        for name in (list(packages) if round_ % 2 == 0 else list(reversed(packages))):
            command = [sys.executable, __file__, f"{name}={packages[name].path}", "--worker", "--ep", args.ep,
                       "--prompt-length", str(prompt_length), "--decode-tokens", str(args.decode_tokens),
                       "--repeats", str(args.repeats)]
            if args.max_length is not None:
                command += ["--max-length", str(args.max_length)]
            done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
            try:
                medians = json.loads(done.stdout.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError):
                medians = None
            if done.returncode or not isinstance(medians, dict):
                raise SystemExit(f"error: the worker for {name} failed (exit {done.returncode}):\n{done.stderr.strip()}")
            for measure in ("ttft", "decode"):
                results[name][measure].append(medians[measure])
    return results


def main() -> None:
    args = parse_args()
    packages = read_packages(args.packages)
    if args.ep == "webgpu" and not args.processes:
        from ep_profiles import get_profile
        from exporter.verify.ep_runtime import register

        register(get_profile("webgpu"), genai=True)
    if args.worker:
        (prompt_length,) = args.prompt_length
        (results,) = alternating_generation(packages, prompt_length, args.decode_tokens, args.repeats,
                                            search_max_length=args.max_length).values()
        print(json.dumps({measure: statistics.median(runs) for measure, runs in results.items()}))
        return
    for name, package in packages.items():
        print(f"{name}: {run_settings(package.settings)}")
    first = next(iter(packages))
    length = {None: "", 0: ", each package's own max_length"}.get(args.max_length, f", max_length {args.max_length}")
    processes = f"{args.processes} fresh process{'es' if args.processes > 1 else ''}"
    how = (f"median over {processes} each of the median of {args.repeats}, taking turns"
           if args.processes else f"median of {args.repeats}, alternating")
    for prompt_length in args.prompt_length:
        if args.processes:
            results = in_fresh_processes(args, packages, prompt_length)
        else:
            results = alternating_generation(packages, prompt_length, args.decode_tokens, args.repeats,
                                             search_max_length=args.max_length)
        print_generation_table(f"ONNX Runtime GenAI, {args.ep} packages, {prompt_length}-token prompt, "
                               f"{args.decode_tokens} decoded tokens{length} ({how})",
                               "package", packages, results, first, first)


if __name__ == "__main__":
    main()
