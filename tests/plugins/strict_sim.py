"""The host-simulated CUDA provider with CuPy's operator dispatch modelled, to find kernel code
that would make CuPy import ``cupyx.scipy.special`` (and with it cupyx and SciPy, 0.4-0.7 s) in
the middle of a run.

CuPy 14 runs ``cupy_array <op> operand`` through its own ufuncs only when the operand is a CuPy
array (or the array is the right operand of a Python scalar, ``2 * a``) and for in-place
operators; any other operand (a Python or numpy scalar, a numpy array) sends ``a <op> operand``
and ``a <cmp> operand`` through ``numpy.<ufunc>``, i.e. ``cupy.ndarray.__array_ufunc__``, whose
first line is ``import cupyx.scipy.special``. A numpy scalar or array on the left of a CuPy
array does the same. Kernels must call ``xp.<ufunc>(a, operand)`` there instead.

Here the simulated device's arrays are ``StrictArray`` (a numpy subclass) and ``xp`` is
``StrictNumpy`` (numpy whose results are StrictArrays); ``StrictArray.__array_ufunc__``
looks at the instruction of the frame that invoked it and records each operator CuPy would
have sent through numpy. Needs plugins/cuda/src on ``sys.path``.
"""

from __future__ import annotations

import ast
import dis
import functools
import sys
import threading
import types
from pathlib import Path
from typing import Any

import numpy as np

from onnxplug_cuda.sim import CudaSimEpFactory, NumpyBackend

# where kernel code wrote an operator CuPy sends through numpy: "file:line: what"
VIOLATIONS: list[str] = []

_via_xp = threading.local()  # set while StrictNumpy calls a numpy function for a kernel
_INPLACE_FIRST = 13  # BINARY_OP's oparg: NB_INPLACE_ADD and the in-place forms after it
_PLUGIN = "onnxplug_cuda"  # operators written elsewhere (numpy, the core, tests) are not kernels'
_ops: dict[types.CodeType, dict[int, dis.Instruction]] = {}


def _is_np(test: ast.expr) -> str | None:
    """ "body" for a test ``... is np`` (also inside ``and``), "orelse" for ``... is not np``."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return next((w for w in map(_is_np, test.values) if w == "body"), None)
    if (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.comparators[0], ast.Name)
        and test.comparators[0].id == "np"
    ):
        return {ast.Is: "body", ast.IsNot: "orelse"}.get(type(test.ops[0]))
    return None


@functools.cache
def _simulation_lines(filename: str) -> frozenset[int]:
    """Lines of the branches that run only under the simulation (``if xp is np:``)."""
    lines: set[int] = set()
    try:
        source = Path(filename).read_text()
    except OSError:  # code compiled from a string
        return frozenset()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If) and (where := _is_np(node.test)):
            for stmt in getattr(node, where):
                lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return frozenset(lines)


def _device_code(frame: types.FrameType) -> bool:
    """Whether a frame runs kernel code that computes on device arrays: plugin code that uses
    ``xp``, outside the simulation's own branches. Host-side numpy (tables of coefficients,
    shapes) and the simulation's numpy twins never name ``xp``."""
    code = frame.f_code
    if _PLUGIN not in code.co_filename:
        return False
    names = code.co_varnames + code.co_names + code.co_freevars
    return "xp" in names and frame.f_lineno not in _simulation_lines(code.co_filename)


def _instruction(frame: types.FrameType) -> dis.Instruction | None:
    code = frame.f_code
    table = _ops.get(code)
    if table is None:
        table = _ops[code] = {i.offset: i for i in dis.get_instructions(code)}
    return table.get(frame.f_lasti)


def _strict(x: Any) -> Any:
    if type(x) is np.ndarray:
        return x.view(StrictArray)
    if isinstance(x, tuple):
        return tuple(_strict(v) for v in x)
    if isinstance(x, list):
        return [_strict(v) for v in x]
    return x


def _plain(x: Any) -> Any:
    if isinstance(x, StrictArray):
        return x.view(np.ndarray)
    if isinstance(x, tuple):
        return tuple(_plain(v) for v in x)
    return x


def _sent_through_numpy(instr: dis.Instruction, inputs: tuple[Any, ...]) -> bool:
    """Whether CuPy would run this operator through ``numpy.<ufunc>`` (see the module doc)."""
    if instr.opname == "COMPARE_OP":
        return not all(isinstance(x, StrictArray) for x in inputs)
    if instr.opname != "BINARY_OP" or len(inputs) != 2:
        return False
    if instr.arg is not None and instr.arg >= _INPLACE_FIRST:
        return False  # in-place operators call CuPy's ufuncs with any operand
    left, right = inputs
    if not isinstance(right, StrictArray):
        return True
    return isinstance(left, np.generic | np.ndarray) and not isinstance(left, StrictArray)


class StrictArray(np.ndarray):
    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if not getattr(_via_xp, "on", False):
            caller = sys._getframe(1)
            instr = _instruction(caller) if _device_code(caller) else None
            if instr is not None and _sent_through_numpy(instr, inputs):
                kinds = ", ".join(type(x).__name__ for x in inputs)
                VIOLATIONS.append(
                    f"{caller.f_code.co_filename}:{caller.f_lineno} {caller.f_code.co_qualname}: {ufunc.__name__}({kinds})"
                )
        if "out" in kwargs:
            kwargs["out"] = _plain(kwargs["out"])
        out = getattr(ufunc, method)(*_plain(inputs), **kwargs)
        return _strict(out)


class _XpCall:
    """A numpy callable (function or ufunc) whose results are StrictArrays; ufunc methods
    (``reduce``, ``at``, ...) are wrapped the same way."""

    def __init__(self, fn: Any):
        self._fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        was = getattr(_via_xp, "on", False)
        _via_xp.on = True
        try:
            return _strict(self._fn(*args, **kwargs))
        finally:
            _via_xp.on = was

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fn, name)
        return _XpCall(attr) if callable(attr) and not isinstance(attr, type) else attr


class StrictNumpy:
    """``xp`` of the strict simulated device: numpy, with array results as StrictArrays."""

    __name__ = "numpy"

    def __getattr__(self, name: str) -> Any:
        attr = getattr(np, name)
        if isinstance(attr, type) or isinstance(attr, types.ModuleType) or not callable(attr):
            return attr
        return _XpCall(attr)


STRICT_NUMPY = StrictNumpy()


def plugin_modules_numpy() -> list[tuple[types.ModuleType, str]]:
    """Every (module, name) of the CUDA plugin bound to the numpy module: the strict run binds
    them to ``STRICT_NUMPY`` so that the kernels' ``xp is np`` (the simulation's branches)
    still holds and what they build with ``np`` is checked too."""
    import importlib
    import pkgutil

    import onnxplug_cuda
    import onnxplug_cuda.kernels

    for pkg in (onnxplug_cuda, onnxplug_cuda.kernels):
        for m in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"{pkg.__name__}.{m.name}")
    found = []
    for name, mod in list(sys.modules.items()):
        if name == "onnxplug_cuda" or name.startswith("onnxplug_cuda."):
            for attr, value in vars(mod).items():
                if value is np:
                    found.append((mod, attr))
    return found


class StrictBackend(NumpyBackend):
    def view(self, t: Any) -> Any:
        return _strict(super().view(t))

    def array_at(self, ptr: int, shape: tuple[int, ...], dtype: Any, keep: Any) -> Any:
        return _strict(super().array_at(ptr, shape, dtype, keep))


class StrictSimFactory(CudaSimEpFactory):
    backend_class = StrictBackend


def create_factory() -> StrictSimFactory:
    return StrictSimFactory()
