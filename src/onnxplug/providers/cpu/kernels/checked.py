"""TopK, OneHot, Resize and Upsample: onnx.reference's implementations behind onnxruntime's
checks of the inputs a model feeds them at run time, which the reference does not make (a
negative k gives an empty result, a depth of 0 or a zero scale an empty tensor, an out-of-range
axis a raw Python error). A bad input fails the run with onnxruntime's message and error
class; what a model fixes in attributes or initializers is checked at load (``ir.validate``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxplug.ep import Fail, InvalidArgument, KernelContext, KernelRegistry, shapes

from .reference import ReferenceKernel, register_checked

_INT64_MAX = 2**63 - 1


class _Checked(ReferenceKernel):
    def where(self) -> str:
        return f"{self.info.op_type} node '{self.info.name}'"


class CheckedTopK(_Checked):
    """k is one non-negative value no larger than the axis (TopK-1: the attribute)."""

    def run_inputs(self, ctx: KernelContext) -> list[Any]:
        inputs = list(ctx.inputs)
        x = inputs[0]
        if len(inputs) > 1:
            k_tensor = np.asarray(inputs[1])
            if k_tensor.shape != (1,):
                raise Fail(
                    f"{self.where()}: k tensor should be a 1D tensor of size 1, got shape "
                    f"{list(k_tensor.shape)}"
                )
            k = int(k_tensor[0])
        else:
            k = int(self.info.attr("k", 0))
        if k < 0:
            raise Fail(f"{self.where()}: value of k must not be negative (k={k})")
        axis = shapes.normalize_axis(int(self.info.attr("axis", -1)), x.ndim)
        if k > x.shape[axis]:
            raise Fail(
                f"{self.where()}: k argument [{k}] should not be greater than specified axis "
                f"dim value [{x.shape[axis]}]"
            )
        return inputs


class CheckedOneHot(_Checked):
    """depth is one positive value, values two, the axis within the output's rank, and the
    output's element count fits in int64."""

    def run_inputs(self, ctx: KernelContext) -> list[Any]:
        indices, depth, values = (np.asarray(v) for v in ctx.inputs)
        if depth.size != 1 or depth.ndim > 1:
            raise InvalidArgument(
                f"{self.where()}: Invalid argument for depth; it's not a scalar (shape "
                f"{list(depth.shape)})"
            )
        d = int(depth.reshape(-1)[0])
        if d <= 0:
            raise InvalidArgument(f"{self.where()}: Depth is negative (or zero): {d}")
        if values.ndim > 1 or values.size != 2:
            raise InvalidArgument(
                f"{self.where()}: Invalid argument for values; it must be 1-D with 2 elements, "
                f"got shape {list(values.shape)}"
            )
        rank = indices.ndim + 1
        axis = int(self.info.attr("axis", -1))
        if not -rank <= axis < rank:
            raise Fail(f"{self.where()}: axis {axis} is not in valid range [{-rank},{rank - 1}]")
        if indices.size and d > _INT64_MAX // indices.size:
            raise InvalidArgument(
                f"{self.where()}: OneHot: output tensor size would overflow for the given "
                f"indices shape {list(indices.shape)} and depth value ({d})"
            )
        return list(ctx.inputs)


class CheckedResize(_Checked):
    """Scales are positive (Upsample: at least 1); Resize's ``roi`` is read only by the
    ``tf_crop_and_resize`` mode, which needs two values per resized axis (onnxruntime ignores
    it in the other modes, whatever its shape)."""

    def run_inputs(self, ctx: KernelContext) -> list[Any]:
        inputs = list(ctx.inputs)
        op = self.info.op_type
        scales_at = 1 if op == "Upsample" or self.info.since_version < 11 else 2
        scales = inputs[scales_at] if len(inputs) > scales_at else None
        if scales is not None and np.asarray(scales).size:
            try:
                shapes.check_resize_scales(op, np.asarray(scales).reshape(-1))
            except ValueError as e:
                raise Fail(f"{self.where()}: {e}") from None
        if op == "Resize" and self.info.since_version >= 11 and len(inputs) > 1:
            mode = self.info.attr("coordinate_transformation_mode", "half_pixel")
            roi = inputs[1]
            if mode != "tf_crop_and_resize":
                inputs[1] = None
            elif roi is not None:
                x = inputs[0]
                n = len(self.info.attr("axes") or ()) or x.ndim
                if np.asarray(roi).size != 2 * n:
                    raise InvalidArgument(
                        f"{self.where()}: Resize: size of roi array should be 2 * N where N is "
                        f"the number of resized axes ({n}); it has {np.asarray(roi).size}"
                    )
        return inputs


def register(registry: KernelRegistry) -> None:
    register_checked(registry, "TopK", CheckedTopK)
    register_checked(registry, "OneHot", CheckedOneHot)
    register_checked(registry, "Resize", CheckedResize)
    register_checked(registry, "Upsample", CheckedResize)
