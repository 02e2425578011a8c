"""The ``Optional`` constructor, native because onnx.reference's represents it differently.

The runtime holds an optional value as the value itself (a tensor or a list for a sequence)
or ``None`` when empty; that is also how users feed and receive optionals. onnx.reference's
``Optional`` returns ``[x]``, a one-element list, which the runtime would read as a sequence
(an ``If`` returning ``Optional(seq)`` came out one list too deep: test_if_opt).
``OptionalHasElement``/``OptionalGetElement`` from onnx.reference already agree with this
representation.
"""

from __future__ import annotations

from onnxplug.ep import Kernel, KernelContext, KernelRegistry


class Optional(Kernel):
    def compute(self, ctx: KernelContext) -> None:
        ctx.set_output(0, ctx.input(0))  # absent input -> empty optional (None)


def register(registry: KernelRegistry) -> None:
    registry.kernel("Optional", since=15)(Optional)
