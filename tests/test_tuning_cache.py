"""The CUDA plugin's on-disk caches (onnxplug_cuda.cache): where they live, how they are
turned off, that autotune results and serialized cuDNN plans survive a process and that a stale,
foreign or damaged entry is ignored, and that $ONNXPLUG_CACHE_DIR moves CuPy's kernel cache.
Runs on the host: the cuDNN graph is a stand-in with the frontend's plan-list and serialization
methods."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from onnxplug.ep import TuningResultsManager
from onnxplug_cuda import blas, cache, dnn

# a child process finds the plugin where this one does (tests/conftest.py may have put it there)
PLUGIN_PATH = os.path.dirname(os.path.dirname(os.path.abspath(dnn.__file__)))


def _env(*first: str) -> dict[str, str]:
    path = os.pathsep.join([*first, PLUGIN_PATH, os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def test_folder_option_then_environment_then_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("ONNXPLUG_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dnn.cache_folder("") == str(tmp_path / "xdg" / "onnxplug")
    monkeypatch.setenv("ONNXPLUG_CACHE_DIR", str(tmp_path / "env"))
    assert dnn.cache_folder("") == str(tmp_path / "env")
    assert dnn.cache_folder(str(tmp_path / "opt")) == str(tmp_path / "opt")
    for off in ("off", "OFF", "0", "none"):
        assert dnn.cache_folder(off) is None
    monkeypatch.setenv("ONNXPLUG_CACHE_DIR", "")
    assert dnn.cache_folder("") is None


def test_results_survive_the_process_and_merge_with_other_writers(tmp_path):
    a = dnn.TuningCache(str(tmp_path), "H100 sm90 cudnn 91900")
    a.put("k1", [3, 10, "plan3", 0.01])
    b = dnn.TuningCache(str(tmp_path), "H100 sm90 cudnn 91900")
    b.put("k2", [0, 4, "plan0", 0.02])
    a.flush()
    b.flush()  # merges with what a wrote
    c = dnn.TuningCache(str(tmp_path), "H100 sm90 cudnn 91900")
    assert c.get("k1") == [3, 10, "plan3", 0.01] and c.get("k2") == [0, 4, "plan0", 0.02]
    # another device or library version reads nothing of it
    assert dnn.TuningCache(str(tmp_path), "A100 sm80 cudnn 91900").get("k1") is None


def test_written_at_exit(tmp_path):
    code = (
        "from onnxplug_cuda import dnn\n"
        f"dnn.TuningCache({str(tmp_path)!r}, 'fp').put('k', [1, 2, 'p'])\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=_env())
    assert dnn.TuningCache(str(tmp_path), "fp").get("k") == [1, 2, "p"]


def test_turned_off_writes_nothing(tmp_path):
    c = dnn.TuningCache(None, "fp")
    c.put("k", [0, 1, "p"])
    c.flush()
    assert c.get("k") is None and list(tmp_path.iterdir()) == []


def test_unreadable_file_is_an_empty_cache(tmp_path):
    c = dnn.TuningCache(str(tmp_path), "fp")
    with open(c.path, "w") as fh:
        fh.write("{not json")
    assert dnn.TuningCache(str(tmp_path), "fp").get("k") is None
    c.put("k", [0, 1, "p"])
    c.flush()
    with open(c.path) as fh:
        assert json.load(fh)["entries"] == {"k": [0, 1, "p"]}


class _PlanList:
    """The frontend graph's plan-list methods the cache uses."""

    def __init__(self, names: list[str]):
        self.names = names
        self.built: list[int] = []

    def get_execution_plan_count(self) -> int:
        return len(self.names)

    def build_plan_at_index(self, i: int) -> None:
        self.built.append(i)

    def get_plan_name_at_index(self, i: int) -> str:
        return self.names[i]


@pytest.fixture
def engine(tmp_path):
    eng = object.__new__(dnn.CudnnConv)  # no cuDNN here: only the cache half of the engine
    eng.cache = dnn.TuningCache(str(tmp_path), "fp")
    return eng


def test_a_cached_plan_is_the_only_one_built(engine):
    g = _PlanList(["eng0", "eng1", "eng2"])
    engine._remember(g, "conv", 2, 0.0125)
    again = _PlanList(["eng0", "eng1", "eng2"])
    hits = dnn.stats["tuning_cache_hits"]
    assert engine._cached_plan(again, "conv") == (2, 0.0125)  # the plan and its time
    assert again.built == [2] and dnn.stats["tuning_cache_hits"] == hits + 1


@pytest.mark.parametrize("names", [["eng0", "eng1"], ["eng0", "eng1", "other"]])
def test_a_stale_plan_is_ignored(engine, names):
    engine._remember(_PlanList(["eng0", "eng1", "eng2"]), "conv", 2, 0.01)
    assert engine._cached_plan(_PlanList(names), "conv") == (None, None)
    assert engine._cached_plan(_PlanList(names), "another graph") == (None, None)


def test_an_entry_without_a_time_is_tuned_again(engine):
    """Entries written before the plan's time was kept (index, count, name) are not used:
    the fused-or-plain choice needs the time."""
    engine.cache.put("conv", [2, 3, "eng2"])
    g = _PlanList(["eng0", "eng1", "eng2"])
    assert engine._cached_plan(g, "conv") == (None, None) and g.built == []


class _Candidates(_PlanList):
    """A checked graph for ``_choose_plan``: its candidates' workspaces, the heuristics'
    choice built on request, and serialization of the plan built last."""

    def __init__(self, names: list[str], unbuildable: tuple[int, ...] = ()):
        super().__init__(names)
        self.unbuildable = unbuildable
        self.policy = None

    def build_plan_at_index(self, i: int) -> None:
        if i in self.unbuildable:
            raise RuntimeError("no")
        super().build_plan_at_index(i)

    def build_plans(self, policy: str) -> None:
        self.policy = policy

    def get_workspace_size(self) -> int:
        return 0

    def get_workspace_size_plan_at_index(self, i: int) -> int:
        return 256 * i

    def serialize(self) -> list[int]:
        return [self.built[-1]]


def _chooser(tmp_path, algo: int, times: dict[int, float], monkeypatch) -> dnn.CudnnConv:
    eng = object.__new__(dnn.CudnnConv)
    eng.cache = dnn.TuningCache(str(tmp_path), "fp")
    eng.plans = cache.PlanCache(str(tmp_path), "fp")
    eng.algo = algo
    eng.cudnn = SimpleNamespace(build_plan_policy=SimpleNamespace(HEURISTICS_CHOICE="heur"))
    monkeypatch.setattr(
        dnn, "_time_plans", lambda ctx, g, ptrs, built: {i: times[i] for i in built}
    )
    monkeypatch.setattr(dnn, "_variant_order", lambda g, ptrs: None)
    return eng


def test_exhaustive_search_runs_the_fastest_of_the_first_candidates(tmp_path, monkeypatch):
    """EXHAUSTIVE: the first ``_TUNED_PLANS`` candidates that build are timed (a candidate
    past them is not, however fast), the fastest runs by index with its workspace, and it is
    kept in the tuning cache and the plan cache; a second choice builds that one plan."""
    times = {0: 0.009, 2: 0.007, 3: 0.008, 4: 0.0075, 5: 0.001}
    eng = _chooser(tmp_path, 0, times, monkeypatch)  # 0: EXHAUSTIVE
    g = _Candidates([f"eng{i}" for i in range(6)], unbuildable=(1,))
    chosen = eng._choose_plan(_ctx(), g, "sdpa", "plan key", {})
    assert (chosen.best, chosen.ms, chosen.ws) == (2, 0.007, 512)
    assert g.built[:4] == [0, 2, 3, 4] and g.policy is None
    assert eng.plans.get("plan key") == (bytes([2]), 0.007)  # serialized after building 2
    again = _Candidates([f"eng{i}" for i in range(6)])
    assert eng._choose_plan(_ctx(), again, "sdpa", "plan key", {}).best == 2
    assert set(again.built) == {2}  # that plan only (built again to be serialized)


def test_a_capturing_stream_runs_the_first_candidate_untimed_and_unsaved(tmp_path, monkeypatch):
    eng = _chooser(tmp_path, 0, {0: 0.009, 1: 0.001}, monkeypatch)
    chosen = eng._choose_plan(_ctx(capturing=True), _Candidates(["a", "b"]), "k", "pk", {})
    assert (chosen.best, chosen.ms) == (0, None)
    assert eng.plans.get("pk") is None and eng.cache.get("k") is None


@pytest.mark.parametrize("algo", [1, 2])  # HEURISTIC, DEFAULT
def test_other_searches_run_the_heuristics_choice(tmp_path, monkeypatch, algo):
    eng = _chooser(tmp_path, algo, {}, monkeypatch)
    g = _Candidates(["a", "b"])
    chosen = eng._choose_plan(_ctx(), g, "k", "pk", {})
    assert (chosen.best, chosen.ms, g.policy, g.built) == (None, None, "heur", [])
    assert eng.cache.get("k") is None


def test_plans_survive_the_process_one_file_each(tmp_path):
    a = cache.PlanCache(str(tmp_path), "H100 sm90 cudnn 91900")
    a.put("conv k1", bytes(range(256)) * 4, 0.0125)
    a.put("sdpa k2", b"\n{plan\n", None)  # the bytes may hold newlines and braces
    b = cache.PlanCache(str(tmp_path), "H100 sm90 cudnn 91900")
    assert b.get("conv k1") == (bytes(range(256)) * 4, 0.0125)
    assert b.get("sdpa k2") == (b"\n{plan\n", None)
    assert b.get("another key") is None
    assert len(os.listdir(b.folder)) == 2  # no temporary file left behind
    # another device or library version has a folder of its own
    assert cache.PlanCache(str(tmp_path), "A100 sm80 cudnn 91900").get("conv k1") is None


def test_a_plan_file_of_another_key_or_damaged_is_no_entry(tmp_path):
    c = cache.PlanCache(str(tmp_path), "fp")
    c.put("k", b"plan", 0.5)
    path = c._path("k")
    with open(path, "rb") as fh:
        body = fh.read()
    with open(path, "wb") as fh:  # a digest collision: the file names another key
        fh.write(body.replace(b'"k"', b'"j"'))
    assert c.get("k") is None
    for damaged in (b"{not json\nplan", b'{"key": "k", "ms": 1}\n', b""):
        with open(path, "wb") as fh:
            fh.write(damaged)
        assert c.get("k") is None
    c.put("k", b"plan", None)  # rewritten
    assert c.get("k") == (b"plan", None)


def test_plans_turned_off_write_nothing(tmp_path):
    c = cache.PlanCache(None, "fp")
    c.put("k", b"plan", 0.1)
    assert c.get("k") is None and list(tmp_path.iterdir()) == []


def test_an_unwritable_plan_folder_warns_once(tmp_path):
    (tmp_path / "file").write_text("")
    c = cache.PlanCache(str(tmp_path / "file"), "fp")  # a file where the folder should be
    with pytest.warns(RuntimeWarning, match="cannot write cuDNN plans"):
        c.put("k", b"plan", 0.1)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.put("k2", b"plan", 0.1)
    assert c.get("k") is None


class _SerializedGraph:
    """The frontend graph's serialization methods (``serialize`` gives its candidate plan, which
    ``build_plan_at_index`` sets) and deserialization (``deserialize`` takes a list of ints)."""

    def __init__(self, handle=None, plans=(b"plan0", b"plan1", b"plan2")):
        self.handle, self.plans, self.candidate = handle, list(plans), 0
        self.loaded: bytes | None = None

    def build_plan_at_index(self, i: int) -> None:
        self.candidate = i

    def serialize(self) -> list[int]:
        return list(self.plans[self.candidate])

    def deserialize(self, data) -> None:
        assert isinstance(data, list)
        if bytes(data) == b"damaged":
            raise RuntimeError("cudnn: cannot deserialize")
        self.loaded = bytes(data)

    def get_workspace_size(self) -> int:
        return 4096


class _Frontend:
    pygraph = _SerializedGraph


def _ctx(capturing: bool = False, invalidated: bool = False) -> SimpleNamespace:
    """A kernel context as the engine uses it: its stream's cuDNN handle and capture state
    (``invalidated``: in a capture an error has invalidated)."""
    stream = SimpleNamespace(
        cudnn=7,
        is_capturing=lambda: capturing or invalidated,
        capture_invalidated=lambda: invalidated,
    )
    return SimpleNamespace(stream=stream)


@pytest.fixture
def planned(tmp_path):
    eng = object.__new__(dnn.CudnnConv)  # no cuDNN here: only the plan-cache half
    eng.cudnn, eng.plans = _Frontend(), cache.PlanCache(str(tmp_path), "fp")
    return eng


def test_the_plan_a_graph_runs_is_the_one_kept(planned):
    """An autotuned graph keeps its winner (made the candidate before serializing), a
    heuristic one its default candidate; a later engine deserializes it on the context's
    handle, with the time the search measured."""
    planned._save_plan("tuned", _SerializedGraph(), 2, 0.0125)
    planned._save_plan("heuristic", _SerializedGraph(), None, None)
    hits = dnn.stats["plan_cache_hits"]
    g = planned._load_plan(_ctx(), "tuned", {})
    assert g.graph.loaded == b"plan2" and g.graph.handle == 7 and g.ms == 0.0125
    assert g.best is None and g.ws == 4096  # its one plan runs as the default candidate
    h = planned._load_plan(_ctx(), "heuristic", {})
    assert h.graph.loaded == b"plan0" and h.ms is None
    assert planned._load_plan(_ctx(), "never built", {}) is None
    assert dnn.stats["plan_cache_hits"] == hits + 2


def test_a_plan_this_cudnn_cannot_load_is_built_again(planned):
    planned.plans.put("k", b"damaged", 0.1)
    assert planned._load_plan(_ctx(), "k", {}) is None


def test_a_plan_without_a_serialized_form_is_not_kept(planned):
    class Unserializable(_SerializedGraph):
        def serialize(self):
            raise RuntimeError("not supported for this engine")

    planned._save_plan("k", Unserializable(), None, None)
    assert planned.plans.get("k") is None


def _spec(**kw) -> dnn.ConvSpec:
    import numpy as np

    base = dict(
        kind="fprop", dtype=np.dtype(np.float16), x=(1, 64, 56, 56), w=(64, 64, 1, 1),
        y=(1, 64, 56, 56), pads_begin=(0, 0), pads_end=(0, 0), strides=(1, 1),
        dilations=(1, 1),
    )  # fmt: skip
    return dnn.ConvSpec(**{**base, **kw})


@pytest.mark.parametrize(
    ("fused_ms", "plain_ms", "pays"),
    [
        (0.0090, 0.0080, True),  # 1 µs slower than the plain graph, but the epilogue costs more
        (0.0200, 0.0060, False),  # the fused engine is slower than plain + epilogue
        (None, 0.0060, True),  # not timed (HEURISTIC search): the fusion is taken
        (0.0200, None, True),
    ],
)
def test_an_optional_fusion_runs_where_it_pays(fused_ms, plain_ms, pays):
    """Bias + ReLU fused on a shipped engine runs (NCHW) only where its timed plan is not
    slower than the plain graph's plus the epilogue kernel it saves (``_epilogue_ms``)."""
    eng = object.__new__(dnn.CudnnConv)
    eng.ordinal, eng._pays = 0, {}
    plain = _spec()
    fused = _spec(bias=True, relu=True, precompiled=True)
    eng._graphs = {
        (0, fused): dnn._Graph(None, 0, 0, None, fused_ms),
        (0, plain): dnn._Graph(None, 0, 0, None, plain_ms),
    }
    ptrs = {dnn._UID_X: 0, dnn._UID_W: 0, dnn._UID_Y: 0, dnn._UID_B: 0}
    assert eng._fusion_pays(None, fused, plain, ptrs) is pays
    assert eng._pays == {fused: pays}  # decided once
    y_bytes = 64 * 56 * 56 * 2
    assert dnn._epilogue_ms(plain) == pytest.approx(2e-3 + 2 * y_bytes / 2e9)


def test_an_optional_fusion_in_nhwc_runs_without_a_plain_graph():
    """In NHWC every such fusion paid (H100): the fused graph runs, untimed against a plain
    graph, which is not built; without an engine for it, it is not taken."""
    eng = object.__new__(dnn.CudnnConv)
    eng.ordinal, eng._pays = 0, {}
    plain = _spec(channels_last=True)
    fused = _spec(bias=True, relu=True, precompiled=True, channels_last=True)
    eng._graphs = {(0, fused): dnn._Graph(None, 0, 0, None, 0.0200)}  # slower than NCHW allows
    assert eng._fusion_pays(None, fused, plain, {}) is True
    assert list(eng._graphs) == [(0, fused)]
    other = _spec(bias=True, precompiled=True, channels_last=True)
    eng._graphs[(0, other)] = None
    assert eng._fusion_pays(None, other, plain, {}) is False


def test_an_optional_fusion_without_an_engine_is_not_taken():
    eng = object.__new__(dnn.CudnnConv)
    eng.ordinal, eng._pays = 0, {}
    plain, fused = _spec(), _spec(bias=True, precompiled=True)
    eng._graphs = {(0, fused): None, (0, plain): dnn._Graph(None, 0, 0, None, 0.005)}
    assert eng._fusion_pays(None, fused, plain, {}) is False


def test_cudnn_is_imported_without_importing_torch(tmp_path):
    """cuDNN frontend 1.25 imports torch eagerly (seconds of a cold start); import_cudnn blocks
    it for that import only: torch imports normally afterwards."""
    (tmp_path / "cudnn").mkdir()
    (tmp_path / "cudnn" / "__init__.py").write_text(
        "try:\n    import torch\nexcept ImportError:\n    torch = None\n"
    )
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("")
    code = (
        "import sys\n"
        "from onnxplug_cuda.dnn import import_cudnn\n"
        "cudnn = import_cudnn()\n"
        "assert cudnn.torch is None and 'torch' not in sys.modules\n"
        "import torch\n"
        "assert torch.__file__.startswith(sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, env=_env(str(tmp_path)))


def test_kernels_follow_the_cache_folder_variable(tmp_path):
    """$ONNXPLUG_CACHE_DIR moves CuPy's kernel cache into its kernels/ folder, or into memory
    for "off"; CuPy's own variables win, and without ours CuPy's default stays."""
    env = {"ONNXPLUG_CACHE_DIR": str(tmp_path)}
    cache.use_cache_folder_for_kernels(env)
    assert env["CUPY_CACHE_DIR"] == str(tmp_path / "kernels") and "CUPY_CACHE_IN_MEMORY" not in env
    for off in ("off", ""):
        env = {"ONNXPLUG_CACHE_DIR": off}
        cache.use_cache_folder_for_kernels(env)
        assert env == {"ONNXPLUG_CACHE_DIR": off, "CUPY_CACHE_IN_MEMORY": "1"}
    for mine in ({"CUPY_CACHE_DIR": "/mine"}, {"CUPY_CACHE_IN_MEMORY": "0"}, {}):
        env = {**mine, **({"ONNXPLUG_CACHE_DIR": str(tmp_path)} if mine else {})}
        before = dict(env)
        cache.use_cache_folder_for_kernels(env)
        assert env == before


def test_importing_the_plugin_sets_the_kernel_cache_folder(tmp_path):
    env = {k: v for k, v in _env().items() if not k.startswith("CUPY_CACHE")}
    env["ONNXPLUG_CACHE_DIR"] = str(tmp_path)
    code = "import os, onnxplug_cuda; print(os.environ['CUPY_CACHE_DIR'])"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(tmp_path / "kernels")


# ---------------------------------------------------------------------------------------------
# GEMM tuning (tunable_op_*): which of cuBLASLt's heuristic candidates a signature runs


def _gemm_tuning(tmp_path, tune: bool = True, results=None) -> blas.GemmTuning:
    cache = dnn.TuningCache(str(tmp_path), "fp", prefix="gemm")
    return blas.GemmTuning(tune, 0.0, cache, results or TuningResultsManager())


def test_a_gemm_signature_is_tuned_once_and_kept(tmp_path):
    """Tuning times the candidates on the first call of a signature, runs the fastest, and
    keeps it: later calls in the process do not time again, and a new process (a new
    tuning over the same cache file) runs the same candidate without timing."""
    timed = []

    def timer() -> dict[int, float]:
        timed.append(1)
        return {0: 0.010, 1: 0.007, 2: float("inf"), 3: 0.009}

    t = _gemm_tuning(tmp_path)
    assert t.choose("op", "k", 4, timer, capturing=False) == 1
    assert t.choose("op", "k", 4, timer, capturing=False) == 1 and len(timed) == 1
    t.cache.flush()
    again = _gemm_tuning(tmp_path)
    hits = blas.stats["tuning_cache_hits"]
    assert again.choose("op", "k", 4, timer, capturing=False) == 1 and len(timed) == 1
    assert blas.stats["tuning_cache_hits"] == hits + 1
    assert again.cache.path.endswith(".json") and "gemm-" in again.cache.path


@pytest.mark.parametrize("case", ["capturing", "no timer", "one candidate", "not tuning"])
def test_an_untunable_first_call_fixes_the_heuristics_choice_for_the_process(tmp_path, case):
    """Where the first call of a signature cannot be timed (a capture, an accumulating call,
    one candidate) or tuning is off, it runs candidate 0, and so does every later call in the
    process (eager, prepared and replayed runs agree), with nothing written to the cache."""
    t = _gemm_tuning(tmp_path, tune=case != "not tuning")
    count = 1 if case == "one candidate" else 3
    timer = None if case == "no timer" else (lambda: {0: 0.01, 1: 0.001, 2: 0.02})
    assert t.choose("op", "k", count, timer, capturing=case == "capturing") == 0
    assert t.choose("op", "k", count, lambda: {1: 0.0001}, capturing=False) == 0
    assert t.cache.get("op k") is None


def test_a_cached_choice_for_another_candidate_list_is_ignored(tmp_path):
    t = _gemm_tuning(tmp_path)
    t.cache.put("op k", [5, 8, 0.01])  # written where the heuristic returned 8 candidates
    assert t.choose("op", "k", 4, lambda: {0: 0.02, 3: 0.01}, capturing=False) == 3


def test_a_given_result_runs_without_timing_and_is_not_written_to_the_cache(tmp_path):
    """A result the device's results hold (given by ``set_tuning_results``) decides the
    signature: no timing, no cache entry; one out of this candidate list's range is ignored."""
    results = TuningResultsManager()
    results.load({"op": {"k": 2, "far": 9}})
    t = _gemm_tuning(tmp_path, results=results)
    hits = blas.stats["tuning_results_hits"]

    def timer() -> dict[int, float]:
        raise AssertionError("a given result is not timed")

    assert t.choose("op", "k", 4, timer, capturing=False) == 2
    assert blas.stats["tuning_results_hits"] == hits + 1 and t.cache.get("op k") is None
    assert t.choose("op", "far", 4, lambda: {0: 0.02, 3: 0.01}, capturing=False) == 3
    assert results.lookup("op", "far") == 9  # the given id stays what it was given as


def test_tuned_and_cached_choices_join_the_devices_results(tmp_path):
    """What a signature tuned, or found in the cache, is in the device's results (what
    ``get_tuning_results`` reports); the heuristic's default is not a result."""
    results = TuningResultsManager()
    t = _gemm_tuning(tmp_path, results=results)
    assert t.choose("op", "tuned", 4, lambda: {0: 0.02, 3: 0.01}, capturing=False) == 3
    t.cache.put("op cached", [1, 4, 0.01])
    assert t.choose("op", "cached", 4, None, capturing=False) == 1
    assert t.choose("op", "default", 4, None, capturing=True) == 0
    assert results.dump() == {"op": {"tuned": 3, "cached": 1}}
    # another engine of the device (other options) finds them without timing or the cache
    other = _gemm_tuning(tmp_path / "other", results=results)
    assert other.choose("op", "tuned", 4, None, capturing=False) == 3


@pytest.mark.parametrize(
    "given",
    [{}, {"tunable_op_enable": "1", "tunable_op_tuning_enable": "1", "tuning_cache_dir": "off"}],
)
def test_a_providers_gemm_engine_is_found_under_the_key_it_was_made_with(monkeypatch, given):
    """``engine_for`` files a provider's GEMM engine under ``engine_key`` (device, TF32 and the
    tuning options), and ``device_objects`` looks it up by the same key."""
    from onnxplug_cuda.ep import CudaEp
    from onnxplug_cuda.options import parse_options

    class Engine:
        def __init__(self, xp, ordinal, use_tf32, tuning=None):
            self.ordinal, self.tuning = ordinal, tuning

    monkeypatch.setattr(blas, "LtGemm", Engine)
    monkeypatch.setattr(blas, "_engines", {})
    monkeypatch.setattr(blas, "_tuning", lambda ep: "tuning")
    ep = object.__new__(CudaEp)
    ep.ordinal, ep.options = 0, parse_options(given, "CUDAExecutionProvider")
    ep.backend = SimpleNamespace(xp=object())  # not numpy: the GPU's path
    eng = blas.engine_for(ep)
    assert blas._engines == {blas.engine_key(ep): eng}
    assert (eng.tuning is not None) == bool(given)
    ep.backend.ordinal = 0
    ep._external = ep._shared = ep._unified = None
    ep._lock, ep._streams, ep._graphs = threading.Lock(), [], {}
    assert [o for kind, _, o in ep.device_objects() if kind == "gemm engine"] == [eng]


class _FailingPlan:
    """A frontend graph whose plan fails to execute (as cuDNN's EXECUTION_FAILED)."""

    def _execute_plan_at_index(self, ptrs, ws, i, handle) -> None:
        raise RuntimeError("CUDNN_STATUS_EXECUTION_FAILED")


def _failing_engine() -> tuple[dnn.CudnnConv, dnn.ConvSpec]:
    eng = object.__new__(dnn.CudnnConv)
    eng.ordinal, eng._lock, eng._warned = 0, threading.Lock(), set()
    spec = _spec()
    eng._graphs = {(0, spec): dnn._Graph(_FailingPlan(), 0, 0, None, 0.01)}
    return eng, spec


def test_a_convolution_failing_outside_a_broken_capture_takes_the_gemm_path_for_good():
    eng, spec = _failing_engine()
    with pytest.warns(RuntimeWarning, match="failed to execute"):
        assert eng._execute(_ctx(), spec, {}) is False
    assert eng._graphs[(0, spec)] is None  # the GEMM fallback from now on


def test_a_convolution_failing_in_an_invalidated_capture_keeps_its_plan():
    """In a capture an error has invalidated, every call fails: the error is raised (the
    capture fails and the run goes on eagerly) and the plan stays, not the GEMM path."""
    eng, spec = _failing_engine()
    plan = eng._graphs[(0, spec)]
    with pytest.raises(RuntimeError, match="EXECUTION_FAILED"):
        eng._execute(_ctx(invalidated=True), spec, {})
    assert eng._graphs[(0, spec)] is plan
    assert not eng._warned


@pytest.mark.parametrize("invalidated", [False, True])
def test_a_graph_that_fails_to_build_is_recorded_only_outside_an_invalidated_capture(
    monkeypatch, invalidated
):
    eng = object.__new__(dnn.CudnnConv)
    eng.ordinal, eng._lock, eng._warned, eng._graphs = 0, threading.Lock(), set(), {}
    spec = _spec()

    def build(ctx, spec, ptrs):
        raise RuntimeError("the stream was capturing, but an error has invalidated it")

    monkeypatch.setattr(eng, "_build", build, raising=False)
    key = (0, spec)
    if invalidated:
        with pytest.raises(RuntimeError, match="invalidated"):
            eng._get(_ctx(invalidated=True), key, {})
        assert key not in eng._graphs  # built again by the eager run
    else:
        with pytest.warns(RuntimeWarning, match="cuDNN cannot run fprop"):
            assert eng._get(_ctx(), key, {}) is None
        assert eng._graphs[key] is None
