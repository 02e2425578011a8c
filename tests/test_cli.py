"""The ``onnxplug`` command, run in-process through ``main(argv)``.

Each subcommand's output is checked for the facts it promises (shapes, values, assignment
summary, latency, counts), and every user error must come out as one line on stderr with a
non-zero exit status and no traceback.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxplug as ox
from onnxplug.cli.main import demo_model_path, demo_reference, main, provider_entries
from onnxplug.tools import parity


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def add_model(tmp_path):
    """A model with a symbolic batch dim and an int64 input: y = x + 1, n = Shape(x)."""
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["x", "one"], ["y"]),
            helper.make_node("Shape", ["x"], ["n"]),
            helper.make_node("Identity", ["k"], ["k_out"]),
        ],
        "add_one",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("k", TensorProto.INT64, [2]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("n", TensorProto.INT64, [2]),
            helper.make_tensor_value_info("k_out", TensorProto.INT64, [2]),
        ],
        initializer=[helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "add_one.onnx"
    onnx.save(model, str(path))
    return path


def _one_error_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("onnxplug: error: ")
    return lines[0]


# demo -----------------------------------------------------------------------------------------


def test_demo_model_is_shipped_and_small():
    path = demo_model_path()
    assert path.is_file()
    assert path.stat().st_size < 16 * 1024
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)


def test_demo_prints_shapes_values_assignment_and_timing(capsys):
    rc, out, err = run_cli(capsys, "demo", "--runs", "5")
    assert rc == 0, err
    assert "input  image: tensor(float) [N, 1, 8, 8]" in out
    assert "output probabilities: tensor(float) [N, 10]" in out
    assert "probabilities [2, 10]" in out
    assert re.search(r"image 0: class \d \(p=0\.\d{4}\)", out)
    assert "(ok)" in out  # agrees with the numpy reference
    assert re.search(r"CPUExecutionProvider\s+5 nodes", out)  # Conv + Relu is one FusedConv
    assert "copies: none" in out
    assert re.search(r"first run [\d.]+ ms; over 5 runs median [\d.]+ ms", out)


def test_demo_reference_matches_the_runtime():
    path = demo_model_path()
    x = np.random.default_rng(3).standard_normal((3, 1, 8, 8)).astype(np.float32)
    got = ox.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {"image": x}
    )[0]
    ref = demo_reference(path, x)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ref.sum(axis=1), 1.0, rtol=1e-9)


# run ------------------------------------------------------------------------------------------


def test_run_random_inputs_symbolic_dims_and_output_dir(capsys, add_model, tmp_path):
    out_dir = tmp_path / "outs"
    rc, out, err = run_cli(
        capsys,
        "run",
        str(add_model),
        "--dim",
        "batch=4",
        "--runs",
        "3",
        "--output-dir",
        str(out_dir),
    )
    assert rc == 0, err
    assert "feed   x: random, shape [4, 3] float32" in out
    assert "feed   k: random, shape [2] int64" in out
    assert "y: shape [4, 3] float32" in out
    assert "n: shape [2] int64: [4, 3]" in out
    assert re.search(r"CPUExecutionProvider\s+3 nodes", out)
    assert re.search(r"p90 [\d.]+ ms", out)
    y = np.load(out_dir / "y.npy")
    assert y.shape == (4, 3)
    np.testing.assert_array_equal(np.load(out_dir / "n.npy"), [4, 3])


def test_run_symbolic_dims_default_to_one(capsys, add_model):
    rc, out, _ = run_cli(capsys, "run", str(add_model), "--runs", "0")
    assert rc == 0
    assert "n: shape [2] int64: [1, 3]" in out
    assert "latency: first run" in out


def test_run_with_input_file_and_provider_option(capsys, add_model, tmp_path):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.save(tmp_path / "x.npy", x)
    rc, out, err = run_cli(
        capsys,
        "run",
        str(add_model),
        "--input",
        f"x={tmp_path / 'x.npy'}",
        "--provider",
        "CPUExecutionProvider",
        "--output-dir",
        str(tmp_path),
    )
    assert rc == 0, err
    assert "feed   x: from file, shape [2, 3] float32" in out
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), x + 1)


def test_provider_entries():
    assert provider_entries(["CPUExecutionProvider"], None) == ["CPUExecutionProvider"]
    assert provider_entries(["CPUExecutionProvider"], ["CPUExecutionProvider:a=1"]) == [
        ("CPUExecutionProvider", {"a": "1"})
    ]
    assert provider_entries(None, None) == ox.get_available_providers()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["run", "missing.onnx"], "no such model file"),
        (["run", "{model}", "--provider", "NoSuchExecutionProvider"], "NoSuchExecutionProvider"),
        (["run", "{model}", "--provider-option", "CPUExecutionProvider:x"], "name=value"),
        (["run", "{model}", "--provider-option", "OtherEP:a=1"], "not among the session's"),
        (["run", "{model}", "--input", "nope=x.npy"], "has no input 'nope'"),
        (["run", "{model}", "--input", "x=/no/such/file.npy"], "no such file"),
        (["run", "{model}", "--input", "x"], "name=value"),
        (["run", "{model}", "--dim", "batch=two"], "not an integer"),
        (["run", "{model}", "--runs", "-2"], "--runs"),
        (["demo", "--batch", "0"], "--batch"),
        (["conformance", "--pattern", "("], "regular expression"),
        (["parity", "--provider", "NoSuchExecutionProvider"], "NoSuchExecutionProvider"),
    ],
)
def test_errors_are_one_line(capsys, add_model, argv, needle):
    argv = [a.replace("{model}", str(add_model)) for a in argv]
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 1
    assert needle in _one_error_line(err)


def test_runtime_error_is_one_line(capsys, add_model, tmp_path):
    np.save(tmp_path / "bad.npy", np.zeros((2, 3, 4), np.float32))
    rc, _, err = run_cli(capsys, "run", str(add_model), "--input", f"x={tmp_path / 'bad.npy'}")
    assert rc == 1
    assert "INVALID_ARGUMENT" in _one_error_line(err)


def test_traceback_flag_reraises(add_model):
    with pytest.raises(ox.errors.InvalidArgument):
        main(["--traceback", "run", str(add_model), "--provider", "NoSuchExecutionProvider"])


def test_usage_errors_exit_as_the_readme_says(capsys):
    # README: "Errors print one line (`onnxplug: error: ...`) and exit with status 1"
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "Errors print one line (`onnxplug: error: ...`) and exit with status 1" in readme
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 1
    assert "required: COMMAND" in _one_error_line(capsys.readouterr().err)
    with pytest.raises(SystemExit) as e:
        main(["run", "model.onnx", "--runs", "many"])
    assert e.value.code == 1
    line = _one_error_line(capsys.readouterr().err)
    assert "argument --runs" in line and "see 'onnxplug run --help'" in line
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert ox.__version__ in capsys.readouterr().out


# providers, parity, conformance -----------------------------------------------------------------


def test_providers_lists_devices_and_load_errors(capsys):
    rc, out, _ = run_cli(capsys, "providers")
    assert rc == 0
    assert "available providers:" in out and "CPUExecutionProvider" in out
    assert "CPUExecutionProvider (onnxplug) on CPU:0" in out
    assert "ep options:" in out
    assert "plugins that failed to load:" in out


def test_providers_shows_a_plugin_that_failed(capsys):
    from onnxplug.ep.loader import REGISTRY

    name = "BrokenTestExecutionProvider"
    # what discovery records for an entry point whose module does not import
    REGISTRY._load(name, "no_such_module_for_onnxplug:create_factory", "entry_point")
    try:
        rc, out, _ = run_cli(capsys, "providers")
    finally:
        ox.unregister_execution_provider_library(name)
    assert rc == 0
    assert f"{name}: failed to load; from entry_point" in out
    failed = out.split("plugins that failed to load:")[1]
    assert name in failed and "no_such_module_for_onnxplug" in failed
    assert name not in ox.get_available_providers()


def test_parity_reports_every_op_and_totals(capsys, tmp_path):
    out_json = tmp_path / "parity.json"
    # only the CPU EP: other tests may leave test plugins registered in this process
    rc, out, err = run_cli(
        capsys, "parity", "--provider", "CPUExecutionProvider", "--json", str(out_json)
    )
    assert rc == 0, err
    assert "CPUExecutionProvider: domain ai.onnx of onnx" in out
    assert re.search(r"^\s+Add\s+1,6,7,13,14\s+", out, re.M)
    assert re.search(r"totals: \d+ ops: \d+ full, \d+ partial, \d+ without a kernel", out)
    data = json.loads(out_json.read_text())
    assert data[0]["provider"] == "CPUExecutionProvider"
    assert data[0]["totals"]["schema_versions"] > 500


def test_parity_gaps_only_hides_full_ops(capsys):
    rc, out, _ = run_cli(capsys, "parity", "--provider", "CPUExecutionProvider", "--gaps")
    assert rc == 0
    rows = [
        line for line in out.splitlines()[2:] if not line.lstrip().startswith(("totals", "kernels"))
    ]
    assert all(" full " not in row for row in rows)


class _FakeRegistry:
    """A registry with Add for opsets 7-12 only and Relu everywhere."""

    def kernel_defs(self):
        return [ox.ep.KernelDef("Add", "", 7, 12), ox.ep.KernelDef("Relu", "", 1, None)]


def test_parity_compare_finds_version_gaps():
    pp = parity.compare(_FakeRegistry(), "FakeEP")  # type: ignore[arg-type]
    ops = {op.op_type: op for op in pp.ops}
    add = ops["Add"]
    assert add.status == "partial"
    assert add.kernel_ranges == [(7, 12)]
    assert add.gaps == [1, 6, 13, 14]
    assert "v13 (opsets 13)" in parity.format_gaps(add, pp.max_opset)
    assert "v14 (opsets 14-" in parity.format_gaps(add, pp.max_opset)
    assert ops["Relu"].status == "full"
    assert ops["Conv"].status == "none"
    # LayerNormalization has a function body: no kernel, but expandable
    assert set(ops["LayerNormalization"].version_status.values()) == {parity.FUNCTION}
    t = pp.totals()
    assert t["ops_full"] == 1 and t["ops_partial"] == 1
    assert t["versions_kernel"] == 1 + len(ops["Relu"].schema_versions)


def test_parity_merge_ranges():
    KD = ox.ep.KernelDef
    assert parity.merge_ranges([KD("A", "", 1, 5), KD("A", "", 6, 9), KD("A", "", 13)]) == [
        (1, 9),
        (13, None),
    ]
    assert parity.merge_ranges([KD("A", "", 1), KD("A", "", 7, 9)]) == [(1, None)]
    # the same start with an open and a closed end (a native kernel over a reference one)
    assert parity.merge_ranges([KD("A", "", 6), KD("A", "", 6, 12)]) == [(6, None)]
    assert parity.format_ranges([(1, 9), (13, None)]) == "1-9,13+"


def test_conformance_subset(capsys, tmp_path):
    out_json = tmp_path / "conf.json"
    rc, out, err = run_cli(
        capsys, "conformance", "--pattern", r"^test_(relu|abs|neg)$", "--json", str(out_json), "-v"
    )
    assert rc == 0, err
    assert "passed=3" in out
    assert "pass_rate=" in out
    cases = json.loads(out_json.read_text())["cases"]
    assert sorted(c["name"] for c in cases) == ["test_abs", "test_neg", "test_relu"]


# with a device plugin (the virtual-device test plugin from tests/plugins) ---------------------


@pytest.fixture
def relu_neg_model(tmp_path):
    """Relu (which the virtual device has a kernel for) then Neg (which it has not)."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["y"])],
        "relu_neg",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    path = tmp_path / "relu_neg.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_run_on_a_device_plugin_shows_copy_nodes(capsys, virt, relu_neg_model, tmp_path):
    name = virt.name
    rc, out, err = run_cli(
        capsys,
        "run",
        str(relu_neg_model),
        "--provider",
        name,
        "--provider",
        "CPUExecutionProvider",
        "--provider-option",
        f"{name}:streams=none",
        "--output-dir",
        str(tmp_path),
    )
    assert rc == 0, err
    assert re.search(rf"{name}\s+1 nodes\s+\(Relu 1\)", out)
    assert re.search(r"CPUExecutionProvider\s+1 nodes\s+\(Neg 1\)", out)
    # the feed is placed on the device by the session; the result comes back through a copy
    assert "(2 nodes, 1 copy nodes)" in out
    assert f"copies: 1 x MemcpyToHost on {name}" in out
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)  # the CLI's seed 0
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), -np.maximum(x, 0))


def test_providers_and_parity_see_a_registered_plugin(capsys, virt):
    name = virt.name
    rc, out, _ = run_cli(capsys, "providers")
    assert rc == 0
    assert f"{name} (onnxplug-tests) on NPU:0" in out
    assert "virt_device_id=0" in out
    rc, out, err = run_cli(capsys, "parity", "--provider", name)
    assert rc == 0, err
    assert f"{name}: domain ai.onnx" in out
    assert re.search(r"^\s+Relu\s+1,6,13,14\s+\S+\s+(full|partial)", out, re.M)
    assert re.search(r"^\s+Conv\s+.*\s+none\s+v1 ", out, re.M)


def test_conformance_check_against_the_expected_failures(capsys):
    # cases outside the expected-failure list that pass: the check holds
    rc, out, err = run_cli(capsys, "conformance", "--pattern", r"^test_(relu|abs)$", "--check")
    assert rc == 0, err
    assert "passed=2" in out


def run_on(capsys: pytest.CaptureFixture[str], model, provider: str, *argv: str):
    """``onnxplug run MODEL --provider PROVIDER ARGV...``."""
    return run_cli(capsys, "run", str(model), "--provider", provider, *argv)


def test_run_memory_prints_peak_and_in_use_device_memory(capsys, virt_arena, relu_neg_model):
    name = virt_arena.name
    limit = f"{name}:arena.max_mem={64 << 20}"
    rc, out, err = run_on(
        capsys, relu_neg_model, name, "--provider-option", limit, "--runs", "3", "--memory"
    )
    assert rc == 0, err
    line = next(x for x in out.splitlines() if x.strip().startswith("virt:2"))
    # the feed's copy and Relu's output (24 bytes each, 256 in the arena): first as two
    # allocations of the recording run, then in the memory plan's block, which the pooled frame
    # keeps between runs; the steady-state runs allocate nothing
    assert "peak 512 B in use, 512 B in use now, 1.0 MiB held" in line, line
    assert "limit 64.0 MiB" in line and "1 arena regions" in line
    assert "3 allocations" in line


def test_run_memory_on_the_host_only(capsys, add_model):
    rc, out, err = run_on(capsys, add_model, "CPUExecutionProvider", "--memory")
    assert rc == 0, err
    assert "memory: no device allocators (host tensors are numpy arrays)" in out


def _png_pixels(data: bytes) -> np.ndarray:
    """The RGB pixels of a PNG written by onnxplug.tools.plot (8-bit RGB, no filtering)."""
    import struct
    import zlib

    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, size = 8, b"", (0, 0)
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    w, h = size
    rows = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + 3 * w)
    assert (rows[:, 0] == 0).all()
    return rows[:, 1:].reshape(h, w, 3)


def test_run_memory_plot_draws_a_png(capsys, virt_arena, relu_neg_model, tmp_path):
    from onnxplug.tools.plot import COLORS

    target = tmp_path / "mem.png"
    rc, out, err = run_on(
        capsys, relu_neg_model, virt_arena.name, "--runs", "1", "--memory-plot", str(target)
    )
    assert rc == 0, err
    assert re.search(r"memory plot: .*mem.png \(device memory in use during one run: x 0-", out)
    assert "virt:2 blue" in out
    img = _png_pixels(target.read_bytes())
    assert img.shape == (400, 800, 3)
    assert (img == COLORS[0]).all(axis=2).sum() > 100  # the series was drawn


def test_run_memory_plot_without_an_arena(capsys, add_model, tmp_path):
    rc, out, err = run_cli(
        capsys, "run", str(add_model), "--runs", "0", "--memory-plot", str(tmp_path / "m.png")
    )
    assert rc == 0, err
    assert "memory plot: not written, the session has no device arena" in out
    assert not (tmp_path / "m.png").exists()


@pytest.fixture
def unnamed_dims_model(tmp_path):
    """x: [-1, ?, 3] (PaddlePaddle's -1 and an unnamed dim), s: ['batch', 2]."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, None, 3])
    s = helper.make_tensor_value_info("s", TensorProto.FLOAT, ["batch", 2])
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Relu", ["s"], ["t"])],
        "dims",
        [x, s],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("t", TensorProto.FLOAT, None),
        ],
    )
    path = tmp_path / "dims.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_run_says_which_dims_it_defaulted(capsys, unnamed_dims_model):
    rc, out, err = run_cli(capsys, "run", str(unnamed_dims_model), "--runs", "0")
    assert rc == 0, err
    line = next(x for x in out.splitlines() if x.startswith("dims not given, set to 1"))
    assert "x:0 (unnamed: --dim x:0=N)" in line and "x:1 (unnamed: --dim x:1=N)" in line
    assert "s:0 ('batch': --dim batch=N or --dim s:0=N)" in line


def test_dim_by_input_and_axis(capsys, unnamed_dims_model):
    rc, out, err = run_cli(
        capsys,
        "run",
        str(unnamed_dims_model),
        "--runs",
        "0",
        "--dim",
        "x:0=4",
        "--dim",
        "x:-2=5",
        "--dim",
        "batch=2",
    )
    assert rc == 0, err
    assert "feed   x: random, shape [4, 5, 3]" in out and "feed   s: random, shape [2, 2]" in out
    assert "dims not given" not in out
    for bad, why in [
        ("x:2=4", "axis 2 of input 'x' is fixed at 3"),
        ("x:3=4", "input 'x' has 3 axes"),
        ("nope:0=4", "the model has no input 'nope'"),
        ("seq=4", "no dimension named 'seq'"),
    ]:
        rc, _, err = run_cli(capsys, "run", str(unnamed_dims_model), "--dim", bad)
        assert rc == 1 and why in _one_error_line(err), (bad, err)


def test_conformance_shows_progress_on_a_terminal(capsys, monkeypatch):
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    rc, out, err = run_cli(capsys, "conformance", "--pattern", "^test_relu$|^test_abs$")
    assert rc == 0
    assert "\r  2/2 cases, 2 passed" in err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    rc, out, err = run_cli(capsys, "conformance", "--pattern", "^test_relu$")
    assert "cases," not in err  # a log file gets no progress line


# profile --------------------------------------------------------------------------------------


def _table(out: str) -> dict[str, list[str]]:
    """The profile table's rows by op type (the columns after the op type)."""
    lines = out.splitlines()
    start = next(k for k, x in enumerate(lines) if x.split()[:2] == ["op", "type"])
    rows = {}
    for line in lines[start + 1 :]:
        parts = line.split()
        rows[parts[0]] = parts[1:]
        if parts[0] == "total":
            break
    return rows


def test_profile_needs_every_unfixed_dim(capsys, add_model):
    rc, out, err = run_cli(capsys, "profile", str(add_model))
    assert rc == 1
    line = _one_error_line(err)
    assert "--dim" in line and "x:0 ('batch'" in line


def test_profile_prints_a_table_and_writes_html_and_the_trace(capsys, add_model, tmp_path):
    import xml.etree.ElementTree as ET

    html_path, trace_path = tmp_path / "p.html", tmp_path / "t.json"
    rc, out, err = run_cli(
        capsys,
        "profile",
        str(add_model),
        "--dim",
        "batch=4",
        "--runs",
        "3",
        "--html",
        str(html_path),
        "--trace",
        str(trace_path),
    )
    assert rc == 0, err
    assert "feed   x: random, shape [4, 3] float32" in out
    rows = _table(out)
    # per run: nodes, host ms, host %, GPU ms, GPU % (no device provider: no GPU time)
    assert rows["Add"][0] == "1" and rows["Add"][3:] == ["-", "-"]
    assert rows["total"][2] == "100.0%"
    assert "measured by no provider" in out
    events = json.loads(trace_path.read_text())
    assert [e["name"] for e in events].count("model_run") == 5  # 2 warm-up + 3 profiled
    page = html_path.read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"<script|src=|href=|url\(", page)  # nothing loaded from elsewhere
    svgs = re.findall(r"<svg.*?</svg>", page, re.S)
    assert len(svgs) == 2
    for svg in svgs:
        ET.fromstring(svg)  # well-formed
    assert "add_one.onnx" in page and "Add" in svgs[0]


def test_profile_on_a_device_plugin_shows_gpu_time(capsys, virt, relu_neg_model, tmp_path):
    rc, out, err = run_cli(
        capsys,
        "profile",
        str(relu_neg_model),
        "--provider",
        virt.name,
        "--provider",
        "CPUExecutionProvider",
        "--runs",
        "2",
        "--html",
        str(tmp_path / "p.html"),
    )
    assert rc == 0, err
    rows = _table(out)
    assert rows["Relu"][3] != "-" and float(rows["Relu"][3]) >= 0
    assert rows["Neg"][3] == "-"  # a host node
    assert f"measured by {virt.name}" in out
    assert (
        f"{virt.name.removesuffix('ExecutionProvider')} device" in (tmp_path / "p.html").read_text()
    )


def test_profile_png_needs_matplotlib(capsys, add_model, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    rc, out, err = run_cli(
        capsys, "profile", str(add_model), "--dim", "batch=2", "--png", str(tmp_path / "p.png")
    )
    assert rc == 1 and "needs matplotlib" in _one_error_line(err)
    assert not (tmp_path / "p.png").exists() and out == ""


def test_profile_png(capsys, add_model, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    rc, out, err = run_cli(
        capsys, "profile", str(add_model), "--dim", "batch=2", "--runs", "2", "--png", str(png)
    )
    assert rc == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_runs_must_be_positive(capsys, add_model):
    rc, _, err = run_cli(capsys, "profile", str(add_model), "--dim", "batch=2", "--runs", "0")
    assert rc == 1 and "--runs must be at least 1" in _one_error_line(err)
