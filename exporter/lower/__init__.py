"""Lower: the FX-passed program to an ONNX model with ONNX Runtime GenAI's names."""
