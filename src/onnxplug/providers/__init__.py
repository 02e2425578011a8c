"""Execution providers that ship with onnxplug (each written against ``onnxplug.ep`` only)."""
