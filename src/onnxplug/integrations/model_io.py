"""A model's tensor inputs as the integrations feed them: data from outside (a dataset column,
a JSON value) converted to what the model input declares, or an ``InvalidArgument`` that names
the model input and where the data came from.

Values convert when no kind is lost: booleans and integers to any integer type whose range holds
them, integers and floats to any float type (float64 columns feed float32 inputs), text to
string inputs. Anything else (floats for an integer input, text for a number) is an error, as
are a wrong rank and a dimension that differs from a fixed one in the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidArgument
from ..ir.types import elem_type_from_name, np_dtype
from ..session.inference_session import NodeArg


@dataclass(frozen=True)
class TensorInput:
    """A model's tensor input: its name, onnxruntime type string, numpy dtype and shape (ints
    are fixed dimensions, strings and None symbolic ones)."""

    name: str
    type: str
    dtype: np.dtype
    shape: tuple[int | str | None, ...] | None

    @property
    def shape_text(self) -> str:
        if self.shape is None:
            return "unknown"
        return "[" + ", ".join("?" if d is None else str(d) for d in self.shape) + "]"

    @property
    def batched(self) -> bool:
        """Whether rows can be stacked along the first axis: its first dimension is free."""
        return self.shape is not None and not isinstance(self.shape[0], int)

    def convert(self, value: Any, source: str) -> np.ndarray:
        """``value`` as this input's dtype, checked against its shape; ``source`` says where
        the value came from ("column 'image'") for the error message."""
        try:
            arr = value if isinstance(value, np.ndarray) else np.asarray(value)
        except ValueError as e:  # ragged nested lists
            raise self._error(source, f"it is not a rectangular array ({e})") from None
        if arr.dtype != self.dtype:
            arr = self._cast(arr, source)
        if self.shape is None:
            return arr  # rank unknown here: the session checks what it knows
        if len(arr.shape) != len(self.shape):
            raise self._error(
                source,
                f"it has shape {tuple(arr.shape)} (rank {arr.ndim}), not rank {len(self.shape)}",
            )
        for k, (got, want) in enumerate(zip(arr.shape, self.shape)):
            if isinstance(want, int) and got != want:
                hint = ""
                if k == 0 and want == 1:
                    hint = " (the model takes one row at a time: send batches of one row)"
                raise self._error(
                    source,
                    f"it has shape {tuple(arr.shape)}: dimension {k} is {got}, the model's is "
                    f"{want}{hint}",
                )
        return arr

    def _cast(self, arr: np.ndarray, source: str) -> np.ndarray:
        src, dst = arr.dtype, self.dtype
        if dst == np.dtype(object):
            if src.kind in "US" or (src.kind == "O" and all(isinstance(v, str) for v in arr.flat)):
                return arr.astype(object)
        elif dst.kind in "iu":
            if src.kind in "biu":
                if arr.size and src.kind != "b":
                    info = np.iinfo(dst)
                    lo, hi = arr.min(), arr.max()
                    if lo < info.min or hi > info.max:
                        raise self._error(
                            source, f"its values {lo}..{hi} are outside {dst}'s range"
                        )
                return arr.astype(dst)
        elif dst.kind in "fcV":  # V: ml_dtypes floats (bfloat16, float8...)
            if src.kind in "biuf" or (src.kind == "c" and dst.kind == "c"):
                return arr.astype(dst)
        elif dst.kind == "b" and src.kind == "b":
            return arr
        raise self._error(source, f"it holds {_kind_name(arr)} values")

    def _error(self, source: str, why: str) -> InvalidArgument:
        return InvalidArgument(
            f"model input '{self.name}' ({self.type}, shape {self.shape_text}) cannot take "
            f"{source}: {why}"
        )


def tensor_inputs(args: Sequence[NodeArg]) -> dict[str, TensorInput]:
    """The model inputs as TensorInputs; a non-tensor input (sequence, map, optional) is an
    error naming it, since a column or a JSON value can only feed a tensor."""
    out: dict[str, TensorInput] = {}
    for a in args:
        dtype = None
        if a.type.startswith("tensor("):
            try:
                dtype = np_dtype(elem_type_from_name(a.type))
            except ValueError:
                pass
        if dtype is None:
            raise InvalidArgument(
                f"model input '{a.name}' is a {a.type}: the integrations feed tensors of "
                "numpy-representable types only"
            )
        # NodeArg gives [] both for a scalar and for an unknown shape: the session, which knows
        # which, checks those
        out[a.name] = TensorInput(a.name, a.type, dtype, tuple(a.shape) or None)
    return out


def _kind_name(arr: np.ndarray) -> str:
    if arr.dtype.kind == "O":
        return "mixed (object)"
    if arr.dtype.kind in "US":
        return "text"
    return str(arr.dtype)
