"""Quality of packages against transformers fp32 on real text: perplexity, top-1 agreement and
mean KL(fp32 || package), with each package's bytes (not a test).

The text is tokenized by the source's tokenizer and cut into windows of ``--window`` tokens; each
window is fed to a package through ONNX Runtime GenAI's decode path, one token at a time (teacher
forcing: the package reads the text, not its own picks), and transformers reads the same window in
one fp32 pass. Packages are this exporter's, exported here at the precisions ``--export`` names
(``int4``, ``int4:method=hqq``, ...), or any exporter's, by path (``--package``). Each row gives the
package's bytes and, for those exported here, the export's seconds (no graph cache).

    python scripts/quality_benchmark.py FOLDER --text /usr/share/common-licenses/GPL-3 --export fp32 int4
    python scripts/quality_benchmark.py FOLDER --text FILE --package other/package --tokens 1024
    python scripts/quality_benchmark.py FOLDER --text FILE --export int8 int4:eight_bit=lm_head+sensitive_layers

Runs on the CPU EP. Perplexity is exp(mean negative log-likelihood of each next token); top-1
agreement, the share of positions whose best token is transformers'; KL in nats, averaged over
positions.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="the transformers checkpoint folder (or preset) the packages were exported from")
    parser.add_argument("--text", type=Path, required=True, help="a text file of real prose or code")
    parser.add_argument("--export", nargs="*", default=[], metavar="PRECISION[:KEY=VALUE,...]",
                        help="export the source here at these settings (cpu profile): fp32, int4, "
                             "int4:method=k_quant, int4:symmetric=false, int4:block_size=64")
    parser.add_argument("--package", nargs="*", default=[], type=Path, help="packages exported elsewhere")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of the text to score")
    parser.add_argument("--window", type=int, default=256, help="tokens per teacher-forced window")
    parser.add_argument("--ep", default="cpu", help="the profile --export uses (default cpu)")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="write --export's packages into DIR (one folder per setting) and keep them")
    return parser.parse_args(argv)


def windows_of(text: str, tokenizer, tokens: int, window: int) -> list[list[int]]:
    ids = list(tokenizer(text)["input_ids"])[:tokens]
    if len(ids) < 2:
        raise SystemExit("error: the text gives fewer than 2 tokens")
    return [ids[start:start + window] for start in range(0, len(ids), window) if len(ids[start:start + window]) > 1]


def reference_log_probs(source: str, windows: list[list[int]]) -> list[np.ndarray]:
    """transformers fp32 log-softmax [len(window), vocab] of each window (position i predicts i + 1)."""
    import torch

    from exporter.verify.check_against import reference_model

    model = reference_model(source)
    out = []
    with torch.no_grad():
        for ids in windows:
            logits = model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits
            out.append(torch.log_softmax(logits[0].float(), dim=-1).numpy())
    del model
    gc.collect()
    return out


def package_log_probs(package: Path, windows: list[list[int]], vocab: int) -> list[np.ndarray]:
    """The package's log-softmax for each position of each window, fed one token at a time
    through GenAI's decode path."""
    import onnxruntime_genai as og

    from exporter.verify.ep_runtime import genai_config

    model = og.Model(genai_config(package, on_cpu=True))
    out = []
    for ids in windows:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + 1, do_sample=False)
        generator = og.Generator(model, params)
        rows = []
        for token in ids:
            generator.append_tokens(np.array([[token]], dtype=np.int32))
            logits = np.array(generator.get_output("logits"), dtype=np.float64).reshape(-1)[-vocab:]
            if not np.isfinite(logits).all():  # a NaN would make every metric NaN, or compare false
                raise SystemExit(f"error: {package}: logits not finite at position {len(rows)} of a window")
            top = logits.max()
            rows.append(logits - top - np.log(np.exp(logits - top).sum()))
        out.append(np.stack(rows))
        del generator
    del model
    gc.collect()
    return out


def quality(reference: list[np.ndarray], package: list[np.ndarray], windows: list[list[int]]) -> dict[str, float]:
    """Perplexity of the package (and of the reference), top-1 agreement and mean KL(ref || package)
    (``exporter.verify.distribution``, the measure ``check --against`` bounds quantized packages by)."""
    from exporter.verify.distribution import DistributionTotals

    totals = DistributionTotals()
    for want, got, ids in zip(reference, package, windows, strict=True):
        # The last position predicts past the window.
        totals.add(want[:-1], got[:-1], np.array(ids[1:]))
    return {"perplexity": totals.perplexity, "reference_perplexity": totals.reference_perplexity,
            "top1": totals.top1_share, "kl": totals.mean_kl, "positions": totals.positions}


def package_bytes(package: Path) -> int:
    return sum(p.stat().st_size for p in package.iterdir() if p.is_file() and ".onnx" in p.name)


def export_variant(source: str, spec: str, ep: str, folder: Path):
    """``fp32``, ``int8``, ``int4``, ``int4:method=k_quant,symmetric=false``,
    ``int4:eight_bit=lm_head+sensitive_layers``, ``int4:eight_bit=none``: an export of ``source``;
    bad settings exit with one line (status 2)."""
    from exporter import ExporterError, export
    from exporter.int4_options import Int4Options

    precision, _, settings = spec.partition(":")
    options = {}
    for pair in filter(None, settings.split(",")):
        key, _, value = pair.partition("=")
        if key == "eight_bit":
            options[key] = () if value in ("", "none") else tuple(value.split("+"))
            continue
        options[key] = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)
    try:
        int4 = Int4Options(**options) if options else None
        return export(source, ep=ep, precision=precision, int4=int4, output_dir=folder, cache=False).path
    except (TypeError, ValueError, ExporterError) as error:
        print(f"error: --export {spec}: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers

    text = args.text.read_text()
    with tempfile.TemporaryDirectory() as scratch:
        packages = {str(path): path for path in args.package}
        export_seconds = {}
        for spec in args.export:
            print(f"exporting {spec} ...", file=sys.stderr, flush=True)
            folder = (args.keep or Path(scratch)) / spec.replace(":", "_").replace(",", "_").replace("=", "-")
            start = time.perf_counter()
            packages[spec] = export_variant(args.source, spec, args.ep, folder)
            export_seconds[spec] = time.perf_counter() - start
        if not packages:
            raise SystemExit("error: name --export settings or --package folders to measure")
        first = next(iter(packages.values()))
        tokenizer = transformers.AutoTokenizer.from_pretrained(first)
        windows = windows_of(text, tokenizer, args.tokens, args.window)
        reference = reference_log_probs(args.source, windows)
        rows = []
        for name, path in packages.items():
            print(f"scoring {name} ...", file=sys.stderr, flush=True)
            vocab = json.loads((path / "genai_config.json").read_text())["model"]["vocab_size"]
            rows.append((name, quality(reference, package_log_probs(path, windows, vocab), windows), package_bytes(path),
                         export_seconds.get(name)))
            result = rows[-1][1]
            print(f"  {name}: perplexity {result['perplexity']:.3f}, top-1 {result['top1']:.1%}, "
                  f"KL {result['kl']:.4f}", file=sys.stderr, flush=True)
    base = rows[0][1]["reference_perplexity"]
    print(f"\n## Quality against transformers fp32, {args.source}, {rows[0][1]['positions']} positions of {args.text.name} "
          f"(windows of {args.window}); transformers fp32 perplexity {base:.3f}\n")
    # Export time (no cache) tells what a slower quantizer costs; a package by path has none here.
    # The first export also pays for one-time imports.
    print("| package | MB | export s | perplexity | vs fp32 | top-1 | mean KL |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, result, size, seconds in rows:
        print(f"| {name} | {size / 1e6:.0f} | {'' if seconds is None else f'{seconds:.0f}'} | {result['perplexity']:.3f} | "
              f"{result['perplexity'] / base:.3f}x | {100 * result['top1']:.1f}% | {result['kl']:.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
