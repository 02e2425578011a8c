"""InferenceSession, options, OrtValue and IOBinding: the onnxruntime-compatible API."""
