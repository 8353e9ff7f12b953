"""ONNX graphs compared by structure rather than by the names an export happened to give."""

from __future__ import annotations

import re

import onnx


def canonical_graph(path) -> tuple:
    """The graph with values named by where they are made: nodes (domain, op, inputs,
    attributes), graph inputs and outputs with their types. Generated constants' names (torch.onnx's
    ``val_N``, the static reshape targets' ``node_<node>_target_N``, which carry FX node names)
    are numbered by first use; weights keep their names."""
    graph = onnx.load(str(path), load_external_data=False).graph
    names = {value.name: value.name for value in graph.input}
    for tensor in graph.initializer:
        names[tensor.name] = None if re.fullmatch(r"val_\d+|node_\w+_target_\d+", tensor.name) else "weight:" + tensor.name
    nodes = []
    for node in graph.node:
        inputs = []
        for name in node.input:
            if names.get(name, "") is None:
                names[name] = f"constant{len(names)}"
            inputs.append(names.get(name, name))
        for name in node.output:
            names[name] = f"value{len(names)}"
        attributes = sorted((a.name, str(onnx.helper.get_attribute_value(a))) for a in node.attribute)
        nodes.append((node.domain, node.op_type, tuple(inputs), tuple(attributes)))
    io = [(v.name, str(v.type)) for v in [*graph.input, *graph.output]]
    return nodes, [names[v.name] for v in graph.output], io
