"""No CUDA kernel makes CuPy import cupyx or SciPy during a run (issue 8, cold start).

CuPy sends ``device_array <op> scalar`` through numpy's dispatch, whose first step imports
``cupyx.scipy.special`` (cupyx and SciPy, 0.4-0.7 s): BERT-base's first run paid it in GatherND.
``tests/plugins/strict_sim.py`` models that dispatch on the host-simulated device, so the node
suite finds every kernel line that would do it; the GPU twin of these tests is
tests/gpu/test_cuda_imports.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import onnxplug as ox

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_SRC = ROOT / "plugins" / "cuda" / "src"
SIM = "CUDASimExecutionProvider"


@pytest.fixture
def strict_sim(monkeypatch):
    """The simulated CUDA provider with CuPy's operator dispatch modelled; the plugin's ``np``
    is the strict namespace meanwhile (so that ``xp is np`` still holds)."""
    monkeypatch.syspath_prepend(str(PLUGIN_SRC))
    from tests.plugins import strict_sim

    for mod, attr in strict_sim.plugin_modules_numpy():
        monkeypatch.setattr(mod, attr, strict_sim.STRICT_NUMPY)
    strict_sim.VIOLATIONS.clear()
    ox.register_execution_provider_library(SIM, "tests.plugins.strict_sim:create_factory")
    yield strict_sim
    ox.unregister_execution_provider_library(SIM)


# expression -> whether CuPy 14 sends it through numpy (cupy/_core/core.pyx: ``__mul__`` etc.
# call numpy's ufunc unless the other operand is a CuPy array; ``__richcmp__`` likewise)
CUPY_DISPATCH = {
    "a % 3": True,
    "a * 2.0": True,
    "a < 0": True,
    "0 == a": True,
    "np.float32(2) * a": True,
    "a + np.ones(3)": True,
    "a ** 3": True,
    "2 * a": False,  # a Python scalar on the left: CuPy's reflected operator
    "1 - a": False,
    "a + b": False,
    "a < b": False,
    "a ** 2": False,  # CuPy's fast path: square
    "xp.remainder(a, 3)": False,
    "-a": False,
}


@pytest.mark.parametrize("expr", sorted(CUPY_DISPATCH))
def test_the_model_of_cupys_dispatch(strict_sim, expr):
    """The harness reports exactly the operators CuPy sends through numpy, in plugin code
    that names ``xp``."""
    ns: dict = {"np": np}
    src = f"def f(xp, a, b):\n    return {expr}\n"
    exec(compile(src, "/site-packages/onnxplug_cuda/probe.py", "exec"), ns)
    a = np.arange(3.0).view(strict_sim.StrictArray)
    b = np.ones(3).view(strict_sim.StrictArray)
    ns["f"](strict_sim.STRICT_NUMPY, a, b)
    assert bool(strict_sim.VIOLATIONS) == CUPY_DISPATCH[expr], strict_sim.VIOLATIONS


def test_no_kernel_sends_an_operator_through_numpy_on_the_node_suite(strict_sim):
    """Every CUDA kernel the ONNX node suite reaches (recording run, binding run, prepared
    run) combines device arrays with scalars through ``xp``'s ufuncs, and the suite still
    passes where the CPU provider passes."""
    from onnxplug.tools.conformance import run_suite

    results = run_suite([SIM, "CPUExecutionProvider"], repeats=3)
    sites = sorted(set(strict_sim.VIOLATIONS))
    assert not sites, "operators CuPy would send through numpy:\n" + "\n".join(sites)
    assert sum(r.status == "pass" for r in results) > 1500
    assert sum(r.on_provider for r in results) > 1000


def test_a_cuda_session_imports_neither_cupyx_nor_scipy():
    """Creating and running a session on the simulated CUDA device (a GatherND model, which
    pulled in cupyx on BERT-base's first run) imports neither, in a fresh process; nor does it
    build the CPU provider's kernel registry, which no node of it needs."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(PLUGIN_SRC)!r})
        import numpy as np
        import onnx
        from onnx import TensorProto, helper
        import onnxplug as ox

        ox.register_execution_provider_library({SIM!r}, "onnxplug_cuda.sim:create_factory")
        g = helper.make_graph(
            [helper.make_node("GatherND", ["x", "i"], ["y"])],
            "g",
            [
                helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3]),
                helper.make_tensor_value_info("i", TensorProto.INT64, [2, 1]),
            ],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        )
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        s = ox.InferenceSession(m.SerializeToString(), providers=[{SIM!r}])
        x = np.arange(12, dtype=np.float32).reshape(4, 3)
        (y,) = s.run(None, {{"x": x, "i": np.array([[3], [-4]], dtype=np.int64)}})
        assert s.get_provider_graph_assignment_info()[0]["ep"] == {SIM!r}
        assert np.array_equal(y, x[[3, 0]]), y
        from onnxplug.providers.cpu.factory import _REGISTRY

        print(sorted(m for m in ("cupyx", "scipy") if m in sys.modules), _REGISTRY.built)
        """
    )
    p = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert p.returncode == 0, p.stderr[-3000:]
    # and the CPU provider's registry was never built: no node needed it
    assert p.stdout.strip().splitlines()[-1] == "[] False"


# nvmath's import on a thread of its own -------------------------------------------------------


@pytest.fixture
def blas(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGIN_SRC))
    from onnxplug_cuda import blas

    monkeypatch.setattr(blas, "_engines", {})
    monkeypatch.setattr(blas, "_warned_no_nvmath", False)
    return blas


def test_a_background_import_runs_on_its_own_thread(blas, tmp_path, monkeypatch):
    (tmp_path / "slow_mod_for_bg_import.py").write_text(
        "import threading, time\ntime.sleep(0.2)\nTHREAD = threading.current_thread().name\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "slow_mod_for_bg_import", raising=False)
    bg = blas.BackgroundImport("slow_mod_for_bg_import")
    bg.start()
    bg.start()  # once
    (mod,) = bg.modules()
    assert mod is sys.modules["slow_mod_for_bg_import"]
    assert mod.THREAD == "onnxplug-import-slow_mod_for_bg_import"
    assert blas.BackgroundImport("slow_mod_for_bg_import").modules() == (mod,)  # never started
    import slow_mod_for_bg_import  # noqa: F401  (the module is there for the caller's import)


def test_a_warm_up_runs_after_the_import_once_per_device(blas):
    """``warm_up(ordinal)`` (cuBLASLt's first heuristic query, from the GPU backend) runs on a
    thread of its own with the imported modules, once per device, never where the import
    failed, and a warm-up that raises is swallowed (the first real use meets the error)."""
    import threading

    calls: list[tuple[tuple, int, str]] = []
    done = threading.Semaphore(0)

    def warm(modules: tuple, ordinal: int) -> None:
        calls.append((modules, ordinal, threading.current_thread().name))
        done.release()
        if ordinal == 1:
            raise RuntimeError("no such device")

    bg = blas.BackgroundImport("json", warm=warm)
    for ordinal in (0, 0, 1):
        bg.warm_up(ordinal)
    assert done.acquire(timeout=10) and done.acquire(timeout=10)
    assert not done.acquire(timeout=0.2)  # device 0 once
    assert sorted((c[1], c[2]) for c in calls) == [(0, "onnxplug-warm-0"), (1, "onnxplug-warm-1")]
    assert all(c[0] == (sys.modules["json"],) for c in calls)
    failed = blas.BackgroundImport("no_such_module_onnxplug_test.x", warm=warm)
    failed.warm_up(2)
    with pytest.raises(ModuleNotFoundError):
        failed.modules()
    assert not done.acquire(timeout=0.2) and all(c[1] != 2 for c in calls)


class _FakeCublasLt:
    """What ``LtGemm`` and ``warm_gemm_type`` use of nvmath's cuBLASLt bindings, recording
    each heuristic query (its layout's type and its descriptor's compute type) and what is
    destroyed."""

    class MatmulDescAttribute:
        BIAS_POINTER = 8

    class Epilogue:
        RELU, GELU, BIAS, RELU_BIAS, GELU_BIAS = 2, 32, 4, 6, 36

    matmul_heuristic_result_dtype = np.dtype([("algo", "<u8", (8,)), ("workspace_size", "<u8")])

    def __init__(self, fail: bool = False):
        import threading

        self.fail = fail
        self.queries: list[tuple[int, int, str]] = []
        self.live: set[str] = set()
        self._lock = threading.Lock()
        self._next = 0

    def _new(self, kind: str, *what: int) -> str:
        with self._lock:
            self._next += 1
            name = f"{kind}{self._next}:{what}"
            self.live.add(name)
            return name

    def create(self) -> str:
        if self.fail:
            raise RuntimeError("CUBLAS_STATUS_NOT_INITIALIZED")
        return self._new("handle")

    def matmul_desc_create(self, compute: int, scale: int) -> str:
        return self._new("desc", compute, scale)

    def matrix_layout_create(self, cuda_type: int, rows: int, cols: int, ld: int) -> str:
        return self._new("layout", cuda_type, rows, cols, ld)

    def matmul_preference_create(self) -> str:
        return self._new("pref")

    def matmul_algo_get_heuristic(self, handle, desc, a, b, c, d, pref, n, results, found):
        import threading

        assert a == b == c == d and a.endswith(", 64, 64, 64)")
        cuda_type = int(a.split("(")[1].split(",")[0])
        compute = int(desc.split("(")[1].split(",")[0])
        with self._lock:
            self.queries.append((cuda_type, compute, threading.current_thread().name))

    def _destroy(self, name: str) -> None:
        with self._lock:
            self.live.remove(name)

    destroy = matmul_desc_destroy = matrix_layout_destroy = matmul_preference_destroy = _destroy


def _fake_nvmath(L: _FakeCublasLt) -> object:
    import types

    cublas = types.SimpleNamespace(
        ComputeType=types.SimpleNamespace(COMPUTE_32F=68, COMPUTE_32F_FAST_TF32=77, COMPUTE_64F=70),
        Operation=types.SimpleNamespace(N=0, T=1),
    )
    return types.SimpleNamespace(modules=lambda: (L, cublas))


def _join_gemm_warm_ups() -> None:
    import threading

    for t in threading.enumerate():
        if t.name.startswith("onnxplug-gemm-warm-"):
            t.join(10)


@pytest.mark.parametrize("use_tf32", [True, False])
def test_gemm_engine_warms_each_element_type_once(blas, monkeypatch, use_tf32):
    """``LtGemm.warm_up(dtype)`` (called by the GEMM kernels when the session makes them) runs
    one heuristic query per element type, on a helper thread, with the type's layout and the
    engine's compute type (TF32 for float32 where allowed), and frees what it made; types
    cuBLASLt does not run here (int8, no type known) start nothing."""
    L = _FakeCublasLt()
    monkeypatch.setattr(blas, "NVMATH", _fake_nvmath(L))
    monkeypatch.setattr(blas, "make_primary_context_current", lambda ordinal: ordinal == 0)
    eng = blas.LtGemm(object(), 0, use_tf32)
    before = blas.stats["warm_queries"]
    for dt in (np.float16, np.float16, np.dtype("float32"), np.int8, None, np.float32):
        eng.warm_up(dt)
    _join_gemm_warm_ups()
    f32 = 77 if use_tf32 else 68
    assert sorted(q[:2] for q in L.queries) == [(0, f32), (2, 68)]  # CUDA_R_32F, CUDA_R_16F
    assert {q[2] for q in L.queries} == {"onnxplug-gemm-warm-float16", "onnxplug-gemm-warm-float32"}
    assert blas.stats["warm_queries"] == before + 2
    assert not L.live  # handle, descriptor, layout and preference destroyed


def test_a_gemm_tuning_signature_names_its_types_and_every_part_of_its_plan_key(blas, monkeypatch):
    """A tuning result's op signature names the element and compute types (so TF32 and
    strict float32 results of one shape never mix); its params signature is the rest of the
    plan key, so any part of it that differs makes a different signature."""
    monkeypatch.setattr(blas, "NVMATH", _fake_nvmath(_FakeCublasLt()))
    key = (np.dtype("float32"), 128, 768, 3072, False, True, 128, 3072, 768, 3072, 1, 0, 0, 0)
    key += ("BIAS", 0, 0, 0, 0, 16, 16, 16, 16)
    tf32 = blas.LtGemm(object(), 0, True).signature(key)
    strict = blas.LtGemm(object(), 0, False).signature(key)
    assert tf32 == ("LtGemm<float32,COMPUTE_32F_FAST_TF32>", strict[1])
    assert strict[0] == "LtGemm<float32,COMPUTE_32F>"
    assert strict[1] == "128_768_3072_False_True_128_3072_768_3072_1_0_0_0_BIAS_0_0_0_0_16_16_16_16"
    half = blas.LtGemm(object(), 0, True).signature((np.dtype("float16"), *key[1:]))
    assert half[0] == "LtGemm<float16,COMPUTE_32F>"
    for i in range(1, len(key)):
        other = key[:i] + (8 if key[i] != 8 else 4,) + key[i + 1 :]
        assert blas.LtGemm(object(), 0, True).signature(other)[1] != tf32[1]


def test_a_gemm_warm_up_that_fails_is_left_to_the_first_real_query(blas, monkeypatch):
    """No context on the thread, or a library error: nothing raised and nothing queried (the
    first real query meets the error and reports it)."""
    L = _FakeCublasLt(fail=True)
    monkeypatch.setattr(blas, "NVMATH", _fake_nvmath(L))
    monkeypatch.setattr(blas, "make_primary_context_current", lambda ordinal: ordinal == 0)
    blas.LtGemm(object(), 0, True).warm_up(np.float16)  # create() raises
    blas.LtGemm(object(), 1, True).warm_up(np.float16)  # no context on device 1
    _join_gemm_warm_ups()
    assert L.queries == [] and not L.live


def test_a_failed_background_import_is_raised_where_the_modules_are_needed(blas, monkeypatch):
    """nvmath missing: the engine's first use sees the ImportError, warns once and uses CuPy's
    matmul, as when it imported nvmath itself."""
    bg = blas.BackgroundImport("no_such_module_onnxplug_test.cublasLt")
    monkeypatch.setattr(blas, "NVMATH", bg)
    bg.start()
    with pytest.raises(ModuleNotFoundError, match="no_such_module_onnxplug_test"):
        bg.modules()

    from onnxplug_cuda.options import parse_options

    class Ep:
        ordinal = 0
        options = parse_options({"use_tf32": "0"}, "CUDAExecutionProvider")

        class backend:
            xp = object()  # a GPU array module: not numpy

    with pytest.warns(RuntimeWarning, match="nvmath-python is not importable.*no_such_module"):
        eng = blas.engine_for(Ep())
    assert isinstance(eng, blas.XpGemm)


def test_import_skipping_package_inits(tmp_path, monkeypatch):
    """The module is imported without its packages' __init__; they are not left behind as
    bare packages, and a later import of the package runs its __init__ and finds the module."""
    monkeypatch.syspath_prepend(str(PLUGIN_SRC))
    from onnxplug_cuda.runtime import import_skipping_package_inits

    pkg = tmp_path / "heavypkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "import builtins\nbuiltins.HEAVY_INIT = True\nfrom . import sub\n"
    )
    (pkg / "sub" / "__init__.py").write_text("raise RuntimeError('sub init ran')\n")
    (pkg / "sub" / "leaf.py").write_text("from heavypkg.sub import helper\nVALUE = helper.X\n")
    (pkg / "sub" / "helper.py").write_text("X = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    names = ["heavypkg", "heavypkg.sub", "heavypkg.sub.leaf", "heavypkg.sub.helper"]
    try:
        leaf = import_skipping_package_inits("heavypkg.sub.leaf")
        assert leaf.VALUE == 42
        assert "heavypkg" not in sys.modules and "heavypkg.sub" not in sys.modules
        assert not hasattr(__import__("builtins"), "HEAVY_INIT")
        assert sys.modules["heavypkg.sub.leaf"] is leaf
        with pytest.raises(ModuleNotFoundError, match="nosuchpkg"):
            import_skipping_package_inits("nosuchpkg.leaf")
        with pytest.raises(RuntimeError, match="sub init ran"):
            __import__("heavypkg")  # the package's own __init__ runs as usual
        assert __import__("builtins").HEAVY_INIT
    finally:
        for n in names:
            sys.modules.pop(n, None)
        if hasattr(__import__("builtins"), "HEAVY_INIT"):
            del __import__("builtins").HEAVY_INIT
