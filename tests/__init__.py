"""onnxplug's test suite (a package, so that ``tests.plugins.*`` import from the repo root)."""
