"""Long-tail CPU kernels delegated to ``onnx.reference`` implementations.

Every operator class ``onnx.reference`` implements (default, ai.onnx.ml, training, preview and
experimental domains) is registered for the opset range it covers: a class written for
version ``v`` serves [v, next class's version - 1]. The op instance is created once per node
and its ``_run`` is called with the node's attributes, behind our kernel API.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import numpy as np
import onnx

from onnxplug.ep import Kernel, KernelContext, KernelInfo, KernelRegistry, node_seed

_DOMAIN_MODULES = {
    "": "onnx.reference.ops._op_list",
    "ai.onnx.ml": "onnx.reference.ops.aionnxml._op_list",
    "ai.onnx.preview.training": "onnx.reference.ops.aionnx_preview_training._op_list",
    "ai.onnx.preview": "onnx.reference.ops.aionnx_preview._op_list",
    "experimental": "onnx.reference.ops.experimental._op_list",
}
# What onnx.reference says while it computes (numpy's RuntimeWarnings, its own notes) is not
# the user's business: results follow IEEE (inf, nan) as onnxruntime's do.
warnings.filterwarnings("ignore", module=r"onnx\.reference(\.|$)")

# Ops the host implements itself (subgraphs are executed by the runtime, not the reference).
_SKIP = {("", "If"), ("", "Loop"), ("", "Scan")}
# Random ops whose unseeded draws take onnxplug.set_seed's seed.
_RANDOM = {
    ("", op)
    for op in (
        "RandomNormal",
        "RandomUniform",
        "RandomNormalLike",
        "RandomUniformLike",
        "Bernoulli",
    )
}
# Ops that read only their input's shape: the input is never copied to the host for them.
_SHAPE_ONLY = {("", "Shape"), ("", "Size")}


def _run_params(opsets: dict[str, int]) -> dict[str, Any]:
    from onnx.reference import ReferenceEvaluator

    return {
        "log": lambda *a: None,
        "opsets": opsets,
        "verbose": 0,
        "new_ops": {},
        "existing_functions": {},
        "evaluator_cls": ReferenceEvaluator,
    }


def _as_output(v: Any) -> Any:
    if v is None or isinstance(v, (np.ndarray, list, dict)):
        return v
    if isinstance(v, tuple):
        return list(v)
    return np.asarray(v)


class ReferenceKernel(Kernel):
    """Runs one node with an ``onnx.reference`` operator class."""

    op_class: Any = None

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        node = info.node
        if node.proto is None:
            raise RuntimeError(
                f"{info.op_type} node '{info.name}' has no NodeProto to delegate with"
            )
        opsets = dict(node_opsets(info))
        self.op = self.op_class(node.proto, _run_params(opsets))
        if (info.domain, info.op_type) in _RANDOM and info.attr("seed") is None:
            seed = node_seed()  # onnxplug.set_seed's, read like onnxruntime at kernel creation
            if seed is not None:
                self.op.seed = float(seed)
                self.op.attributes_names_ = [*self.op.attributes_names_, "seed"]

    def run_inputs(self, ctx: KernelContext) -> list[Any]:
        """The inputs the reference implementation is given (subclasses check them first)."""
        return list(ctx.inputs)

    def compute(self, ctx: KernelContext) -> None:
        inputs = self.run_inputs(ctx)
        with np.errstate(all="ignore"):  # IEEE results are the answer (overflow in exp: inf)
            res = self.op.run(*inputs)
        if not isinstance(res, tuple):
            res = (res,)
        for i, v in enumerate(res):
            if i < ctx.output_count:
                ctx.set_output(i, _as_output(v))


def node_opsets(info: KernelInfo) -> dict[str, int]:
    import onnx

    return {"": onnx.defs.onnx_opset_version(), info.domain: info.opset}


def _ranges(versions: dict[Any, Any]) -> list[tuple[int, int | None, Any]]:
    numbered = sorted(v for v in versions if v is not None)
    if not numbered:
        return [(1, None, versions[None])]
    out: list[tuple[int, int | None, Any]] = []
    for k, v in enumerate(numbered):
        end = numbered[k + 1] - 1 if k + 1 < len(numbered) else None
        out.append((1 if k == 0 else v, end, versions[v]))
    return out


def register_reference_kernels(registry: KernelRegistry) -> None:
    for domain, module_name in _DOMAIN_MODULES.items():
        try:
            mod = importlib.import_module(module_name)
            ops = mod._build_registered_operators()
        except Exception:  # an onnx without that domain's reference ops
            continue
        for op_type, versions in ops.items():
            # the module also exports helper base classes (OpRun, OpFunction, ...): only ops
            # with an ONNX schema are kernels
            if (domain, op_type) in _SKIP or not onnx.defs.has(op_type, domain):
                continue
            for since, until, cls in _ranges(versions):
                kernel_cls = type(f"Ref{op_type}_{since}", (ReferenceKernel,), {"op_class": cls})
                shape_only = (0,) if (domain, op_type) in _SHAPE_ONLY else ()
                registry.kernel(
                    op_type, domain=domain, since=since, until=until, shape_only_inputs=shape_only
                )(kernel_cls)


def register_checked(registry: KernelRegistry, op_type: str, base: type[ReferenceKernel]) -> None:
    """Register ``base`` (a ReferenceKernel that checks its inputs) over every version of the
    default-domain op that onnx.reference implements; into the fallback layer of a registry
    that has one (registered when onnx.reference's kernels are, over them)."""
    defer = getattr(registry, "defer", None)
    if defer is not None:
        defer(lambda reg: register_checked(reg, op_type, base))
        return
    ops = importlib.import_module(_DOMAIN_MODULES[""])._build_registered_operators()
    for since, until, cls in _ranges(ops[op_type]):
        kernel = type(f"{base.__name__}_{since}", (base,), {"op_class": cls})
        registry.kernel(op_type, since=since, until=until)(kernel)
