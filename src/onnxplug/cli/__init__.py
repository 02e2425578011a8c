"""The onnxplug command line."""
