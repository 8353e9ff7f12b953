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

Give this exporter's package beside the same checkpoint's package from ONNX Runtime GenAI's model
builder (``python -m onnxruntime_genai.models.builder -i DIR -o OUT -e cpu -p int4 -c CACHE``) or
another exporter; their installs stay outside this project. Prompts are random token ids (fixed
seed), so the numbers measure the graphs, not the text.
"""

from __future__ import annotations

import argparse
import json
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
    return parser.parse_args()


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


def main() -> None:
    args = parse_args()
    packages = read_packages(args.packages)
    if args.ep == "webgpu":
        from ep_profiles import get_profile
        from exporter.ep_runtime import register

        register(get_profile("webgpu"), genai=True)
    for name, package in packages.items():
        print(f"{name}: {run_settings(package.settings)}")
    first = next(iter(packages))
    length = {None: "", 0: ", each package's own max_length"}.get(args.max_length, f", max_length {args.max_length}")
    for prompt_length in args.prompt_length:
        results = alternating_generation(packages, prompt_length, args.decode_tokens, args.repeats,
                                         search_max_length=args.max_length)
        print_generation_table(f"ONNX Runtime GenAI, {args.ep} packages, {prompt_length}-token prompt, "
                               f"{args.decode_tokens} decoded tokens{length} (median of {args.repeats}, alternating)",
                               "package", packages, results, first, first)


if __name__ == "__main__":
    main()
