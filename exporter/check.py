"""``python -m exporter check PACKAGE --ep NAME``: check a package against an EP profile.

Each check yields a Finding (passed or failed, with a one-line detail). The CLI prints them and exits
non-zero if any failed; ``--json`` prints them as JSON for CI scripts. Checks: the files exist and
load, opset domains are ones ONNX Runtime runs, the largest initializer fits the profile's buffer
limit, genai_config.json agrees with the graph (I/O names, KV layers, head dims, vocabulary) and
loads in ONNX Runtime GenAI, an ONNX Runtime session with the profile's provider accepts every node,
and a short greedy generation runs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx

from ep_profiles import EpProfile
from exporter.package import GENAI_CONFIG_FILENAME, MODEL_FILENAME

KNOWN_DOMAINS = {"", "ai.onnx", "com.microsoft"}
SMOKE_TOKENS = 8


@dataclass(frozen=True)
class Finding:
    check: str
    passed: bool
    detail: str


class _Context:
    def __init__(self, package: Path, profile: EpProfile):
        self.package = package
        self.profile = profile
        self.config = json.loads((package / GENAI_CONFIG_FILENAME).read_text())
        decoder = self.config["model"]["decoder"]
        self.model_path = package / decoder.get("filename", MODEL_FILENAME)
        self.graph = onnx.load(str(self.model_path), load_external_data=False)


def check_package(package: Path, profile: EpProfile) -> list[Finding]:
    package = Path(package)
    missing = [name for name in (GENAI_CONFIG_FILENAME,) if not (package / name).is_file()]
    if not package.is_dir() or missing:
        return [Finding("files", False, f"'{package}' is not a package folder (no {GENAI_CONFIG_FILENAME})")]
    try:
        context = _Context(package, profile)
    except Exception as error:  # unreadable config or model: nothing else can be checked
        return [Finding("files", False, f"cannot read the package: {error}")]
    findings = [Finding("files", True, f"{context.model_path.name} and {GENAI_CONFIG_FILENAME} load")]
    for check in _CHECKS:
        try:
            findings.extend(check(context))
        except Exception as error:
            findings.append(Finding(check.__name__.removeprefix("_check_"), False, f"{type(error).__name__}: {error}"))
    return findings


def _check_domains(context: _Context) -> Iterator[Finding]:
    used = {node.domain for node in context.graph.graph.node}
    unknown = sorted(used - KNOWN_DOMAINS)
    opsets = ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in context.graph.opset_import)
    yield Finding("domains", not unknown, f"unknown domains {unknown}" if unknown else f"opsets: {opsets}")


def _check_buffer_limit(context: _Context) -> Iterator[Finding]:
    largest_name, largest = "", 0
    for tensor in context.graph.graph.initializer:
        size = int(np.prod(tensor.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        if size > largest:
            largest_name, largest = tensor.name, size
    limit = context.profile.max_buffer_size
    detail = f"largest initializer {largest_name} is {_size(largest)}"
    if limit is None:
        yield Finding("buffer_limit", True, detail + f"; {context.profile.name} sets no limit")
    else:
        yield Finding("buffer_limit", largest <= limit, detail + f" (limit {_size(limit)})")


def _size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if num_bytes < 1024:
            return f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.2f} GiB"


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
    attention_ops = sum(n.op_type == "GroupQueryAttention" for n in context.graph.graph.node)
    if context.config["search"].get("past_present_share_buffer") and attention_ops != decoder["num_hidden_layers"]:
        problems.append(
            f"past_present_share_buffer is on but only {attention_ops} of {decoder['num_hidden_layers']} layers "
            "use GroupQueryAttention (other attention cannot write into a shared KV buffer)"
        )
    og.Config(str(context.package))
    yield Finding(
        "genai_config",
        not problems,
        "; ".join(problems) or f"consistent with the graph ({len(past_layers)} KV layers); loads in ONNX Runtime GenAI",
    )


def _check_session(context: _Context) -> Iterator[Finding]:
    import onnxruntime as ort

    provider = context.profile.ort_provider
    if provider not in ort.get_available_providers():
        yield Finding("session", False, f"{provider} is not available in this onnxruntime build")
        return
    ort.InferenceSession(str(context.model_path), providers=[provider])
    yield Finding("session", True, f"{provider} accepts every node")


def _check_smoke_generation(context: _Context) -> Iterator[Finding]:
    import onnxruntime_genai as og

    model = og.Model(str(context.package))
    vocab = context.config["model"]["vocab_size"]
    prompt = np.array([[t % vocab for t in (2, 17, 42, 5, 99)]], dtype=np.int32)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=prompt.shape[1] + SMOKE_TOKENS, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    while not generator.is_done():
        generator.generate_next_token()
    generated = generator.get_sequence(0)[prompt.shape[1] :].tolist()
    in_range = bool(generated) and all(0 <= t < vocab for t in generated)
    yield Finding("smoke_generation", in_range, f"greedy tokens on CPU: {generated}")


_CHECKS: tuple[Callable[[_Context], Iterator[Finding]], ...] = (
    _check_domains,
    _check_buffer_limit,
    _check_genai_config,
    _check_session,
    _check_smoke_generation,
)


def format_findings(findings: list[Finding]) -> str:
    width = max(len(f.check) for f in findings)
    lines = [f"{'PASS' if f.passed else 'FAIL'}  {f.check:<{width}}  {f.detail}" for f in findings]
    failed = sum(not f.passed for f in findings)
    lines.append(f"{len(findings) - failed} passed, {failed} failed")
    return "\n".join(lines)


def findings_to_json(findings: list[Finding]) -> str:
    return json.dumps(
        {"passed": all(f.passed for f in findings), "findings": [asdict(f) for f in findings]}, indent=2
    )
