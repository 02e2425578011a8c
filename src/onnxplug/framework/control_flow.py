"""Host-provided control-flow kernels (If, Loop, Scan) and the subgraph runner they use.

Like onnxruntime's ``CreateIfKernel/CreateLoopKernel/CreateScanKernel``, the host gives every
provider these kernels: a provider registers them under its name and its subgraphs are
partitioned and executed by the host with the session's providers. A ``SubgraphRunner`` places
feeds where the subgraph's consumers want them and delivers outputs on the device the owning
node's provider expects, so a CUDA ``If`` gets CUDA outputs whichever provider ran the branch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import Fail, InvalidArgument
from .background import BackgroundCall
from .kernel import Kernel, KernelContext, KernelInfo
from .memory import CPU, Device, DeviceTensor, allocate_tensor, allocate_tensors_in_block
from .profiler import active_profiler
from .stream import DataTransferManager, device_of


def place(
    value: Any,
    device: Device | None,
    transfer: DataTransferManager,
    allocators: dict[Device, Any],
    stream: Any = None,
    reserve: bool = False,
) -> Any:
    """``value`` on ``device`` (copied when it lives elsewhere); lists are placed item-wise.
    ``reserve``: the copy is long-lived (an initializer) and is allocated outside an arena's
    bins."""
    if device is None or value is None:
        return value
    if isinstance(value, list):
        return [place(v, device, transfer, allocators, stream, reserve) for v in value]
    if isinstance(value, dict):  # a map (ai.onnx.ml's DictVectorizer, CastMap) lives on the host
        if not device.is_cpu:
            raise TypeError(f"maps cannot be placed on {device}")
        return value
    if not isinstance(value, (np.ndarray, DeviceTensor)):
        if device.is_cpu:
            return np.asarray(value)
        value = np.asarray(value)
    src = device_of(value)
    if src == device:
        return value
    if device.is_cpu:
        out = np.empty(value.shape, dtype=value.dtype)
        transfer.copy(value, out, stream)
        if stream is not None:
            stream.flush()
        return out
    if isinstance(value, np.ndarray) and value.dtype == object:
        raise TypeError(f"string tensors cannot be placed on {device}")
    out_t = allocate_tensor(allocators[device], value.shape, value.dtype, stream, reserve)
    if isinstance(value, np.ndarray) and not value.flags.c_contiguous:
        # (not unconditionally: ascontiguousarray turns a 0-d array into shape (1,))
        value = np.ascontiguousarray(value)
    transfer.copy(value, out_t, stream)
    return out_t


# below this many bytes to copy, a thread costs more than it hides
CONTIGUOUS_THREAD_ABOVE = 1 << 20


def contiguous_copies(values: list[np.ndarray]) -> BackgroundCall[list[np.ndarray]]:
    """``values``, each array that is not C-contiguous replaced by its C-contiguous copy (the
    layout pass leaves each weight it repacks for NHWC as a transposed view), copied on a
    helper thread above ``CONTIGUOUS_THREAD_ABOVE`` bytes: numpy copies with the GIL released,
    so that the copies (ResNet-50's 53 convolution weights, 100 MB: 37 ms on the main thread
    of an H100 host) overlap what the caller does meanwhile (a session's build makes its
    kernels)."""
    todo = [i for i, v in enumerate(values) if not v.flags.c_contiguous]

    def copy() -> list[np.ndarray]:
        out = list(values)
        for i in todo:
            # (not unconditionally: ascontiguousarray turns a 0-d array into shape (1,))
            out[i] = np.ascontiguousarray(out[i])
        return out

    big = sum(values[i].nbytes for i in todo) > CONTIGUOUS_THREAD_ABOVE
    return BackgroundCall(copy, "onnxplug-contiguous", background=big)


def place_in_one_block(
    values: list[np.ndarray],
    device: Device,
    transfer: DataTransferManager,
    allocators: dict[Device, Any],
) -> list[DeviceTensor]:
    """Arrays (initializers) copied to ``device`` into one block reserved for them all
    (``memory.allocate_tensors_in_block``), each a tensor the executor hands out every run."""
    specs = [(v.shape, v.dtype) for v in values]
    tensors = allocate_tensors_in_block(allocators[device], specs)
    for v, t in zip(values, tensors):
        # (not unconditionally: ascontiguousarray turns a 0-d array into shape (1,))
        transfer.copy(v if v.flags.c_contiguous else np.ascontiguousarray(v), t, None)
        t.stable_view = {}  # the same tensor every run: views are kept
    return tensors


def to_host(value: Any, transfer: DataTransferManager) -> Any:
    return place(value, CPU, transfer, {})


class SubgraphRunner:
    """Runs a subgraph's plan with feeds = formal inputs + outer-scope values."""

    def __init__(
        self,
        runner: Any,
        feed_devices: list[Device | None],
        output_device: Device,
        transfer: DataTransferManager,
        allocators: dict[Device, Any],
        output_devices: list[Device] | None = None,
    ):
        self.runner = runner
        self.feed_devices = feed_devices
        self.output_device = output_device
        self.output_devices = output_devices
        self.transfer = transfer
        self.allocators = allocators

    def run(self, inputs: list[Any], implicit: list[Any], run_options: Any = None) -> list[Any]:
        feeds = list(inputs) + list(implicit)
        devs = self.feed_devices
        feeds = [
            place(v, devs[i] if i < len(devs) else None, self.transfer, self.allocators)
            for i, v in enumerate(feeds)
        ]
        # a profiled run records its subgraphs' nodes too
        outs = self.runner.run(feeds, run_options, None, active_profiler())
        odevs = self.output_devices
        return [
            place(o, odevs[i] if odevs else self.output_device, self.transfer, self.allocators)
            for i, o in enumerate(outs)
        ]

    def host(self, value: Any) -> Any:
        return to_host(value, self.transfer)

    def stack(
        self,
        ctx: KernelContext,
        index: int,
        parts: list[Any],
        empty_shape: tuple[int, ...],
        dtype: Any,
    ) -> Any:
        """Stack ``parts`` along a new axis 0 into output ``index`` of ``ctx``."""
        if not parts:
            return ctx.output(index, empty_shape, dtype)
        first = parts[0]
        if isinstance(first, np.ndarray) or not isinstance(first, DeviceTensor):
            out = np.stack([np.asarray(p) for p in parts])
            if self.output_device.is_cpu:
                ctx.set_output(index, out)
                return out
            placed = place(out, self.output_device, self.transfer, self.allocators, ctx.stream)
            ctx.set_output(index, placed)
            return placed
        out_t = ctx.output(index, (len(parts), *first.shape), first.dtype)
        step = first.nbytes
        for i, p in enumerate(parts):
            dst = DeviceTensor(out_t.device, p.dtype, p.shape, out_t.ptr + i * step, out_t)
            self.transfer.copy(p, dst, ctx.stream)
        return out_t


def check_terminate(run_options: Any) -> None:
    """Raise when the run was asked to stop (``RunOptions.terminate``, possibly set from
    another thread): control flow checks it before every iteration, so a Loop with a huge
    trip count stops too."""
    if run_options is not None and getattr(run_options, "terminate", False):
        raise Fail("Exiting due to terminate flag being set to true.")


def _host_scalar(v: Any, runner: SubgraphRunner, what: str = "the condition") -> Any:
    """The one element of a condition or trip count; any other size is an error (taking the
    first of several would run a branch or a count the model never chose)."""
    if isinstance(v, DeviceTensor):
        v = runner.host(v)
    a = np.asarray(v)
    if a.size != 1:
        raise InvalidArgument(f"{what} must have exactly one element, got shape {list(a.shape)}")
    return a.reshape(-1)[0]


class IfKernel(Kernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.then_branch: SubgraphRunner = info.subgraph("then_branch")
        self.else_branch: SubgraphRunner = info.subgraph("else_branch")

    def compute(self, ctx: KernelContext) -> None:
        branch = (
            self.then_branch
            if bool(_host_scalar(ctx.input(0), self.then_branch))
            else self.else_branch
        )
        outs = branch.run([], ctx.implicit_inputs, ctx.run_options)
        for i, o in enumerate(outs):
            if i < ctx.output_count:
                ctx.set_output(i, o)


class LoopKernel(Kernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.body: SubgraphRunner = info.subgraph("body")
        self.n_carried = info.input_count - 2
        self.n_scan = info.output_count - self.n_carried
        body_graph = info.node.subgraphs["body"]
        self._scan_types = [vi.type for vi in body_graph.outputs[1 + self.n_carried :]]

    def compute(self, ctx: KernelContext) -> None:
        body = self.body
        m = ctx.input(0)
        c = ctx.input(1)
        max_trip = int(_host_scalar(m, body, "the trip count M")) if m is not None else None
        keep_going = bool(_host_scalar(c, body)) if c is not None else True
        carried = [ctx.input(i) for i in range(2, ctx.input_count)]
        scans: list[list[Any]] = [[] for _ in range(self.n_scan)]
        implicit = ctx.implicit_inputs
        it = 0
        while keep_going and (max_trip is None or it < max_trip):
            check_terminate(ctx.run_options)
            outs = body.run(
                [np.array(it, dtype=np.int64), np.array(keep_going), *carried],
                implicit,
                ctx.run_options,
            )
            keep_going = bool(_host_scalar(outs[0], body))
            carried = outs[1 : 1 + self.n_carried]
            for k in range(self.n_scan):
                scans[k].append(outs[1 + self.n_carried + k])
            it += 1
        for i, v in enumerate(carried):
            ctx.set_output(i, v)
        for k in range(self.n_scan):
            if not ctx.has_output(self.n_carried + k):
                continue
            t = self._scan_types[k]
            dtype = np.dtype(np.float32)
            empty_shape: tuple[int, ...] = (0,)
            if t.kind == "tensor" and t.elem_type:
                from ..ir.types import np_dtype

                dtype = np_dtype(t.elem_type)
                if t.shape is not None:
                    empty_shape = (0, *[d if isinstance(d, int) else 0 for d in t.shape])
            body.stack(ctx, self.n_carried + k, scans[k], empty_shape, dtype)


class ScanKernel(Kernel):
    """Scan (opset 9+; opset 8's batched form is handled by looping over the batch)."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.body: SubgraphRunner = info.subgraph("body")
        self.num_scan_inputs = int(info.attr("num_scan_inputs"))
        self.v8 = info.since_version < 9
        n_in = info.input_count - (1 if self.v8 else 0)
        self.n_state = n_in - self.num_scan_inputs
        self.n_scan_out = info.output_count - self.n_state
        self.in_axes = list(info.attr("scan_input_axes", [0] * self.num_scan_inputs))
        self.in_dirs = list(
            info.attr("scan_input_directions", info.attr("directions", [0] * self.num_scan_inputs))
            or [0] * self.num_scan_inputs
        )
        self.out_axes = list(info.attr("scan_output_axes", [0] * self.n_scan_out))
        self.out_dirs = list(info.attr("scan_output_directions", [0] * self.n_scan_out))

    def _scan(
        self,
        states: list[Any],
        scan_ins: list[np.ndarray],
        implicit: list[Any],
        run_options: Any,
        batched: bool,
    ) -> tuple[list[Any], list[np.ndarray]]:
        body = self.body
        in_axes = [0] * len(scan_ins) if batched else self.in_axes
        seqs = []
        for x, axis, d in zip(scan_ins, in_axes, self.in_dirs):
            axis = axis + x.ndim if axis < 0 else axis
            x = np.moveaxis(x, axis, 0)
            seqs.append(x[::-1] if d else x)
        n = seqs[0].shape[0] if seqs else 0
        outs_per_step: list[list[Any]] = [[] for _ in range(self.n_scan_out)]
        for t in range(n):
            check_terminate(run_options)
            outs = body.run([*states, *[s[t] for s in seqs]], implicit, run_options)
            outs = [body.host(o) for o in outs]
            states = outs[: self.n_state]
            for k in range(self.n_scan_out):
                outs_per_step[k].append(outs[self.n_state + k])
        scan_outs = []
        for k in range(self.n_scan_out):
            parts = outs_per_step[k]
            if self.out_dirs and k < len(self.out_dirs) and self.out_dirs[k]:
                parts = parts[::-1]
            y = np.stack(parts) if parts else np.zeros((0,), np.float32)
            axis = 0 if batched else (self.out_axes[k] if k < len(self.out_axes) else 0)
            if axis < 0:
                axis += y.ndim
            scan_outs.append(np.moveaxis(y, 0, axis))
        return states, scan_outs

    def compute(self, ctx: KernelContext) -> None:
        body = self.body
        ins = [body.host(v) for v in ctx.inputs]
        implicit = ctx.implicit_inputs
        if not self.v8:
            states, scan_outs = self._scan(
                ins[: self.n_state], ins[self.n_state :], implicit, ctx.run_options, False
            )
        else:
            seq_lens, rest = ins[0], ins[1:]
            init, xs = rest[: self.n_state], rest[self.n_state :]
            batch = (init[0] if init else xs[0]).shape[0]
            states_b, scans_b = [], []
            for b in range(batch):
                length = int(seq_lens[b]) if seq_lens is not None else xs[0].shape[1]
                st, so = self._scan(
                    [s[b] for s in init],
                    [x[b][:length] for x in xs],
                    implicit,
                    ctx.run_options,
                    True,
                )
                states_b.append(st)
                scans_b.append(so)
            states = [np.stack([s[i] for s in states_b]) for i in range(self.n_state)]
            scan_outs = [np.stack([s[k] for s in scans_b]) for k in range(self.n_scan_out)]
        for i, v in enumerate([*states, *scan_outs]):
            ctx.set_output(
                i, place(v, body.output_device, body.transfer, body.allocators, ctx.stream)
            )
