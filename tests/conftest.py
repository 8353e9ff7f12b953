"""Shared fixtures: each preset is exported once per test session and reused by every test that
reads its package (exports cost 5-20 s each on 2 cores)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

# Tests never reach the Hugging Face hub: make any attempt fail at once instead of timing out.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ep_profiles import get_profile
from exporter import ExportedPackage, export
from exporter.presets import build_preset

# The CPU profile without GroupQueryAttention: transformers' own attention (MatMul/Softmax), the
# form a profile that cannot run GroupQueryAttention exports.
PLAIN_ATTENTION_CPU = get_profile("cpu").with_plain_attention()

# Every decoder family the suite covers, as built-in presets (all random weights, offline).
FAMILIES = [
    "tiny-gemma-4",
    "tiny-llama",
    "tiny-qwen3",
    "tiny-mistral",
    "tiny-phi3",
    "tiny-gemma2",
    "tiny-granite",
]


@dataclass
class ExportedPreset:
    name: str
    package: ExportedPackage
    model: object  # the HF model the package was exported from
    tokenizer: object


class PresetExports:
    def __init__(self, root: Path):
        self.root = root
        self._cache: dict[str, ExportedPreset] = {}

    def get(self, name: str, plain_attention: bool = False) -> ExportedPreset:
        key = f"{name}-plain-attention" if plain_attention else name
        if key not in self._cache:
            model, tokenizer = build_preset(name)
            profile = PLAIN_ATTENTION_CPU if plain_attention else "cpu"
            package = export(model, tokenizer, ep=profile, output_dir=self.root / key)
            self._cache[key] = ExportedPreset(name, package, model, tokenizer)
        return self._cache[key]


@pytest.fixture(scope="session")
def preset_exports(tmp_path_factory) -> PresetExports:
    return PresetExports(tmp_path_factory.mktemp("presets"))


@pytest.fixture(params=FAMILIES)
def family_export(request, preset_exports) -> ExportedPreset:
    return preset_exports.get(request.param)


def pytest_collection_modifyitems(items):
    """Under pytest-xdist (--dist loadgroup), keep every test of one family on one worker, so each
    preset is exported once per run rather than once per worker."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        family = callspec.params.get("family_export") if callspec else None
        if family is not None:
            item.add_marker(pytest.mark.xdist_group(family))


def pytest_configure(config):
    # Two workers on two cores: one intra-op thread each avoids oversubscription.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
