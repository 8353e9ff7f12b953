"""The custom ops FX passes insert (``torch.ops.genai_exporter.*``): each with a reference kernel, a fake
kernel and its ONNX translation. Not passes."""
