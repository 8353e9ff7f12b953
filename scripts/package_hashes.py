"""Record or compare the sha256 of every package file a restructure must not change.

Exports tiny-gemma-4 and tiny-llama (or ``--models``) for every EP profile x every precision it
lists (or ``--targets``), and hashes model.onnx, model.onnx.data and genai_config.json of each.
``--record FILE`` writes the hashes; ``--compare FILE`` exports again and lists every file whose
bytes differ (exit 1 if any).

    python scripts/package_hashes.py --record before.json
    python scripts/package_hashes.py --compare before.json
    python scripts/package_hashes.py --models tiny-phi3,tiny-gemma2 --targets cpu/fp32,cuda/bf16 --record more.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ep_profiles import PROFILES
from exporter import export
from exporter.load.presets import build_preset

MODELS = ("tiny-gemma-4", "tiny-llama")
FILES = ("model.onnx", "model.onnx.data", "genai_config.json")


def package_hashes(models=MODELS, targets: set[str] | None = None) -> dict[str, dict[str, str]]:
    """``targets``: the "EP/precision" pairs to export (default: every profile's every precision)."""
    hashes = {}
    with tempfile.TemporaryDirectory() as root:
        for model_name in models:
            for profile in PROFILES.values():
                for precision in profile.precisions:
                    if targets is not None and f"{profile.name}/{precision}" not in targets:
                        continue
                    key = f"{model_name}/{profile.name}/{precision}"
                    model, tokenizer = build_preset(model_name)
                    out = Path(root) / key.replace("/", "-")
                    export(model, tokenizer, ep=profile.name, precision=precision, output_dir=out)
                    hashes[key] = {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in FILES}
                    print(f"{key}: {hashes[key]['model.onnx'][:12]} {hashes[key]['model.onnx.data'][:12]}",
                          file=sys.stderr, flush=True)
    return hashes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", type=Path, metavar="FILE")
    mode.add_argument("--compare", type=Path, metavar="FILE")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated presets")
    parser.add_argument("--targets", help="comma-separated EP/precision pairs, e.g. cpu/fp32,webgpu/fp16")
    args = parser.parse_args()
    models = args.models.split(",")
    targets = set(args.targets.split(",")) if args.targets else None
    if args.record:
        args.record.write_text(json.dumps(package_hashes(models, targets), indent=1) + "\n")
        return 0
    recorded = json.loads(args.compare.read_text())
    now = package_hashes(models, targets)
    differing = [f"{key} {name}" for key in sorted(set(recorded) | set(now)) for name in FILES
                 if recorded.get(key, {}).get(name) != now.get(key, {}).get(name)]
    for line in differing:
        print(f"differs: {line}")
    print(f"{len(now)} packages, {len(differing)} differing files")
    return 1 if differing else 0


if __name__ == "__main__":
    raise SystemExit(main())
