"""Integrations of onnxplug with other frameworks (``onnxplug.integrations.ray``: Ray Data and
Ray Serve).

Each integration is a module of its own that imports its framework only when it is used, and
``import onnxplug`` imports none of them: a user without the framework pays nothing for it.
"""
