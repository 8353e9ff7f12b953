"""A model whose parameters hold no data: built on the meta device (buffers real, from transformers'
init), traced with fake tensors; and the names that tie its traced tensors to the checkpoint's."""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode


def build_on_meta(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """``build()`` run on the meta device, so no parameter is ever allocated (a 9.4 GB per-layer
    table costs nothing), then every buffer made real and given its value by transformers' own
    initialisation (rotary tables, scalars), with the parameters marked as initialised so that
    they stay on meta."""
    from transformers import initialization

    with torch.device("meta"), initialization.meta_device_safe_creation_ops():
        model = build()
    for name, buffer in list(model.named_buffers()):
        owner, _, attribute = name.rpartition(".")
        model.get_submodule(owner)._buffers[attribute] = torch.empty_like(buffer, device="cpu")
    for parameter in model.parameters():
        parameter._is_hf_initialized = True
    model.initialize_weights()
    return model


def persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's own buffers that ``state_dict()`` saves."""
    return [(name, buffer) for name, buffer in module._buffers.items()
            if buffer is not None and name not in module._non_persistent_buffers_set]


def fake_weights(model: torch.nn.Module, buffers: bool) -> None:
    """Swap each meta parameter, and with ``buffers`` each persistent buffer, for a fake CPU tensor
    of its shape and dtype: torch.export traces through them, and their values arrive when the
    package is written. Tied tensors stay one object."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    swapped: dict[int, torch.Tensor] = {}

    def fake_of(tensor: torch.Tensor, parameter: bool) -> torch.Tensor:
        if id(tensor) not in swapped:
            with mode:
                fake = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            swapped[id(tensor)] = torch.nn.Parameter(fake, requires_grad=False) if parameter else fake
        return swapped[id(tensor)]

    for module in model.modules():
        for name, parameter in list(module._parameters.items()):
            if parameter is not None and parameter.device.type == "meta":
                module._parameters[name] = fake_of(parameter, parameter=True)
        if buffers:
            for name, buffer in persistent_buffers(module):
                module._buffers[name] = fake_of(buffer, parameter=False)


def tied_aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """Every saved tensor name -> the names of the same tensor (itself first)."""
    groups: dict[int, list[str]] = collections.defaultdict(list)
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups[id(tensor)].append(name)
    return {name: [name, *(n for n in names if n != name)] for names in groups.values() for name in names}


def tensor_names(module: torch.nn.Module, model: torch.nn.Module) -> dict[str, str]:
    """Each saved tensor name of ``module`` (a part of ``model``, or a view holding its parts) ->
    the same tensor's name in ``model``, matched by identity."""
    saved = model.state_dict(keep_vars=True)
    in_model: dict[int, str] = {}
    for name, tensor in saved.items():
        in_model.setdefault(id(tensor), name)
    # A tied tensor keeps the name it has in the module where the model has that name too (the
    # checkpoint may hold it under that one only).
    return {name: name if saved.get(name) is tensor else in_model[id(tensor)]
            for name, tensor in module.state_dict(keep_vars=True).items() if id(tensor) in in_model}
