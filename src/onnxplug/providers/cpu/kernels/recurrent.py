"""LSTM, GRU and RNN: onnx.reference's implementations behind a check of the optional inputs'
shapes, which the reference does not make (an initial state of batch 1 would broadcast over a
larger batch and give a result of the wrong shape). A wrong shape fails the run (``Fail``,
as in onnxruntime) with onnxruntime's message.

The checks are onnxruntime's: ``initial_h``/``initial_c`` are [num_directions, batch,
hidden_size], ``B`` is [num_directions, 2 * gates * hidden_size], ``sequence_lens`` is [batch]
with values in [1, seq_length] (LSTM's ``P``: [num_directions, 3 * hidden_size]).
"""

from __future__ import annotations

import importlib

import numpy as np

from onnxplug.ep import Fail, KernelContext, KernelInfo, KernelRegistry

from .reference import ReferenceKernel, _ranges

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


class _CheckedRecurrent(ReferenceKernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.hidden = int(info.attr("hidden_size", 0))
        self.directions = 2 if info.attr("direction", "forward") == "bidirectional" else 1
        self.batch_first = int(info.attr("layout", 0)) == 1

    def compute(self, ctx: KernelContext) -> None:
        x, w = ctx.input(0), ctx.input(1)
        if x is None or x.ndim != 3:
            raise Fail(f"{self._where()}: X must be 3-D, got {_shape(x)}")
        seq, batch = (x.shape[1], x.shape[0]) if self.batch_first else x.shape[:2]
        gates = GATES[self.info.op_type]
        hidden = self.hidden or (w.shape[1] // gates if w is not None else 0)
        d = self.directions
        expect: dict[int, tuple[str, tuple[int, ...]]] = {3: ("B", (d, 2 * gates * hidden))}
        state = (batch, d, hidden) if self.batch_first else (d, batch, hidden)
        expect[5] = ("initial_h", state)
        if self.info.op_type == "LSTM":
            expect[6] = ("initial_c", state)
            expect[7] = ("P", (d, 3 * hidden))
        for index, (name, shape) in expect.items():
            v = ctx.input(index)
            if v is not None and tuple(v.shape) != shape:
                raise Fail(
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
    ops = importlib.import_module("onnx.reference.ops._op_list")._build_registered_operators()
    for op in GATES:
        for since, until, cls in _ranges(ops[op]):
            kernel = type(f"Checked{op}_{since}", (_CheckedRecurrent,), {"op_class": cls})
            registry.kernel(op, since=since, until=until)(kernel)
