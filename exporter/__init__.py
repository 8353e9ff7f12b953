"""Export Hugging Face decoder LMs to ONNX Runtime GenAI packages, through torch.export."""

from exporter.errors import ExporterError
from exporter.int4_options import Int4Options

__all__ = ["ExportOnSave", "ExportedPackage", "ExporterError", "Int4Options", "export"]

# Imported at first use: the pipeline imports torch and transformers (seconds), which a replayed
# command-line export (``exporter.cache.replay``) never needs; ExportOnSave also the Trainer's utilities
# (and peft where installed).
_LAZY = {"export": "exporter.pipeline", "ExportedPackage": "exporter.pipeline", "ExportOnSave": "exporter.training"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'exporter' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
