"""onnxruntime's error classes under their usual import path."""

from ..errors import *  # noqa: F403
from ..errors import __all__  # noqa: F401
