"""LSTM, GRU and RNN: onnx.reference's implementations behind a check of the inputs' shapes,
which the reference does not make (weights of another hidden size fail deep inside numpy or
give a result of the wrong size; an initial state of batch 1 would broadcast over a larger
batch). A wrong shape fails the run with onnxruntime's message and error class.

The checks are onnxruntime's: ``W`` is [num_directions, gates * hidden_size, input_size] and
``R`` [num_directions, gates * hidden_size, hidden_size] (``InvalidArgument``), ``B``
[num_directions, 2 * gates * hidden_size] (``InvalidArgument``), ``initial_h``/``initial_c``
[num_directions, batch, hidden_size], ``sequence_lens`` [batch] with values in
[1, seq_length] (LSTM's ``P``: [num_directions, 3 * hidden_size]). ``hidden_size`` itself is
checked at load (``ir.validate``).
"""

from __future__ import annotations

import numpy as np

from onnxplug.ep import Fail, InvalidArgument, KernelContext, KernelInfo, KernelRegistry

from .reference import ReferenceKernel, register_checked

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
# Inputs whose wrong shape onnxruntime reports as INVALID_ARGUMENT (the others: FAIL).
_INVALID_ARGUMENT = frozenset({1, 2, 3})


class _CheckedRecurrent(ReferenceKernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.hidden = int(info.attr("hidden_size", 0))
        self.directions = 2 if info.attr("direction", "forward") == "bidirectional" else 1
        self.batch_first = int(info.attr("layout", 0)) == 1

    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        if x is None or x.ndim != 3:
            raise Fail(f"{self._where()}: X must be 3-D, got {_shape(x)}")
        seq, batch = (x.shape[1], x.shape[0]) if self.batch_first else x.shape[:2]
        gates = GATES[self.info.op_type]
        hidden, d = self.hidden, self.directions
        expect: dict[int, tuple[str, tuple[int, ...]]] = {
            1: ("W", (d, gates * hidden, x.shape[2])),
            2: ("R", (d, gates * hidden, hidden)),
            3: ("B", (d, 2 * gates * hidden)),
        }
        state = (batch, d, hidden) if self.batch_first else (d, batch, hidden)
        expect[5] = ("initial_h", state)
        if self.info.op_type == "LSTM":
            expect[6] = ("initial_c", state)
            expect[7] = ("P", (d, 3 * hidden))
        for index, (name, shape) in expect.items():
            v = ctx.input(index)
            if v is not None and tuple(v.shape) != shape:
                error = InvalidArgument if index in _INVALID_ARGUMENT else Fail
                raise error(
                    f"{self._where()}: Input {name} must have shape {{{','.join(map(str, shape))}}}"
                    f". Actual:{{{','.join(map(str, v.shape))}}}"
                )
        lens = ctx.input(4)
        if lens is not None:
            lens = np.asarray(lens)
            if lens.shape != (batch,) or (lens.size and (lens.min() < 1 or lens.max() > seq)):
                raise Fail(
                    f"{self._where()}: sequence_lens must be [batch={batch}] values in "
                    f"[1, {seq}], got {lens.tolist()}"
                )
        super().compute(ctx)

    def _where(self) -> str:
        return f"{self.info.op_type} node '{self.info.name}'"


def _shape(x: object) -> str:
    return str(list(getattr(x, "shape", ()))) if x is not None else "nothing"


def register(registry: KernelRegistry) -> None:
    for op in GATES:
        register_checked(registry, op, _CheckedRecurrent)
