"""Trace: the model with ONNX Runtime GenAI's inputs and outputs into one ``torch.export`` program,
each distinct decoder layer traced once."""
