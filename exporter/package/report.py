"""The export report: what ran, how long it took, and what the graph holds."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a replayed export writes its report without importing onnx_ir
    import onnx_ir as ir


def op_counts(model: ir.Model) -> dict[str, int]:
    counts = Counter(
        f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
        for node in model.graph.all_nodes()
    )
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def initializer_summary(model: ir.Model, largest: int = 5) -> dict[str, Any]:
    sizes = []
    for name, value in model.graph.initializers.items():
        tensor = value.const_value
        if tensor is not None:
            sizes.append((name, tensor.nbytes, list(tensor.shape.numpy()), str(tensor.dtype)))
    sizes.sort(key=lambda item: (-item[1], item[0]))
    return {
        "count": len(sizes),
        "total_bytes": sum(size for _, size, _, _ in sizes),
        "largest": [
            {"name": name, "bytes": size, "shape": shape, "dtype": dtype}
            for name, size, shape, dtype in sizes[:largest]
        ],
    }


@dataclass
class SessionReport:
    """One ONNX session of the package: the passes that ran on it and what its graph holds."""

    filename: str
    fx_passes: list[dict[str, Any]] = field(default_factory=list)
    onnx_passes: list[dict[str, Any]] = field(default_factory=list)
    op_counts: dict[str, int] = field(default_factory=dict)
    initializers: dict[str, Any] = field(default_factory=dict)
    graph_inputs: list[str] = field(default_factory=list)
    graph_outputs: list[str] = field(default_factory=list)
    # How torch.onnx lowered the traced graph: with or without re-tracing it to decompose it
    # (empty where the graph came from the graph cache).
    lowering: str = ""
    # How many decoder layers were traced and how many copied (``exporter.trace.layer_replicas``);
    # empty for other sessions and where the graph came from the graph cache.
    tracing: str = ""

    def describe_graph(self, model: ir.Model) -> None:
        self.op_counts = op_counts(model)
        self.initializers = initializer_summary(model)
        self.graph_inputs = [v.name for v in model.graph.inputs]
        self.graph_outputs = [v.name for v in model.graph.outputs]

    def onnx_pass_changes(self, name: str) -> dict[str, int]:
        """The counts an ONNX pass reported ({} where it did not run)."""
        return next((p["changes"] for p in self.onnx_passes if p["name"] == name), {})


@dataclass
class ExportReport:
    source: str
    ep: str
    precision: str
    layout: dict[str, Any]
    stages: list[dict[str, Any]] = field(default_factory=list)
    plan: dict[str, Any] = field(default_factory=dict)
    sessions: dict[str, SessionReport] = field(default_factory=dict)  # in package order
    files: dict[str, dict] = field(default_factory=dict)  # path -> {"bytes", "sha256"}
    notes: list[str] = field(default_factory=list)
    # The KV cache at genai_config's max_length: {"max_length", "element_bytes", "bytes"} (batch 1).
    kv_cache: dict[str, int] = field(default_factory=dict)
    # The graph cache (``exporter.cache.graph_cache``): {"folder", "key", "sessions": {name: "hit" |
    # "written" | why not written}}, or {"off": why}.
    graph_cache: dict[str, Any] = field(default_factory=dict)
    # fp16 activations: the decoder's float32 activation peaks on the calibration prompts and the
    # residual scale chosen from them (``exporter.load.activation_ranges``), or {"skipped": why}.
    activation_ranges: dict[str, Any] = field(default_factory=dict)
    # --int4-method awq: what the scale search measured (``exporter.load.activation_aware_scales``):
    # {"weights", "tokens", "unscaled" (those it left at s = 1), "mean_exponent", "seconds"}.
    activation_aware_scales: dict[str, Any] = field(default_factory=dict)
    # fp16 activations: the CPU EP's prefill of a sample prompt (``exporter.verify.sample_prefill``):
    # {"prompt", "prompt_tokens", "max_abs_logit", "seconds"}, or {"skipped": why}.
    sample_prefill: dict[str, Any] = field(default_factory=dict)

    @property
    def total_seconds(self) -> float:
        return sum(stage["seconds"] for stage in self.stages)

    # The decoder session's, which every package has: what most callers read.
    @property
    def decoder(self) -> SessionReport:
        return self.sessions["decoder"]

    @property
    def fx_passes(self) -> list[dict[str, Any]]:
        return self.decoder.fx_passes

    @property
    def onnx_passes(self) -> list[dict[str, Any]]:
        return self.decoder.onnx_passes

    @property
    def op_counts(self) -> dict[str, int]:
        return self.decoder.op_counts

    @property
    def initializers(self) -> dict[str, Any]:
        return self.decoder.initializers

    def onnx_pass_changes(self, name: str) -> dict[str, int]:
        return self.decoder.onnx_pass_changes(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "ep": self.ep,
            "precision": self.precision,
            "total_seconds": round(self.total_seconds, 3),
            "layout": self.layout,
            "stages": self.stages,
            "plan": self.plan,
            "sessions": {name: dataclasses.asdict(session) for name, session in self.sessions.items()},
            "files": self.files,
            "kv_cache": self.kv_cache,
            "graph_cache": self.graph_cache,
            "activation_ranges": self.activation_ranges,
            "activation_aware_scales": self.activation_aware_scales,
            "sample_prefill": self.sample_prefill,
            "notes": self.notes,
        }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ExportReport:
        """The report ``to_dict`` gave (its total is recomputed from the stages)."""
        fields = {k: v for k, v in values.items() if k not in ("total_seconds", "sessions")}
        return cls(**fields, sessions={name: SessionReport(**s) for name, s in values["sessions"].items()})

    def to_markdown(self) -> str:
        mib = 1024 * 1024
        lines = [
            "# Export report",
            "",
            f"- source: {self.source}",
            f"- execution provider: {self.ep}, precision: {self.precision}",
            f"- layers: {self.layout['num_layers']}, KV-owning layers: {len(self.layout['kv_layers'])}, "
            f"KV-shared layers: {self.layout['num_kv_shared_layers']}",
            f"- total: {self.total_seconds:.1f} s",
        ]
        if self.kv_cache:
            lines.append(f"- KV cache at max_length {self.kv_cache['max_length']}: "
                         f"{self.kv_cache['bytes'] / mib:.1f} MiB per sequence")
        if self.graph_cache:
            lines.append(f"- graph cache: {describe_graph_cache(self.graph_cache)}")
        if self.activation_ranges:
            lines.append(f"- fp16 range: {describe_activation_ranges(self.activation_ranges)}")
        if scales := self.activation_aware_scales:
            lines.append(f"- AWQ scales: {scales['weights']} linear layers searched on {scales['tokens']} tokens in "
                         f"{scales['seconds']:.1f} s, mean exponent {scales['mean_exponent']}, "
                         f"{scales['unscaled']} left unscaled")
        if self.sample_prefill:
            prefill = self.sample_prefill
            lines.append(f"- sample prefill on the CPU EP: skipped ({prefill['skipped']})" if "skipped" in prefill else
                         f"- sample prefill on the CPU EP: finite logits, largest |logit| {prefill['max_abs_logit']:g}")
        lines += [f"- note: {note}" for note in self.notes]
        lines += ["", "## Stages", "", "| stage | seconds | peak RSS MiB |", "|---|---:|---:|"]
        lines += [
            f"| {s['name']} | {s['seconds']:.2f} | {s['peak_rss_bytes'] / mib:.0f} |" for s in self.stages
        ]
        for name, session in self.sessions.items():
            lines += _session_markdown(name, session)
        return "\n".join(lines) + "\n"


def package_summary(path: Path, report: ExportReport) -> dict[str, Any]:
    """What CI scripts read (``--json``): where the package is, its sessions, sizes, passes, stage
    timings and notes; the full record is the package's export_report.json."""
    return {
        "ok": True,
        "package": str(path.resolve()),
        "source": report.source,
        "ep": report.ep,
        "precision": report.precision,
        "seconds": round(report.total_seconds, 3),
        "layers": report.layout["num_layers"],
        "kv_cache_layers": len(report.layout["kv_layers"]),
        "kv_cache": report.kv_cache,
        "graph_cache": report.graph_cache,
        "sessions": {
            name: {
                "file": session.filename,
                "onnx_nodes": sum(session.op_counts.values()),
                "weight_tensors": session.initializers["count"],
                "weight_bytes": session.initializers["total_bytes"],
                "fx_passes": [p["name"] for p in session.fx_passes],
                "onnx_passes": [p["name"] for p in session.onnx_passes],
                "lowering": session.lowering,  # empty for a graph-cache hit or a replay
                "tracing": session.tracing,  # likewise, and for sessions without decoder layers
            }
            for name, session in report.sessions.items()
        },
        "package_bytes": sum(p.stat().st_size for p in path.rglob("*") if p.is_file()),
        "files": {p.relative_to(path).as_posix(): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()},
        "stages": [{"name": stage["name"], "seconds": round(stage["seconds"], 3),
                    "peak_rss_bytes": stage["peak_rss_bytes"]} for stage in report.stages],
        "notes": report.notes,
    }


def describe_graph_cache(cache: dict[str, Any]) -> str:
    if "off" in cache:
        return f"off ({cache['off']})"
    sessions = ", ".join(f"{name} {state}" for name, state in cache["sessions"].items())
    return f"{sessions} (key {cache['key'][:12]} in {cache['folder']})"


def _session_markdown(name: str, session: SessionReport) -> list[str]:
    mib = 1024 * 1024
    lines = ["", f"## Session {name} ({session.filename})", ""]
    if session.tracing:
        lines += [f"Traced: {session.tracing}.", ""]
    if session.lowering:
        lines += [f"Lowered {session.lowering}.", ""]
    lines += ["### FX passes", "", "| pass | changes | seconds |", "|---|---|---:|"]
    lines += [
        f"| {p['name']} | {', '.join(f'{k}={v}' for k, v in p['changes'].items()) or '-'} | {p['seconds']:.3f} |"
        for p in session.fx_passes
    ]
    lines += ["", "### ONNX passes", "", "| pass | changes | nodes before | nodes after | seconds |",
              "|---|---|---:|---:|---:|"]
    lines += [
        f"| {p['name']} | {', '.join(f'{k}={v}' for k, v in p['changes'].items()) or '-'} | {p['nodes_before']} "
        f"| {p['nodes_after']} | {p['seconds']:.3f} |"
        for p in session.onnx_passes
    ]
    lines += ["", "### Operators", "", "| op | count |", "|---|---:|"]
    lines += [f"| {op} | {count} |" for op, count in session.op_counts.items()]
    init = session.initializers
    lines += [
        "",
        "### Initializers",
        "",
        f"{init.get('count', 0)} tensors, {init.get('total_bytes', 0) / mib:.1f} MiB in all. Largest:",
        "",
        "| name | shape | dtype | MiB |",
        "|---|---|---|---:|",
    ]
    lines += [
        f"| {t['name']} | {t['shape']} | {t['dtype']} | {t['bytes'] / mib:.1f} |" for t in init.get("largest", [])
    ]
    return lines


def describe_activation_ranges(ranges: dict[str, Any]) -> str:
    if "skipped" in ranges:
        return f"not calibrated ({ranges['skipped']})"
    k = ranges["residual_exponent"]
    scale = f"residual stream scaled by 2**-{k}" if k else "residual stream unscaled"
    return (f"float32 residual peak {ranges['residual_peak']:g} (layer {ranges['peak_layer']}) over "
            f"{ranges['prompts']} prompts, {scale}; largest other activation {ranges['other_peak']:g} "
            f"({ranges['other_module']})")
