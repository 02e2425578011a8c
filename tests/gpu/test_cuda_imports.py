"""The CUDA kernels never make CuPy import cupyx or SciPy during a run (issue 8, cold start):
the GPU twin of tests/test_cuda_imports.py, in a fresh process each, on the real provider.

BERT-base's first run spent 0.7 s importing cupyx and SciPy from GatherND: CuPy sends
``device_array <op> scalar`` through numpy's dispatch, which imports ``cupyx.scipy.special``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.gpu._cuda import cuda_marks

pytestmark = cuda_marks

ROOT = Path(__file__).resolve().parents[2]

# the node-suite cases of the kernels that used to do it, and their neighbours
CASES = (
    "(?i)GatherND|ScatterND|OneHot|ReverseSequence|LpNormalization|MeanVarianceNormalization"
    "|Pool|bfloat16|Shrink|Gather|Scatter|Resize|Einsum"
)


def test_the_node_suite_cases_import_neither_cupyx_nor_scipy():
    """Each case runs three times on [CUDA, CPU]; the first case after which cupyx's SciPy
    layer or SciPy is in ``sys.modules`` is reported."""
    script = textwrap.dedent(
        f"""
        import json, sys
        from onnxplug.tools import conformance

        first = None
        results = []
        for case in conformance.collect_cases({CASES!r}):
            r = conformance.run_case(case, ["CUDAExecutionProvider", "CPUExecutionProvider"],
                                     None, 3)
            results.append(r.status)
            # (``import cupy`` imports the cupyx package itself: its SciPy layer is the cost)
            heavy = [m for m in ("cupyx.scipy", "scipy") if m in sys.modules]
            if heavy and first is None:
                first = [case.name, heavy]
        print(json.dumps({{"cases": len(results), "first": first}}))
        """
    )
    p = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["cases"] > 100
    assert out["first"] is None, f"{out['first'][1]} imported by case {out['first'][0]}"


def _matmul_session_run(elem_type: str, body: str) -> dict:
    """In a fresh process: a CUDA session of one (64, 64) MatMul of ``TensorProto.<elem_type>``
    (``s``), then ``body``, whose last line prints a JSON object; that object."""
    script = textwrap.dedent(
        f"""
        import json, threading
        import numpy as np
        from onnx import TensorProto, helper
        import onnxplug as ox
        from onnxplug_cuda import blas

        t = TensorProto.{elem_type}
        g = helper.make_graph(
            [helper.make_node("MatMul", ["a", "b"], ["y"])],
            "g",
            [helper.make_tensor_value_info(n, t, [64, 64]) for n in "ab"],
            [helper.make_tensor_value_info("y", t, [64, 64])],
        )
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        s = ox.InferenceSession(m.SerializeToString(), providers=["CUDAExecutionProvider"])
        """
    ) + textwrap.dedent(body)
    p = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_nvmath_is_imported_beside_the_session_set_up():
    """The CUDA backend starts nvmath's import on a thread of its own; the first MatMul joins
    it and runs through cuBLASLt (not the CuPy fallback). nvmath's package __init__ (which
    loads cuFFT, cuSOLVER, ...) is not run, and a later ``import nvmath`` still gets the
    whole package, with the same bindings module."""
    out = _matmul_session_run(
        "FLOAT",
        """
        # small whole numbers: exact in TF32 and in any summation order
        a = np.random.default_rng(0).integers(-3, 4, (64, 64)).astype(np.float32)
        (y,) = s.run(None, {"a": a, "b": a.T.copy()})
        thread = blas.NVMATH._thread
        import sys
        skipped = "nvmath" not in sys.modules and "nvmath.bindings.cufft" not in sys.modules
        import nvmath  # the user's own import still runs nvmath's __init__
        print(json.dumps({
            "started": thread is not None,
            "alive": thread is not None and thread.is_alive(),
            "cublaslt": blas.stats["cublaslt"],
            "close": bool(np.array_equal(y, a @ a.T)),
            "package_inits_skipped": skipped,
            "same_bindings": nvmath.bindings.cublasLt is blas.cublaslt(),
            "full_package": hasattr(nvmath, "linalg"),
        }))
        """,
    )
    assert out == {
        "started": True,
        "alive": False,
        "cublaslt": out["cublaslt"],
        "close": True,
        "package_inits_skipped": True,
        "same_bindings": True,
        "full_package": True,
    }
    assert out["cublaslt"] > 0


def test_a_float16_session_warms_cublaslt_for_float16_before_its_first_run():
    """cuBLASLt sets up each element type on its first query for it (99-139 ms for float16 on
    an H100); the backend's warm-up does float32's, and a float16 MatMul's kernel starts
    float16's on a helper thread when the session makes it. In a fresh process: after both
    warm-ups, two warm queries ran (none failed), the engine counts float16 as warmed, and the
    run's product is right."""
    out = _matmul_session_run(
        "FLOAT16",
        """
        for t in threading.enumerate():
            if t.name.startswith(("onnxplug-warm-", "onnxplug-gemm-warm-")):
                t.join(30)
        (eng,) = blas._engines.values()
        a = np.random.default_rng(0).integers(-3, 4, (64, 64)).astype(np.float16)
        (y,) = s.run(None, {"a": a, "b": a.T.copy()})
        print(json.dumps({
            "warm_queries": blas.stats["warm_queries"],
            "float16_warmed": np.dtype(np.float16) in eng._warmed,
            "exact": bool(np.array_equal(y, (a.astype(np.float32) @ a.T.astype(np.float32)).astype(np.float16))),
        }))
        """,
    )
    assert out == {
        "warm_queries": 2,
        "float16_warmed": True,
        "exact": True,
    }
