"""Export Hugging Face decoder LMs to ONNX Runtime GenAI packages, through torch.export."""

from exporter.errors import ExporterError
from exporter.onnx_passes.quantize_int4 import Int4Options
from exporter.pipeline import ExportedPackage, export

__all__ = ["ExportOnSave", "ExportedPackage", "ExporterError", "Int4Options", "export"]


def __getattr__(name: str):
    # ExportOnSave is a transformers TrainerCallback, whose module imports the Trainer's utilities
    # (and peft where installed): about 0.4 s that an export alone does not need.
    if name == "ExportOnSave":
        from exporter.training import ExportOnSave

        return ExportOnSave
    raise AttributeError(f"module 'exporter' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted({*globals(), "ExportOnSave"})
