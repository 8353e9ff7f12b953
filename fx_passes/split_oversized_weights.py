"""Split every weight larger than the EP's buffer limit into pieces that fit.

WebGPU, for one, cannot bind a buffer over 256 MiB; Gemma 4 E2B's fused per-layer embedding table
[262144, 35*256] is 4.4 GiB in fp16 and its main embedding / tied LM head 768 MiB. Each use of an
oversized weight is rewritten so the result is identical:

- an embedding lookup splits the table by columns (each piece a lookup, results concatenated along
  the last axis; for the per-layer table the pieces fall on layer boundaries when sizes allow);
- a linear layer without bias (e.g. a tied LM head) splits the weight by output rows, the partial
  outputs concatenated along the last axis.

A weight used any other way cannot be split safely and is an error naming the op. The pass acts
only when the profile sets ``max_buffer_size`` and reads sizes at the export precision.
"""

from __future__ import annotations

import math

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

from fx_passes.analyses.graph_facts import PassDidNotApply, set_fake_value
from fx_passes.base import Settings, add_parameter

_aten = torch.ops.aten
_EMBEDDING, _LINEAR = _aten.embedding.default, _aten.linear.default


def piece_bounds(size: int, other: int, element_bytes: float, limit: int, multiple_of: int = 1) -> list[tuple[int, int]]:
    """Cut ``size`` (rows or columns) into the fewest near-equal pieces of at most ``limit`` bytes,
    preferring cuts on multiples of ``multiple_of`` (e.g. one layer's width in a per-layer table)."""
    max_cut = int(limit // (other * element_bytes))
    if max_cut < 1:
        raise PassDidNotApply(f"a single row/column of {other} elements already exceeds {limit} bytes")
    if multiple_of > 1 and max_cut >= multiple_of and size % multiple_of == 0:
        units = size // multiple_of
        per_piece = (max_cut // multiple_of) * multiple_of
        count = math.ceil(size / per_piece)
        step = math.ceil(units / count) * multiple_of
    else:
        count = math.ceil(size / max_cut)
        step = math.ceil(size / count)
    return [(start, min(start + step, size)) for start in range(0, size, step)]


class SplitOversizedWeights:
    name = "split_oversized_weights"

    def applies(self, settings, session) -> str | None:
        limit = settings.profile.max_buffer_size
        return None if limit is None else f"{settings.profile.name} holds at most {limit // 2**20} MiB in one buffer"

    def __call__(self, program: ExportedProgram, settings: Settings, session) -> tuple[ExportedProgram, dict[str, int]]:
        limit = settings.profile.max_buffer_size
        element_bytes = settings.stored_weight_bytes(session)
        graph = program.graph
        signature = program.graph_signature
        specs = {spec.arg.name: spec for spec in signature.input_specs if isinstance(spec.arg, TensorArgument)}
        weights_split = pieces_made = 0
        for placeholder in [n for n in graph.nodes if n.op == "placeholder"]:
            spec = specs.get(placeholder.name)
            if spec is None or spec.kind != InputKind.PARAMETER:
                continue
            weight = program.state_dict[spec.target]
            if weight.numel() * element_bytes <= limit:
                continue
            if not placeholder.users:  # e.g. the unused twin of a tied weight: drop, do not split
                self._remove_parameter(program, placeholder, spec)
                continue
            for use, user in enumerate(list(placeholder.users)):
                pieces_made += self._split_use(
                    program, placeholder, spec, weight, user, element_bytes, limit, settings, f"{spec.target}.use{use}"
                )
            weights_split += 1
            if not placeholder.users:
                self._remove_parameter(program, placeholder, spec)
        if weights_split:
            graph.lint()
            program.graph_module.recompile()
        return program, {"weights_split": weights_split, "pieces": pieces_made}

    def _split_use(self, program, placeholder, spec, weight, user, element_bytes, limit, settings, prefix) -> int:
        graph = program.graph
        if user.target is _EMBEDDING and user.args[0] is placeholder:
            rows, columns = weight.shape
            # Per-layer tables are [vocab, layers * width]: prefer cuts between layers.
            width = columns // settings.layout.num_layers if columns % settings.layout.num_layers == 0 else 1
            bounds = piece_bounds(columns, rows, element_bytes, limit, multiple_of=width)
            slices = [weight[:, a:b] for a, b in bounds]
        elif user.target is _LINEAR and user.args[1] is placeholder:
            if len(user.args) > 2 and user.args[2] is not None:
                raise PassDidNotApply(f"{self.name}: splitting a linear layer with a bias is not supported yet")
            rows, columns = weight.shape
            bounds = piece_bounds(rows, columns, element_bytes, limit)
            slices = [weight[a:b] for a, b in bounds]
        else:
            raise PassDidNotApply(
                f"{self.name}: weight {spec.target} ({tuple(weight.shape)}) is used by {user.target}; "
                "only embedding lookups and linear layers can be split"
            )
        parts = []
        for index, piece in enumerate(slices):
            piece_node = add_parameter(program, f"{prefix}.part{index}", piece.contiguous())
            args = list(user.args)
            if user.target is _EMBEDDING:
                args[0] = piece_node
            else:
                args[1] = piece_node
            with graph.inserting_before(user):
                parts.append(graph.call_function(user.target, tuple(args), dict(user.kwargs)))
            set_fake_value(parts[-1])
        with graph.inserting_before(user):
            joined = graph.call_function(_aten.cat.default, (parts, -1))
        set_fake_value(joined)
        user.replace_all_uses_with(joined)
        graph.erase_node(user)
        return len(parts)

    @staticmethod
    def _remove_parameter(program: ExportedProgram, placeholder: torch.fx.Node, spec: InputSpec) -> None:
        program.graph.erase_node(placeholder)
        program.graph_signature.input_specs.remove(spec)
        del program.state_dict[spec.target]
