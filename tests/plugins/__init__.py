"""Example provider plugins and model builders used by the tests."""
