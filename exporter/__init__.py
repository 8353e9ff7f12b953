"""Export Hugging Face decoder LMs to ONNX Runtime GenAI packages, through torch.export."""

from exporter.errors import ExporterError
from exporter.pipeline import ExportedPackage, export

__all__ = ["ExportedPackage", "ExporterError", "export"]
