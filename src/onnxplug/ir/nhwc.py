"""The internal NHWC domain (onnxruntime's ``kMSInternalNHWCDomain``): its name and the ops the
layout transformation rewrites into it, in one place for the optimizer (which makes the nodes)
and the providers (which say which of them they want and register their kernels).

A node of this domain has the attributes of the op it comes from; its activations (X, Z, Y)
are NHWC, and a convolution's W is (M, kH, kW, C/group) ("OHWI"; onnxruntime keeps OIHW there
and repacks in its kernel): the graph repacks constant weights once.
"""

from __future__ import annotations

NHWC_DOMAIN = "com.ms.internal.nhwc"

# (domain, op type) of the ops that have an NHWC form (2-D, float16/float32; MaxPool without
# its Indices output): each becomes the op of the same name in NHWC_DOMAIN, since_version 1
NHWC_OPS: frozenset[tuple[str, str]] = frozenset(
    {
        ("", "Conv"),
        ("com.microsoft", "FusedConv"),
        ("", "MaxPool"),
        ("", "AveragePool"),
        ("", "GlobalAveragePool"),
        ("", "GlobalMaxPool"),
    }
)
