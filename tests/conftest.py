"""Shared fixtures: each family's test checkpoint is built and exported once per test session and
reused by every test that reads its package (exports cost 5-20 s each on 2 cores).

A family's test checkpoint is its preset with every saved tensor that init leaves constant moved
away from that constant (``tests.helpers.checkpoints``), saved by ``save_pretrained``; the reference
model is what transformers loads back from that folder. Packages are exported from the folder
(weights streamed, as a user's checkpoint) or from the loaded model in memory."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

# Tests never reach the Hugging Face hub: make any attempt fail at once instead of timing out.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Exports here, in-process and by the CLI, do not share the graph cache: each test sees the steps it
# asks for, and the user's cache folder is never written. The cache's own tests name a folder.
os.environ["GENAI_EXPORTER_NO_CACHE"] = "1"

from ep_profiles import get_profile
from exporter import ExportedPackage, export
from tests.helpers.checkpoints import perturbed_preset_checkpoint
from tests.helpers.families import FAMILIES

# The CPU profile without GroupQueryAttention: transformers' own attention (MatMul/Softmax), the
# form a profile that cannot run GroupQueryAttention exports.
PLAIN_ATTENTION_CPU = get_profile("cpu").with_plain_attention()



# Where a package's weights come from: the checkpoint folder (streamed) or the model in memory.
SOURCES = ("folder", "memory")


@dataclass
class Checkpoint:
    folder: Path
    model: object  # what transformers' from_pretrained loads from the folder: the reference
    tokenizer: object


@dataclass
class ExportedPreset:
    name: str
    package: ExportedPackage
    model: object  # the reference model (transformers' load of the checkpoint)
    tokenizer: object
    checkpoint: Path  # the test checkpoint folder


class PresetExports:
    def __init__(self, root: Path):
        self.root = root
        self._checkpoints: dict[str, Checkpoint] = {}
        self._cache: dict[str, ExportedPreset] = {}

    def checkpoint(self, name: str) -> Checkpoint:
        if name not in self._checkpoints:
            folder = self.root / "checkpoints" / name
            model, tokenizer = perturbed_preset_checkpoint(name, folder)
            self._checkpoints[name] = Checkpoint(folder, model, tokenizer)
        return self._checkpoints[name]

    def get(self, name: str, plain_attention: bool = False, source: str = "folder") -> ExportedPreset:
        key = f"{name}-{source}" + ("-plain-attention" if plain_attention else "")
        if key not in self._cache:
            checkpoint = self.checkpoint(name)
            profile = PLAIN_ATTENTION_CPU if plain_attention else "cpu"
            if source == "folder":
                package = export(str(checkpoint.folder), ep=profile, output_dir=self.root / key)
            else:
                package = export(checkpoint.model, checkpoint.tokenizer, ep=profile, output_dir=self.root / key)
            self._cache[key] = ExportedPreset(name, package, checkpoint.model, checkpoint.tokenizer, checkpoint.folder)
        return self._cache[key]


@pytest.fixture(scope="session")
def preset_exports(tmp_path_factory) -> PresetExports:
    return PresetExports(tmp_path_factory.mktemp("presets"))


@pytest.fixture(params=[(f, s) for f in FAMILIES for s in SOURCES], ids=lambda p: f"{p[0]}-{p[1]}")
def family_export(request, preset_exports) -> ExportedPreset:
    family, source = request.param
    return preset_exports.get(family, source=source)


def pytest_collection_modifyitems(items):
    """Under pytest-xdist (--dist loadgroup), keep every test of one family on one worker, so each
    checkpoint is built and exported once per run rather than once per worker."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        param = callspec.params.get("family_export") if callspec else None
        if param is not None:
            item.add_marker(pytest.mark.xdist_group(param[0]))


def pytest_configure(config):
    # Two workers on two cores: one intra-op thread each avoids oversubscription.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
