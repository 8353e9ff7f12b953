"""``python -m exporter check PACKAGE --ep NAME``: check a package against an EP profile.

Each check yields a Finding (passed or failed, with a one-line detail). The CLI prints them and exits
non-zero if any failed; ``--json`` prints them as JSON for CI scripts. Checks: the files exist and
load, opset domains are ones ONNX Runtime runs, every op's types are ones its ONNX schema allows,
the largest initializer fits the profile's buffer limit, genai_config.json agrees with the graph
(I/O names, KV layers, head dims, vocabulary) and loads in ONNX Runtime GenAI, an ONNX Runtime
session with the profile's provider and the package's provider options (graph capture included)
places every node (on the EP, or the CPU where the profile allows), and a short greedy
generation (from a prompt past the recorded sliding window and past 64 tokens) runs on the CPU
and, where the EP is installed, gives the same tokens on the EP, with logits within the
precision's ``ep_logits`` bound of the CPU's until the tokens part (on a software adapter the
prompt goes in ``AttentionKernel.software_adapter_query_rows`` tokens at a time).
Checks that need an EP this machine lacks are reported as skipped. With ``--against SOURCE``,
the package is also compared with transformers running the source (``exporter.verify.check_against``).

A multimodal package (Gemma 4: decoder, embedding, vision and speech sessions) is checked session by
session: domains and buffer limits of every graph, each section's I/O mapping against its graph (a
missing ``per_layer_inputs`` mapping fails: GenAI would run and be silently wrong), the processor
configs load, each session's placement on the EP (only the decoder's must be all on the EP when it
is captured), and a greedy generation from a generated image and audio clip.

No check passes a number that is not finite: NaN compares false with any bound, so a package whose
logits are all NaN would pass ``difference > tolerance`` and pick token 0 at every step. Each
generation's logits, and a multimodal package's features and embeddings, are checked finite
(``nonfinite``) before anything compares them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from ep_profiles import EpProfile
from exporter.onnx_passes.schema_types import dtype_refusals
from exporter.package.files import GENAI_CONFIG_FILENAME, MODEL_FILENAME, REPORT_FILENAME
from exporter.package.integrity import damaged_files, edited_files, is_model_file, recorded_files
from exporter.precisions import PRECISIONS
from exporter.units import size_text
from exporter.verify import postconditions
from exporter.verify.distribution import nonfinite

KNOWN_DOMAINS = {"", "ai.onnx", "com.microsoft"}
SMOKE_TOKENS = 8
# The smoke prompt's cap: past a window of up to 1008 tokens; a larger one (Gemma 2's 4096) is
# `check --against`'s to pass, whose long prompt has no cap but the context.
SMOKE_PROMPT_MAX = 1024
SESSION_SECTIONS = ("decoder", "embedding", "vision", "speech")


@dataclass(frozen=True)
class Finding:
    check: str
    passed: bool
    detail: str
    skipped: bool = False  # could not run here (the EP is not installed); not a failure


def _step_name(step: int) -> str:
    """A generation step as the checks name it: the first runs the whole prompt."""
    return "step 0 (prefill)" if step == 0 else f"step {step}"


def _first_nonfinite(outputs: Iterable[tuple[str, np.ndarray]]) -> str | None:
    """'<output> not finite: <counts>' for the first of ``(output, values)`` with a NaN or Inf
    (given in the order they were computed: the first is the cause of the rest)."""
    for output, values in outputs:
        if counts := nonfinite(values):
            return f"{output} not finite: {counts}"
    return None


class _Context:
    def __init__(self, package: Path, profile: EpProfile):
        self.package = package
        self.profile = profile
        self.config = json.loads((package / GENAI_CONFIG_FILENAME).read_text())
        decoder = self.config["model"]["decoder"]
        self.model_path = package / decoder.get("filename", MODEL_FILENAME)
        self.graph = onnx.load(str(self.model_path), load_external_data=False)
        self.model = ir.load(str(self.model_path))  # weights stay on disk until read
        # Every session's graph (without weights), by section name; the decoder's first.
        self.session_paths = {name: package / section["filename"] for name in SESSION_SECTIONS
                              if isinstance(section := self.config["model"].get(name), dict) and section.get("filename")}
        self.graphs = {name: self.graph if name == "decoder" else onnx.load(str(path), load_external_data=False)
                       for name, path in self.session_paths.items()}

    @property
    def multimodal(self) -> bool:
        return len(self.session_paths) > 1


def check_package(package: Path, profile: EpProfile, against: Any = None) -> list[Finding]:
    """The checks below; with ``against`` (a preset, folder, hub id, alias or in-memory model) also
    the package against transformers on that source (``exporter.verify.check_against``)."""
    package = Path(package)
    missing = [name for name in (GENAI_CONFIG_FILENAME,) if not (package / name).is_file()]
    if not package.is_dir() or missing:
        return [Finding("files", False, f"'{package}' is not a package folder (no {GENAI_CONFIG_FILENAME})")]
    try:
        # Before anything parses them: a cut model.onnx is named, not a protobuf message.
        damage = damaged_files(package, _model_files(package))
        context = None if damage else _Context(package, profile)
    except Exception as error:  # unreadable config or model: nothing else can be checked
        return [Finding("files", False, f"cannot read the package: {error}")]
    if damage:  # ONNX Runtime would fail later with a deserialization message
        return [Finding("files", False, "; ".join(damage))]
    loaded = ", ".join(str(path.relative_to(package)) for path in context.session_paths.values())
    recorded = sum(is_model_file(name) for name in recorded_files(package))
    kept = (f"{recorded} graph and weights files match the size and sha256 recorded at export" if recorded
            else "NOT verified against sizes and sha256: no export_report.json file records (a package "
                 "from another exporter, or its report removed); only the external-data extents were checked")
    if edited := edited_files(package):
        kept += f"; edited since the export: {', '.join(edited)}"
    findings = [Finding("files", True, f"{loaded} and {GENAI_CONFIG_FILENAME} load; {kept}")]
    for check in _CHECKS:
        try:
            findings.extend(check(context))
        except Exception as error:
            findings.append(Finding(check.__name__.removeprefix("_check_"), False, f"{type(error).__name__}: {error}"))
    if against is not None:
        from exporter.errors import ExporterError
        from exporter.verify.check_against import compare_with_source

        try:
            results = compare_with_source(package, against, _precision(context), profile=profile)
            findings += [Finding(check, passed, detail, skipped=detail.startswith("not run:"))
                         for check, passed, detail in results]
        except ExporterError as error:
            findings.append(Finding("source", False, str(error)))
        except Exception as error:  # the comparison could not run: a failure, said in one line
            findings.append(Finding("source", False, f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"))
    return findings


def _model_files(package: Path) -> list[Path]:
    """Each session's model file, as genai_config.json names them."""
    model = json.loads((package / GENAI_CONFIG_FILENAME).read_text())["model"]
    return [package / section["filename"] for name in SESSION_SECTIONS
            if isinstance(section := model.get(name), dict) and section.get("filename")]


def _check_domains(context: _Context) -> Iterator[Finding]:
    used = {node.domain for graph in context.graphs.values() for node in graph.graph.node}
    unknown = sorted(used - KNOWN_DOMAINS)
    opsets = ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in context.graph.opset_import)
    yield Finding("domains", not unknown, f"unknown domains {unknown}" if unknown else f"opsets: {opsets}")


def _check_types(context: _Context) -> Iterator[Finding]:
    """Every op's types are ones its ONNX schema allows, one dtype per type parameter (ONNX Runtime
    refuses the session on any EP otherwise, as it did a bf16 speech tower's Conv)."""
    refused = {session: dtype_refusals(ir.from_proto(graph)) for session, graph in context.graphs.items()}
    refused = {session: found for session, found in refused.items() if found}
    detail = "; ".join(f"{session}: {', '.join(map(str, found[:3]))}"
                       f"{f' and {len(found) - 3} more' if len(found) > 3 else ''}" for session, found in refused.items())
    yield Finding("types", not refused, f"ops on types their ONNX schema does not allow: {detail}" if refused
                  else "every op's types are ones its ONNX schema allows")


def _check_buffer_limit(context: _Context) -> Iterator[Finding]:
    largest_name, largest = "", 0
    for session, graph in context.graphs.items():
        for tensor in graph.graph.initializer:
            size = int(np.prod(tensor.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
            if size > largest:
                largest = size
                largest_name = f"{session}: {tensor.name}" if context.multimodal else tensor.name
    limit = context.profile.max_buffer_size
    detail = f"largest initializer {largest_name} is {size_text(largest)}"
    if limit is None:
        yield Finding("buffer_limit", True, detail + f"; {context.profile.name} sets no limit")
    else:
        yield Finding("buffer_limit", largest <= limit, detail + f" (limit {size_text(limit)})")


def _check_genai_config(context: _Context) -> Iterator[Finding]:
    import onnxruntime_genai as og

    model = context.config["model"]
    decoder = model["decoder"]
    inputs = {i.name: i for i in context.graph.graph.input}
    outputs = {o.name: o for o in context.graph.graph.output}
    problems = []
    for key, name in decoder["inputs"].items():
        if "%d" not in name and name not in inputs:
            problems.append(f"input {key}='{name}' is not a graph input")
    for key, name in decoder["outputs"].items():
        if "%d" not in name and name not in outputs:
            problems.append(f"output {key}='{name}' is not a graph output")
    past_pattern = re.compile(re.escape(decoder["inputs"]["past_key_names"]).replace("%d", r"(\d+)"))
    present_pattern = re.compile(re.escape(decoder["outputs"]["present_key_names"]).replace("%d", r"(\d+)"))
    past_layers = sorted(int(m.group(1)) for n in inputs if (m := past_pattern.fullmatch(n)))
    present_layers = sorted(int(m.group(1)) for n in outputs if (m := present_pattern.fullmatch(n)))
    if not past_layers or past_layers != present_layers:
        problems.append(f"past KV layers {past_layers} and present KV layers {present_layers} differ")
    if any(i >= decoder["num_hidden_layers"] for i in past_layers):
        problems.append(f"KV layer index beyond num_hidden_layers={decoder['num_hidden_layers']}")
    if past_layers:
        dims = inputs[decoder["inputs"]["past_key_names"] % past_layers[0]].type.tensor_type.shape.dim
        kv_heads, head_size = dims[1].dim_value, dims[3].dim_value
        if (kv_heads, head_size) != (decoder["num_key_value_heads"], decoder["head_size"]):
            problems.append(
                f"first KV input has {kv_heads} heads x {head_size}, genai_config says "
                f"{decoder['num_key_value_heads']} x {decoder['head_size']}"
            )
    logits_dims = outputs[decoder["outputs"]["logits"]].type.tensor_type.shape.dim
    if logits_dims and logits_dims[-1].dim_value not in (0, model["vocab_size"]):
        problems.append(f"logits width {logits_dims[-1].dim_value} != vocab_size {model['vocab_size']}")
    if context.config["search"]["max_length"] > model["context_length"]:
        problems.append("search.max_length exceeds context_length")
    not_in_place = postconditions.presents_not_in_place(context.model)
    if context.config["search"].get("past_present_share_buffer") and not_in_place:
        problems.append(
            f"past_present_share_buffer is on but {len(not_in_place)} present outputs (e.g. {not_in_place[0]}) "
            "are not written by GroupQueryAttention (other attention cannot write into a shared KV buffer)"
        )
    providers = [name for entry in decoder["session_options"].get("provider_options", []) for name in entry]
    wanted = [context.profile.genai_provider] if context.profile.genai_provider else []
    if providers != wanted:
        problems.append(f"provider_options name {providers or 'the CPU'}, profile {context.profile.name} "
                        f"expects {wanted or 'the CPU'}")
    og.Config(str(context.package))
    yield Finding(
        "genai_config",
        not problems,
        "; ".join(problems) or f"consistent with the graph ({len(past_layers)} KV layers); loads in ONNX Runtime GenAI",
    )


def _provider_options(context: _Context, section: str = "decoder") -> dict[str, str]:
    """A session's own options for the profile's provider (graph capture included)."""
    for entry in context.config["model"][section].get("session_options", {}).get("provider_options", []):
        if context.profile.genai_provider in entry:
            return dict(entry[context.profile.genai_provider])
    return {}


def _check_graph_capture(context: _Context) -> Iterator[Finding]:
    """A package that asks for graph capture computes no shape on the CPU (read off the graph, so
    it runs where the EP is not installed too)."""
    if _provider_options(context).get(context.profile.graph_capture_option or "-") != "1":
        yield Finding("graph_capture", True, "graph capture off: the CPU may take shape work")
        return
    if not context.config["search"].get("past_present_share_buffer"):
        # ONNX Runtime GenAI captures only decoders whose past and present share one buffer.
        yield Finding("graph_capture", False, "graph capture is on but past_present_share_buffer is off")
        return
    on_cpu = postconditions.cpu_placed_nodes(context.model)
    yield Finding("graph_capture", not on_cpu,
                  f"{len(on_cpu)} nodes would run on the CPU ({postconditions.describe(on_cpu)})" if on_cpu
                  else "no node computes a shape on the CPU: the graph can be captured")


def _check_session(context: _Context) -> Iterator[Finding]:
    """Each session loads on the EP; where its nodes run (reported per session)."""
    from exporter.verify.ep_runtime import EpUnavailable, inference_session, placement

    provider = context.profile.ort_provider
    for name, path in context.session_paths.items():
        check = "session" if name == "decoder" else f"session_{name}"
        options = _provider_options(context, name)
        try:
            session = inference_session(path, context.profile, options)
        except EpUnavailable as error:
            yield Finding(check, True, f"not run: {error}", skipped=True)
            return
        placed = placement(session)
        del session
        elsewhere = {ep: ops for ep, ops in placed.items() if ep != provider}
        on_ep = sum(placed.get(provider, {}).values())
        if not elsewhere:
            yield Finding(check, True, f"all {on_ep} nodes run on {provider}")
            continue
        where = "; ".join(f"{sum(ops.values())} on {ep} ({', '.join(sorted(ops))})" for ep, ops in elsewhere.items())
        # A captured graph cannot have CPU nodes; without capture the CPU may take shape work.
        captured = options.get(context.profile.graph_capture_option) == "1"
        yield Finding(check, not captured, f"{on_ep} nodes on {provider}, {where}"
                      + (" (graph capture needs every node on the EP)" if captured else ""))


def _check_multimodal_config(context: _Context) -> Iterator[Finding]:
    """A multimodal package's other sections agree with their graphs, the embedding's outputs
    reach the decoder and only the decoder is captured (the processor configs load in ``multimodal_generation``)."""
    if not context.multimodal:
        return
    import onnxruntime_genai as og

    model, problems = context.config["model"], []
    if model.get("type") != "gemma4":
        problems.append(f"type is '{model.get('type')}'; ONNX Runtime GenAI runs a package with an embedding "
                        "session only as 'gemma4'")
    for name in SESSION_SECTIONS[1:]:
        section = model.get(name)
        if name not in context.graphs:
            if name != "speech" or section is None or section.get("filename"):
                # Without audio GenAI still wants a speech section, with an empty config_filename.
                problems.append(f"no {name} session" if section is None or name != "speech"
                                else "speech names a file that is not there")
            continue
        graph = context.graphs[name].graph
        inputs, outputs = {i.name for i in graph.input}, {o.name for o in graph.output}
        for key, value in section.get("inputs", {}).items():
            if value not in inputs:
                problems.append(f"{name} input {key}='{value}' is not a graph input")
        missing = inputs - set(section.get("inputs", {}).values())
        if missing:
            problems.append(f"{name} graph inputs {sorted(missing)} have no mapping")
        for key, value in section.get("outputs", {}).items():
            if value not in outputs:
                problems.append(f"{name} output {key}='{value}' is not a graph output")
        if _provider_options(context, name).get(context.profile.graph_capture_option or "-") == "1":
            problems.append(f"{name} asks for graph capture, which ONNX Runtime GenAI gives the decoder only")
    embedding_outputs = model.get("embedding", {}).get("outputs", {})
    decoder_inputs = model["decoder"]["inputs"]
    decoder_graph_inputs = {i.name for i in context.graph.graph.input}
    for key in ("inputs_embeds", "per_layer_inputs"):
        if key in decoder_graph_inputs and (key not in embedding_outputs or key not in decoder_inputs):
            # Without the mapping GenAI feeds the decoder nothing there and generates garbage.
            problems.append(f"'{key}' is a decoder input but not mapped in both embedding.outputs and decoder.inputs")
    og.Config(str(context.package))  # GenAI parses every section
    yield Finding("multimodal_config", not problems, "; ".join(problems) or
                  f"sessions {', '.join(context.session_paths)} match their sections")


# The processor tensor a session's input key reads, where the processor names it otherwise.
_PROCESSOR_NAMES = {"attention_mask": "audio_attention_mask"}  # the speech section's


def _multimodal_greedy(context: _Context, on_cpu: bool) -> tuple[list[int], list[np.ndarray], str | None]:
    """Greedy tokens for a prompt with a generated image and audio clip, through GenAI's
    processor, the logits each was chosen from, and the first output of any session that is not
    finite (``_first_nonfinite``)."""
    import tempfile

    import onnxruntime_genai as og

    from exporter.verify.ep_runtime import genai_config
    from exporter.verify.sample_media import gradient_image, tone, write_png, write_wav

    model = og.Model(genai_config(context.package, on_cpu))
    with tempfile.TemporaryDirectory() as folder:
        image = write_png(Path(folder) / "image.png", gradient_image())
        has_speech = "speech" in context.session_paths
        audio = write_wav(Path(folder) / "audio.wav", tone()) if has_speech else None
        prompt = "<|image|>" + ("<|audio|>" if has_speech else "") + " Describe."
        processor = model.create_multimodal_processor()
        inputs = processor(prompt, images=og.Images.open(str(image)),
                           audios=og.Audios.open(str(audio)) if audio else None)
    tensors = {name: inputs[name].as_numpy() for name in inputs.keys()}
    length = inputs["input_ids"].as_numpy().shape[-1]
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=length + SMOKE_TOKENS, do_sample=False, repetition_penalty=1.0, min_length=0)
    generator = og.Generator(model, params)
    generator.set_inputs(inputs)
    vocab, logits, problem = context.config["model"]["vocab_size"], [], None
    embedded = context.config["model"]["embedding"]["outputs"].values()
    while not generator.is_done():
        generator.generate_next_token()
        logits.append(np.array(generator.get_output("logits"), dtype=np.float32).reshape(-1)[-vocab:])
        step = _step_name(len(logits) - 1)
        problem = problem or _first_nonfinite(
            [(f"embedding output {name} at {step}", np.array(generator.get_output(name), dtype=np.float32))
             for name in embedded] + [(f"logits at {step}", logits[-1])])
    tokens = generator.get_sequence(0)[length:].tolist()
    del generator, model  # the feature sessions below load without GenAI's beside them
    # The features come before the embedding that reads them: a problem there is the cause.
    return tokens, logits, _first_nonfinite(_feature_outputs(context, tensors, on_cpu)) or problem


def _feature_outputs(context: _Context, tensors: dict[str, np.ndarray], on_cpu: bool) -> Iterator[tuple[str, np.ndarray]]:
    """The vision and speech sessions' outputs for the processor's tensors, on the CPU or the EP:
    GenAI runs these sessions but hands out none of their outputs, so they run again here."""
    from ep_profiles import get_profile
    from exporter.verify.ep_runtime import float32_outputs, inference_session

    for name in ("vision", "speech"):
        if name not in context.session_paths:
            continue
        session = inference_session(context.session_paths[name], get_profile("cpu") if on_cpu else context.profile,
                                    {} if on_cpu else _provider_options(context, name))
        feed = {graph_input: tensors[_PROCESSOR_NAMES.get(key, key)]
                for key, graph_input in context.config["model"][name]["inputs"].items()}
        for output, values in float32_outputs(session, feed).items():
            yield f"{name} output {output}", values


def _check_multimodal_generation(context: _Context) -> Iterator[Finding]:
    if not context.multimodal:
        return
    what = "image and audio" if "speech" in context.session_paths else "image"
    yield from _generations(context, "multimodal_generation", "multimodal_ep_generation", _multimodal_greedy,
                            f" from a generated {what}")


def _smoke_prompt(context: _Context) -> list[int]:
    """Token ids (no tokenizer needed) past the window the report records (up to SMOKE_PROMPT_MAX) and past 64 tokens,
    where attention kernels switch to tiled paths (WebGPU's was wrong from 32 query rows); a text
    prompt: a multimodal package's image and audio placeholders would want features."""
    from exporter.verify.check_against import LONG_PROMPT_MIN, PAST_THE_WINDOW

    vocab = context.config["model"]["vocab_size"]
    try:
        window = json.loads((context.package / REPORT_FILENAME).read_text())["layout"].get("sliding_window") or 0
    except (OSError, ValueError, KeyError):
        window = 0
    room = min(context.config["model"]["context_length"] - SMOKE_TOKENS, SMOKE_PROMPT_MAX)
    length = max(1, min(room, max(window + PAST_THE_WINDOW, LONG_PROMPT_MIN)))
    placeholders = {context.config["model"].get(key) for key in ("image_token_id", "audio_token_id")}
    candidates = ((17 * i + 2) % vocab for i in range(4 * length + 8))
    return [t for t in candidates if t not in placeholders][:length]


def _greedy(context: _Context, on_cpu: bool) -> tuple[list[int], list[np.ndarray], str | None]:
    """Greedy tokens, for each the logits it was chosen from, and the first of those not finite."""
    from exporter.verify.check_against import greedy_with_logits
    from exporter.verify.ep_runtime import prompt_chunk

    prompt = _smoke_prompt(context)
    chunk = None if on_cpu else prompt_chunk(context.profile)
    generation = greedy_with_logits(context.package, [prompt], SMOKE_TOKENS, on_cpu=on_cpu, chunk=chunk)[0]
    return generation.tokens, generation.logits, _first_nonfinite(
        (f"logits at {_step_name(step)}", values) for step, values in enumerate(generation.logits))


def _computes_in_bf16(context: _Context) -> bool:
    """Whether any decoder output (logits, present KV) is bf16: read off the graph, so a package
    without its report, or with fp32 logits, is judged alike."""
    return any(o.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16 for o in context.graph.graph.output)


def _precision(context: _Context) -> str:
    report = context.package / REPORT_FILENAME
    try:
        return json.loads(report.read_text())["precision"]
    except (OSError, ValueError, KeyError):
        return "fp32"  # unknown: the strictest


def _compare_generations(on_cpu, cpu_logits, on_ep, ep_logits, precision: str) -> tuple[bool, str]:
    """The EP's tokens against the CPU's, and its logits at every step before they part (the two
    runs see the same tokens up to there; ``ep_logits`` None: tokens only); both runs' logits were
    found finite by ``_generations``."""
    tolerance = PRECISIONS.get(precision, PRECISIONS["fp32"])
    step = next((i for i, (a, b) in enumerate(zip(on_cpu, on_ep, strict=False)) if a != b), None)
    shared = 0 if ep_logits is None else len(on_cpu) if step is None else step + 1  # the parting step saw the same tokens too
    pairs = list(zip(cpu_logits[:shared], (ep_logits or [])[:shared], strict=False))
    differences = [float(np.abs(ep - cpu).max()) for cpu, ep in pairs]
    bounds = [tolerance.logit_bound(tolerance.ep_logits, cpu) for cpu, _ in pairs]
    worst = max(differences, default=0.0)
    if over := [i for i, (d, b) in enumerate(zip(differences, bounds, strict=True)) if d > b]:
        at = over[0]
        return False, (f" (logits at {_step_name(at)} differ from the CPU's by {differences[at]:.3g}, over "
                       f"{bounds[at]:.3g} for {precision})")
    logits = f"; logits within {worst:.3g} of the CPU's over {len(differences)} steps" if differences else ""
    if on_ep == on_cpu:
        return True, f" ({logits[2:]})" if logits else ""
    if step is None:
        return False, " (CPU differs: a different length)"
    # How far the EP's token is below the best CPU logit at the step where they part.
    margin = float(cpu_logits[step].max() - cpu_logits[step][on_ep[step]])
    if margin <= tolerance.ep_near_tie:
        return True, (f" (from step {step} on, a near tie: on CPU the EP's token is {margin:.3g} below the best logit, "
                      f"within {tolerance.ep_near_tie} for {precision}{logits})")
    return False, (f" (CPU differs from step {step}: the EP's token is {margin:.3g} below the best CPU logit, over "
                   f"{tolerance.ep_near_tie} for {precision})")


def _check_smoke_generation(context: _Context) -> Iterator[Finding]:
    yield from _generations(context, "smoke_generation", "ep_generation", _greedy, "")


def _generations(context: _Context, cpu_check: str, ep_check: str, greedy, source: str) -> Iterator[Finding]:
    """Greedy tokens on the CPU, in the vocabulary; then on the EP where it is installed, the same
    as the CPU's up to near ties. A bf16 package has no CPU run (ONNX Runtime's CPU EP has no bf16
    kernels for most ops): its EP tokens are checked to be in the vocabulary only. Either run fails
    on the first session output (logits, features, embeddings) that is not finite, naming its step."""
    from exporter.verify.ep_runtime import EpUnavailable, prompt_chunk, register

    vocab = context.config["model"]["vocab_size"]
    precision = _precision(context)
    on_cpu = cpu_logits = None
    if _computes_in_bf16(context):
        yield Finding(cpu_check, True, "not run on the CPU: ONNX Runtime's CPU EP has no bf16 kernels for most ops",
                      skipped=True)
    else:
        on_cpu, cpu_logits, problem = greedy(context, on_cpu=True)
        if problem:
            yield Finding(cpu_check, False, f"on CPU{source}, {problem}")
            on_cpu = None  # tokens picked from such logits are nothing to hold the EP's to: those stand alone
        else:
            in_range = bool(on_cpu) and all(0 <= t < vocab for t in on_cpu)
            yield Finding(cpu_check, in_range, f"greedy tokens on CPU{source}: {on_cpu}")
    if not context.profile.genai_provider:
        return
    try:
        register(context.profile, genai=True)
        on_ep, ep_logits, problem = greedy(context, on_cpu=False)
    except EpUnavailable as error:
        yield Finding(ep_check, True, f"not run: {error}", skipped=True)
        return
    if problem:
        yield Finding(ep_check, False, f"on {context.profile.ort_provider}{source}, {problem}")
        return
    if on_cpu is None:
        in_range = bool(on_ep) and all(0 <= t < vocab for t in on_ep)
        yield Finding(ep_check, in_range, f"greedy tokens on {context.profile.ort_provider}{source}: {on_ep}")
        return
    chunk = prompt_chunk(context.profile)
    # GenAI takes a multimodal prompt whole (its processor's inputs): on such an adapter its
    # logits would show the adapter's fault, not the package's.
    unchunked = chunk and greedy is not _greedy
    agree, why = _compare_generations(on_cpu, cpu_logits, on_ep, None if unchunked else ep_logits, precision)
    if unchunked:
        why += (f"; tokens only: a software adapter, whose attention is exact up to {chunk} query rows, and GenAI feeds "
                "this prompt at once")
    elif chunk:
        why += f"; a software adapter: the prompt fed {chunk} tokens at a time"
    yield Finding(ep_check, agree, f"greedy tokens on {context.profile.ort_provider}{source}: {on_ep}{why}")


_CHECKS: tuple[Callable[[_Context], Iterator[Finding]], ...] = (
    _check_domains,
    _check_types,
    _check_buffer_limit,
    _check_genai_config,
    _check_graph_capture,
    _check_multimodal_config,
    _check_session,
    _check_smoke_generation,
    _check_multimodal_generation,
)


def format_findings(findings: list[Finding]) -> str:
    width = max(len(f.check) for f in findings)
    lines = [f"{'SKIP' if f.skipped else 'PASS' if f.passed else 'FAIL'}  {f.check:<{width}}  {f.detail}"
             for f in findings]
    failed = sum(not f.passed for f in findings)
    skipped = sum(f.skipped for f in findings)
    lines.append(f"{len(findings) - failed - skipped} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
    return "\n".join(lines)


def findings_to_json(findings: list[Finding]) -> str:
    return json.dumps(
        {"passed": all(f.passed for f in findings), "findings": [asdict(f) for f in findings]}, indent=2
    )
