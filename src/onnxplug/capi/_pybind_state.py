"""``onnxplug.capi._pybind_state``: where onnxruntime scripts import the runtime's classes,
functions and error classes from (``onnxruntime.capi._pybind_state``)."""

from .. import *  # noqa: F403
from .. import __all__ as _public
from ..errors import *  # noqa: F403
from ..errors import __all__ as _errors

__all__ = [n for n in (*_public, *_errors) if n not in ("capi", "errors")]
