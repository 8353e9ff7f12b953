"""Export Hugging Face decoder LMs to ONNX Runtime GenAI packages, through torch.export."""

from exporter.errors import ExporterError
from exporter.onnx_passes.quantize_int4 import Int4Options
from exporter.pipeline import ExportedPackage, export
from exporter.training import ExportOnSave

__all__ = ["ExportOnSave", "ExportedPackage", "ExporterError", "Int4Options", "export"]
