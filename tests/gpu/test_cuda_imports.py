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
    """Each case runs three times on [CUDA, CPU]; the first case after which cupyx or SciPy
    is in ``sys.modules`` is reported."""
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
            heavy = [m for m in ("cupyx", "scipy") if m in sys.modules]
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
