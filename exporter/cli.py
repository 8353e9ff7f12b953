"""Command line: ``python -m exporter MODEL --ep cpu -o DIR`` and ``python -m exporter list``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import signal
import sys
import threading
from pathlib import Path

from ep_profiles import PROFILES, get_profile
from ep_profiles.registry import UnknownProfileError
from exporter.cache import replay
from exporter.cache.cache_folder import chosen_folder
from exporter.errors import ExporterError, environment_error
from exporter.int4_options import INT4_METHODS, Int4Options
from exporter.load.preset_names import DEFAULT_PRESET, PRESET_NAMES
from exporter.options import ExportOptions, ResolvedOptions
from exporter.package.files import REPORT_FILENAME
from exporter.package.report import describe_graph_cache, package_summary
from exporter.precisions import PRECISIONS

# The command line imports torch and transformers only once it exports something, so that a
# replayed export (``exporter.cache.replay``) never does.

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=program(),
        description="Export a Hugging Face decoder LM to an ONNX Runtime GenAI package.",
        epilog=f"Other commands (each with its own --help): `{program()} list` shows presets, aliases and EPs; "
        f"`{program()} plan MODEL --ep EP [--json]` prints the passes an export would run; "
        f"`{program()} check PACKAGE --ep EP [--against SOURCE] [--json]` checks a package.",
    )
    parser.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_PRESET,
        help=f"preset name, alias, local HF folder or hub id (default: {DEFAULT_PRESET}, offline)",
    )
    parser.add_argument("-o", "--output", type=Path, metavar="DIR",
                        help="package folder to create (default: ./<model>-<ep>-<precision>)")
    _add_option_flags(parser)
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--no-cache", dest="cache", action="store_false",
                       help="do not read or keep lowered graphs and replays in the cache (by default a re-export "
                            "of the same architecture and options with other weights reuses the graph, and a "
                            "folder whose other files are the same replays the package: "
                            "$XDG_CACHE_HOME/genai-exporter/graphs; off also with GENAI_EXPORTER_NO_CACHE=1)")
    cache.add_argument("--cache-dir", type=Path, metavar="DIR",
                       help="keep the cache in DIR instead (used even where GENAI_EXPORTER_NO_CACHE is set)")
    parser.add_argument("--overwrite", action="store_true", help="replace the output folder if it holds an earlier package")
    parser.add_argument("--allow-pickled-weights", action="store_true",
                        help="load pickled .bin weights, which can run arbitrary code; only for sources you trust")
    parser.add_argument("--random-weights", action="store_true",
                        help="build the model's architecture from its config with random weights (no weights "
                             "downloaded or read; gemma-4-e2b's config ships with the exporter): for checking "
                             "full-size packages offline")
    parser.add_argument("--strict", action="store_true",
                        help="fail if the checkpoint holds a tensor the export would not read (renamed or "
                             "unconverted keys); by default the report and a note list them")
    parser.add_argument("--json", action="store_true",
                        help="print a JSON summary on stdout (package, sessions, sizes, passes, timings, notes; "
                             "on failure: ok false, the exit code and the error) instead of the text summary")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on failure")
    return parser


def _add_option_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of ``ExportOptions`` that decide the plan, shared by the export and ``plan`` parsers
    (``_options`` reads them back)."""
    parser.add_argument("--ep", default="cpu", metavar="EP",
                        help=f"execution provider profile: {', '.join(PROFILES)} (default: cpu; `list` describes them)")
    parser.add_argument("--no-graph-capture", dest="graph_capture", action="store_false",
                        help="for an EP profile that captures the decoder's graph (webgpu): export without "
                             "graph capture (some shape work may then run on the CPU)")
    parser.add_argument("--precision", choices=PRECISIONS,
                        help="fp32, fp16, bf16 (the graph computes in it), int4 (4-bit weights, fp16 "
                             "activations; fp32 on cpu) or int8 (8-bit weights, as int4's activations); "
                             "default: the EP's first (`list`)")
    parser.add_argument("--int4-block-size", type=int, metavar="N",
                        help="int4: weights per scale, a power of two >= 16 (default 32)")
    symmetry = parser.add_mutually_exclusive_group()
    symmetry.add_argument("--int4-asymmetric", dest="int4_symmetric", action="store_false", default=None,
                          help="int4: blocks with zero points" + (" (the default)" if not Int4Options.symmetric else ""))
    symmetry.add_argument("--int4-symmetric", dest="int4_symmetric", action="store_true", default=None,
                          help="int4: blocks without zero points" + (" (the default)" if Int4Options.symmetric else ""))
    parser.add_argument("--int4-accuracy-level", type=int, choices=range(5), metavar="0-4",
                        help="int4: MatMulNBits accuracy level (4 = int8 compute; default: 4 on cpu, 0 elsewhere)")
    parser.add_argument("--int4-method", choices=INT4_METHODS,
                        help="int4: rtn (round to nearest over each block, default), k_quant (llama.cpp's "
                             "K-quant fit of a scale and minimum per block) or hqq (Half-Quadratic Quantization: "
                             "a float zero point per block fitted to the rounding error; cpu only, and there "
                             "ONNX Runtime 1.32 decodes it about 14x slower) or awq (activation-aware scales per "
                             "input channel, searched at export time on the decoder's activations over built-in "
                             "prompts, then round to nearest)")
    parser.add_argument("--int4-8bit", type=_roles, metavar="ROLE[,ROLE]",
                        help="int4: store these weights at 8 bits: lm_head, embeddings, sensitive_layers (the "
                             "value and down projections of the first and last eighth of the layers and every "
                             "third between, as llama.cpp's Q4_K_M), or none (the default): more quality, "
                             "slower decode")
    parser.add_argument("--max-length", type=int, metavar="N",
                        help="the context GenAI allocates and generates to (genai_config's context_length and "
                             "max_length; default: the model's own, capped by the EP's default, `list`); the "
                             "report gives the KV cache's size at it")
    parser.add_argument("--full-logits", action="store_true",
                        help="output logits for every position (for scoring); by default only each "
                             "sequence's last token, which is all generation reads and much faster to prefill")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the checkpoint's own Python code (transformers' trust_remote_code)")
    parser.add_argument("--text-only", action="store_true",
                        help="a multimodal checkpoint (Gemma 4) gives its language model only, as a text package; "
                             "by default it gives the multimodal package (decoder, embedding, vision, speech)")
    parser.add_argument("--int4-encoders", action="store_true",
                        help="with --precision int4 or int8, quantize the vision and speech towers too (by default they "
                             "stay at the activation precision: int4 audio towers hurt speech quality)")


def program() -> str:
    """The name users typed: the console script, or ``python -m exporter``."""
    return "genai-exporter" if Path(sys.argv[0]).stem == "genai-exporter" else "python -m exporter"


def _list(argv: list[str]) -> int:
    from exporter.load.sources import describe_sources

    argparse.ArgumentParser(prog=f"{program()} list", description="List presets, aliases and EP profiles.").parse_args(argv)
    print("Models (presets work offline):")
    for name, description in describe_sources():
        print(f"  {name:<20} {description}")
    print("\nExecution providers (--ep):")
    for name, profile in PROFILES.items():
        capture = "graph capture on" if profile.graph_capture else "no graph capture"
        limit = f"; buffers <= {profile.max_buffer_size // 2**20} MiB" if profile.max_buffer_size else ""
        length = f"; max length {profile.max_length} by default" if profile.max_length else ""
        print(f"  {name:<20} {profile.description}; precisions: {', '.join(profile.precisions)}; "
              f"{capture}{limit}{length}")
    return 0


def _check(argv: list[str]) -> int:
    from exporter.verify.check import check_package, findings_to_json, format_findings

    parser = argparse.ArgumentParser(
        prog=f"{program()} check",
        description="Check a package against an EP profile; exits 1 if any check fails.",
    )
    parser.add_argument("package", type=Path, help="package folder (with genai_config.json)")
    parser.add_argument("--ep", metavar="EP", help="EP profile to check against (default: the EP the package's "
                                                   "genai_config.json names, else cpu)")
    parser.add_argument("--against", metavar="SOURCE",
                        help="also compare the package's logits and greedy tokens with transformers running "
                             "SOURCE (the preset, folder, GGUF file, hub id or alias it was exported from)")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    args = parser.parse_args(argv)
    try:
        profile = get_profile(args.ep or _named_ep(args.package))
    except UnknownProfileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    findings = check_package(args.package, profile, against=args.against)
    print(findings_to_json(findings) if args.json else format_findings(findings))
    return 0 if all(f.passed for f in findings) else 1


def _named_ep(package: Path) -> str:
    """The profile whose provider the package's genai_config.json names (cpu where it names none,
    or cannot be read: the checks then say what is wrong with it)."""
    import json

    from ep_profiles import PROFILES

    try:
        options = json.loads((package / "genai_config.json").read_text())["model"]["decoder"]["session_options"]
        named = {name for entry in options.get("provider_options", []) for name in entry}
    except Exception:
        return "cpu"
    return next((p.name for p in PROFILES.values() if p.genai_provider and p.genai_provider in named), "cpu")


def _plan(argv: list[str]) -> int:
    """Print the export plan: per session, the FX and ONNX passes in order and why each runs."""
    import json

    from exporter.load.prepare import prepare
    from exporter.load.sources import LoadOptions, load
    from exporter.plan import export_settings, make_plan
    from exporter.precisions import PRECISIONS as POLICIES

    parser = argparse.ArgumentParser(prog=f"{program()} plan",
                                     description="Print the passes an export would run, without exporting.")
    parser.add_argument("model", nargs="?", default=DEFAULT_PRESET, help="as for an export")
    _add_option_flags(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    try:
        options = _options(args)
        resolved = options.resolve()
        profile, precision = resolved.profile, resolved.precision
        # The plan needs the model's structure only: its config, never its weights.
        loaded = load(args.model, options=LoadOptions(trust_remote_code=options.trust_remote_code,
                                                      random_weights=True, text_only=options.text_only))
        layout = prepare(loaded, POLICIES[precision].compute_dtype(profile)).layout
        settings = export_settings(profile, layout, precision, graph_capture=options.graph_capture,
                                   full_logits=options.full_logits, int4=resolved.int4,
                                   multimodal=loaded.multimodal, int4_encoders=options.int4_encoders,
                                   max_length=options.max_length)
        plan = make_plan(settings)
    except ExporterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.to_text())
    return 0


def _roles(text: str) -> tuple[str, ...]:
    """``lm_head,sensitive_layers`` -> the roles; ``none`` -> none."""
    roles = tuple(role.strip() for role in text.split(",") if role.strip())
    return () if roles == ("none",) else roles


def _options(args) -> ExportOptions:
    """The ``ExportOptions`` the flags ask for (``_add_option_flags``; the export parser's others too).
    An ``--int4-*`` flag at another precision is named in the error."""
    given = [flag for flag, value in (("--int4-block-size", args.int4_block_size),
                                      ("--int4-asymmetric/--int4-symmetric", args.int4_symmetric),
                                      ("--int4-accuracy-level", args.int4_accuracy_level),
                                      ("--int4-method", args.int4_method),
                                      ("--int4-8bit", args.int4_8bit)) if value is not None]
    int4 = None
    if given:
        precision = args.precision or _profile_precision(args.ep)
        if precision != "int4":
            raise ExporterError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to --precision int4, "
                                f"not {precision}")
        try:
            int4 = Int4Options(
                block_size=args.int4_block_size or Int4Options.block_size,
                symmetric=Int4Options.symmetric if args.int4_symmetric is None else args.int4_symmetric,
                accuracy_level=args.int4_accuracy_level,
                method=args.int4_method or Int4Options.method,
                eight_bit=Int4Options.eight_bit if args.int4_8bit is None else args.int4_8bit,
            )
        except ValueError as error:
            raise ExporterError(str(error)) from error
    # Each option's flag has its field's name (the plan parser leaves out those that do not decide the plan).
    flags = {field.name: getattr(args, field.name) for field in dataclasses.fields(ExportOptions)
             if field.name != "int4" and hasattr(args, field.name)}
    return ExportOptions(int4=int4, **flags)


def _profile_precision(ep: str) -> str:
    try:
        return get_profile(ep).default_precision
    except UnknownProfileError as error:
        raise ExporterError(str(error)) from error


def run() -> None:
    """The command line (``python -m exporter``, ``genai-exporter``): ``main``'s exit code. The
    process makes one package (or plan or check) and ends, so Python's cyclic garbage collector
    stays off (cycles hold about 30 MiB at 35 layers), and the objects are frozen out of the final
    collection at exit, which would traverse a 35-layer trace's objects again (about 2 s).
    ``export`` turns the collector off for its own run anyway; this spares the one collection that
    would traverse all of them after it."""
    gc.disable()
    code = main(replays=True)
    gc.freeze()
    sys.exit(code)


def main(argv: list[str] | None = None, *, replays: bool = False) -> int:
    """The command line's exit code. ``replays``: record exports of folders as replays and replay
    them (``exporter.cache.replay``), which only a fresh process may do, where nothing can have patched
    the model's classes (``run``, the console command); a caller's process may have."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["list"]:
        return _list(argv[1:])
    if argv[:1] == ["check"]:
        return _check(argv[1:])
    if argv[:1] == ["plan"]:
        return _plan(argv[1:])
    parser = build_parser()
    if "--json" in argv:
        def json_error(message: str):  # argparse's own errors, as JSON too
            parser.print_usage(sys.stderr)
            raise SystemExit(_failed(argparse.Namespace(json=True), f"{message} (see {parser.prog} --help)", 2))

        parser.error = json_error
    args = parser.parse_args(argv)
    try:
        options = _options(args)
        resolved = options.resolve()
    except ExporterError as error:
        return _failed(args, str(error), 2)
    precision = resolved.precision
    # A folder's own name (`.` resolved), a hub id's last part, or the preset's name.
    model_path = Path(str(args.model))
    model_name = model_path.resolve().name if model_path.exists() else model_path.name
    output = args.output or Path(f"{model_name}-{args.ep}-{precision}")
    print(f"Exporting {args.model} for {args.ep} into {output}", file=sys.stderr)
    with _sigterm_as_interrupt():
        return _export(args, output, options, _replay_inputs(args, options, resolved) if replays else None)


class Terminated(KeyboardInterrupt):
    """SIGTERM (timeout, CI runners, container stops), handled like Ctrl-C."""


@contextlib.contextmanager
def _sigterm_as_interrupt():
    def terminate(signum, frame):
        raise Terminated()

    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclasses.dataclass(frozen=True)
class ReplayInputs:
    """What a replay of this command's export is keyed on (``exporter.cache.replay``)."""

    root: Path
    folder: Path
    ingredients: dict


def _replay_inputs(args, options: ExportOptions, resolved: ResolvedOptions) -> ReplayInputs | None:
    """The replay key's inputs, where this command could replay or record one: a folder of
    safetensors, the cache on, and no option that builds or runs other code."""
    if not args.cache or args.random_weights or args.trust_remote_code or str(args.model) in PRESET_NAMES:
        return None  # a preset's name exports the preset even where a folder has that name
    try:  # any input these cannot read (a folder or cache path): the export says what is wrong
        root = chosen_folder(args.cache_dir or True)
        folder = Path(str(args.model)).expanduser()
        if root is None or not folder.is_dir() or not any(folder.glob("*.safetensors")):
            return None
    except Exception:
        return None
    try:
        return ReplayInputs(root, folder, replay.fingerprint(folder, options.replay_key(resolved)))
    except Exception:  # an unreadable file, or not safetensors: the export says what is wrong
        return None


def _export(args, output: Path, options: ExportOptions, replay_inputs: ReplayInputs | None) -> int:
    replayed = None
    try:
        if replay_inputs is not None:
            print("  looking for a replay of this folder's export ...", file=sys.stderr)
            replayed = replay.replay(replay_inputs.root, replay_inputs.ingredients, replay_inputs.folder, output,
                                     args.overwrite)
        if replayed is None:
            result = _full_export(args, output, options)
    except ExporterError as error:
        if args.debug:
            raise
        return _failed(args, str(error), error.exit_code)
    except KeyboardInterrupt as interrupt:
        terminated = isinstance(interrupt, Terminated)
        return _failed(args, f"{'terminated' if terminated else 'interrupted'}; nothing was written",
                       143 if terminated else 130)
    except OSError as error:
        if args.debug:
            raise
        if (mapped := environment_error(error)) is None:
            return _unexpected(args, error)
        return _failed(args, str(mapped), 2)
    except Exception as error:  # a bug, not bad input: still one line, nothing left behind
        if args.debug:
            raise
        return _unexpected(args, error)
    if replayed is not None:
        return _print_result(args, replayed.path, replayed.report)
    if replay_inputs is not None:
        print(f"replay: {_record_replay(replay_inputs, result)}", file=sys.stderr)
    return _print_result(args, result.path, result.report)


def _full_export(args, output: Path, options: ExportOptions):
    """The export itself: torch and transformers are imported here, once a replay did not serve."""
    from exporter.pipeline import export

    return export(args.model, output_dir=output, overwrite=args.overwrite, progress=True,
                  cache=(args.cache_dir or True) if args.cache else False, **options.keywords())


def _record_replay(inputs: ReplayInputs, result) -> str:
    """Records the package as a replay for later exports of this folder's architecture; says
    whether it did, and why not."""
    from exporter.cache import graph_cache

    if result.weight_origins is None:
        return (f"not recorded: {result.weight_origins_why_not} (only packages whose every weight is a checkpoint "
                "tensor copied, converted or transposed replay)")
    try:
        if replay.fingerprint(inputs.folder, inputs.ingredients["options"]) != inputs.ingredients:
            return "not recorded: the folder changed during the export"
        report = json.loads((result.path / REPORT_FILENAME).read_text())
        why_not = replay.record(inputs.root, inputs.ingredients, inputs.folder, result.path, result.weight_origins,
                                report)
        if why_not is None:
            with contextlib.suppress(OSError):  # another export pruning the same cache
                graph_cache.prune(inputs.root, keep=inputs.root / replay.key_of(inputs.ingredients))
    except OSError as error:
        why_not = f"the cache could not be written ({error.strerror or error})"
    except KeyboardInterrupt:  # the package is written and complete; only its replay is lost
        why_not = "interrupted"
    except Exception as error:  # a bug in recording costs the next export its time, never this package
        why_not = f"unexpected {type(error).__name__}: {error}; please report it"
    return f"not recorded: {why_not}" if why_not else f"recorded ({replay.key_of(inputs.ingredients)[:12]})"


def _print_result(args, path: Path, report) -> int:
    if args.json:
        print(json.dumps(package_summary(path, report), indent=2))
        return 0
    nodes = sum(sum(s.op_counts.values()) for s in report.sessions.values())
    weight_bytes = sum(s.initializers["total_bytes"] for s in report.sessions.values())
    sessions = f" in {len(report.sessions)} sessions ({', '.join(report.sessions)})" if len(report.sessions) > 1 else ""
    print(
        f"Wrote {path} in {report.total_seconds:.1f} s: {nodes} ONNX nodes{sessions}, "
        f"{weight_bytes / 2**20:.1f} MiB of weights, "
        f"{len(report.layout['kv_layers'])} KV-cache layers of {report.layout['num_layers']}"
    )
    print(f"graph cache: {describe_graph_cache(report.graph_cache)}")
    for note in report.notes:
        print(f"note: {note}")
    return 0


def _failed(args, message: str, code: int) -> int:
    """The one-line error on stderr; with --json, also a JSON summary of the failure on stdout."""
    print(f"error: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps({"ok": False, "exit_code": code, "error": message}, indent=2))
    return code


def _unexpected(args, error: BaseException) -> int:
    return _failed(args, f"unexpected {type(error).__name__}: {error}; nothing was written. "
                         "Rerun with --debug for the traceback and please report it", 1)
