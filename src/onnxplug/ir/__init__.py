"""Model loading, the graph IR and ONNX types."""
