"""The ``onnxplug`` command: run the bundled demo or any model, profile a model, list providers,
check operator parity and run the ONNX conformance suite.

Every subcommand goes through the public Python API (``onnxplug.InferenceSession`` and the
module-level provider functions), so what the CLI shows is what a user's program gets.
Failures print one line, ``onnxplug: error: ...``, and exit with status 1; ``--traceback``
shows the full Python traceback instead (for bug reports).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

COPY_OPS = ("MemcpyFromHost", "MemcpyToHost")
DEFAULT_RUNS = 10
PROFILE_WARMUP = 2  # the first run records the shape's plan, the second binds the frame
DEMO_RUNS = 100
_MAX_VALUES = 6  # values printed per output
_MAX_OPS_LISTED = 8  # op types listed per provider in the assignment summary


class CliError(Exception):
    """A user error the CLI reports in one line (bad argument, missing file, ...)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line too (argparse prints the usage block first)."""

    def error(self, message: str) -> NoReturn:
        # one line and status 1, like every other error (README: "The onnxplug command")
        self.exit(1, f"onnxplug: error: {message} (see '{self.prog} --help')\n")


# ---------------------------------------------------------------------------------------------
# argument helpers


def _key_value(text: str, what: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise CliError(f"{what} '{text}' must look like name=value")
    return key, value


def provider_entries(
    names: Sequence[str] | None, options: Sequence[str] | None, device_id: int | None = None
) -> list[Any] | None:
    """``--provider``/``--provider-option``/``--device-id`` to InferenceSession's
    ``providers`` argument.

    Without ``--provider`` the session gets every available provider in default priority order
    (accelerators first, CPU last), like onnxruntime's ``get_available_providers()``.
    ``--device-id N`` is the ``device_id`` option of every provider but the CPU's.
    """
    import onnxplug as ox

    chosen = list(names or [])
    if not chosen:
        chosen = ox.get_available_providers()
    opts: dict[str, dict[str, str]] = {n: {} for n in chosen}
    for text in options or []:
        name, sep, kv = text.partition(":")
        if not sep or not name:
            raise CliError(f"--provider-option '{text}' must look like NAME:key=value")
        if name not in opts:
            raise CliError(
                f"--provider-option '{text}' is for {name}, which is not among the session's "
                f"providers {chosen}"
            )
        key, value = _key_value(kv, "--provider-option")
        opts[name][key] = value
    if device_id is not None:
        devices = [n for n in chosen if n != "CPUExecutionProvider"]
        if not devices:
            raise CliError(
                f"--device-id {device_id} needs a provider with devices; the session's "
                f"providers are {chosen}"
            )
        for n in devices:
            given = opts[n].get("device_id")
            if given is not None and given != str(device_id):
                raise CliError(
                    f"--device-id {device_id} and --provider-option {n}:device_id={given} disagree"
                )
            opts[n]["device_id"] = str(device_id)
    return [(n, opts[n]) if opts[n] else n for n in chosen]


def device_lines(sess: Any) -> list[str]:
    """The device each of the session's providers runs on (those with a ``device_id``)."""
    lines = []
    for name, opts in sess.get_provider_options().items():
        if "device_id" in opts and name != "CPUExecutionProvider":
            lines.append(f"device: {name} on device {opts['device_id']}")
    return lines


def _dtype_of(type_str: str) -> np.dtype:
    from onnxplug.ir.types import elem_type_from_name, np_dtype

    if not type_str.startswith("tensor("):
        raise CliError(f"cannot make random data for a {type_str} input; pass it with --input")
    try:
        return np_dtype(elem_type_from_name(type_str))
    except ValueError as e:
        raise CliError(f"cannot make random data for {type_str}: {e}") from None


def concrete_shape(
    name: str,
    shape: Sequence[Any],
    dims: dict[str, int],
    defaulted: list[str] | None = None,
) -> tuple[int, ...]:
    """Declared shape with its unfixed dims (symbolic, unnamed ``?`` or -1) taken from
    ``--dim`` (by symbol ``batch=4`` or by input and axis ``x:0=4``), else 1; each dim that
    fell back to 1 is described in ``defaulted``."""
    out = []
    for axis, d in enumerate(shape):
        by_axis = f"{name}:{axis}"
        if isinstance(d, int) and d >= 0:
            out.append(d)
        elif by_axis in dims:
            out.append(dims[by_axis])
        elif isinstance(d, str) and d in dims:
            out.append(dims[d])
        else:
            out.append(1)
            if defaulted is not None:
                defaulted.append(
                    f"{by_axis} ('{d}': --dim {d}=N or --dim {by_axis}=N)"
                    if isinstance(d, str)
                    else f"{by_axis} (unnamed: --dim {by_axis}=N)"
                )
    return tuple(out)


def _dim_values(dims: Sequence[str] | None, inputs: dict[str, Any]) -> dict[str, int]:
    """``--dim`` values by symbol or by ``input:axis``, each checked against the model."""
    symbols = {d for arg in inputs.values() for d in arg.shape if isinstance(d, str)}
    values: dict[str, int] = {}
    for text in dims or []:
        key, value = _key_value(text, "--dim")
        try:
            values[key] = int(value)
        except ValueError:
            raise CliError(f"--dim '{text}': '{value}' is not an integer") from None
        if values[key] < 0:
            raise CliError(f"--dim '{text}': a dimension cannot be negative")
        name, colon, axis = key.rpartition(":")
        if colon and axis.lstrip("-").isdigit():
            arg = inputs.get(name)
            if arg is None:
                raise CliError(
                    f"--dim '{text}': the model has no input '{name}'; inputs: {list(inputs)}"
                )
            if not -len(arg.shape) <= int(axis) < len(arg.shape):
                raise CliError(f"--dim '{text}': input '{name}' has {len(arg.shape)} axes")
            ax = int(axis) % len(arg.shape)
            if isinstance(arg.shape[ax], int):
                raise CliError(
                    f"--dim '{text}': axis {ax} of input '{name}' is fixed at {arg.shape[ax]}"
                )
            values[f"{name}:{ax}"] = values.pop(key)
        elif key not in symbols:
            raise CliError(
                f"--dim '{text}': the inputs have no dimension named '{key}' (named dims: "
                f"{sorted(symbols) or 'none'}; set an unnamed one with --dim input:axis=N)"
            )
    return values


def random_tensor(dtype: np.dtype, shape: tuple[int, ...], rng: np.random.Generator) -> Any:
    """Random data that most ops accept: small non-negative ints (indices, counts), normal
    floats, random bools, short strings."""
    kind = dtype.kind
    if dtype == np.dtype(object) or kind in "US":
        return np.full(shape, "onnxplug", dtype=object)
    if kind == "b":
        return rng.random(shape) < 0.5
    if kind in "iu":
        return rng.integers(0, 4, size=shape).astype(dtype)
    if kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    # floats, including ml_dtypes (bfloat16, float8, ...): cast from float32
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def make_feeds(
    sess: Any,
    given: Sequence[str] | None,
    dims: Sequence[str] | None,
    seed: int,
    defaulted: list[str] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """Feeds for every model input: ``--input name=file.npy`` or random data. Also returns the
    names that got random data; ``defaulted`` gets the dims that were set to 1."""
    inputs = {i.name: i for i in sess.get_inputs()}
    dim_values = _dim_values(dims, inputs)
    feeds: dict[str, Any] = {}
    for text in given or []:
        name, path = _key_value(text, "--input")
        if name not in inputs:
            raise CliError(
                f"--input '{text}': the model has no input '{name}'; inputs: {list(inputs)}"
            )
        try:
            feeds[name] = np.load(path, allow_pickle=False)
        except FileNotFoundError:
            raise CliError(f"--input '{text}': no such file '{path}'") from None
        except (OSError, ValueError) as e:
            raise CliError(f"--input '{text}': cannot read '{path}' as a .npy file: {e}") from None
    rng = np.random.default_rng(seed)
    generated = []
    for name, arg in inputs.items():
        if name in feeds:
            continue
        shape = concrete_shape(name, arg.shape, dim_values, defaulted)
        feeds[name] = random_tensor(_dtype_of(arg.type), shape, rng)
        generated.append(name)
    return feeds, generated


# ---------------------------------------------------------------------------------------------
# printing helpers


def format_values(value: Any) -> str:
    """Shape, dtype and the first few values of an output."""
    if isinstance(value, np.ndarray):
        flat = value.reshape(-1)
        head = flat[:_MAX_VALUES]
        if value.dtype.kind in "fc":
            shown = np.array2string(np.asarray(head), precision=4, separator=", ")
        else:
            shown = "[" + ", ".join(str(x) for x in head) + "]"
        if flat.size > _MAX_VALUES:
            shown = shown[:-1] + f", ... ({flat.size} values)]"
        return f"shape {list(value.shape)} {value.dtype}: {shown}"
    if isinstance(value, list):
        return f"sequence of {len(value)}" + (
            f", first: {format_values(value[0])}" if value else ""
        )
    if isinstance(value, dict):
        return f"map of {len(value)} entries"
    return repr(value)


def assignment_summary(sess: Any) -> list[str]:
    """Per-provider node counts (with the most frequent op types) and the copy nodes."""
    info = sess.get_provider_graph_assignment_info()
    per_ep: dict[str, Counter[str]] = {}
    copies: Counter[tuple[str, str]] = Counter()
    for rec in info:
        if rec["op_type"] in COPY_OPS:
            copies[(rec["ep"], rec["op_type"])] += 1
            continue
        per_ep.setdefault(rec["ep"], Counter())[rec["op_type"]] += 1
    n_nodes = sum(sum(c.values()) for c in per_ep.values())
    lines = [f"node assignment ({n_nodes} nodes, {sum(copies.values())} copy nodes):"]
    width = max((len(ep) for ep in per_ep), default=0)
    for ep, ops in per_ep.items():
        top = ops.most_common(_MAX_OPS_LISTED)
        listed = ", ".join(f"{op} {k}" for op, k in top)
        if len(ops) > len(top):
            listed += f", +{len(ops) - len(top)} more op types"
        lines.append(f"  {ep:<{width}}  {sum(ops.values()):>5} nodes  ({listed})")
    if copies:
        for (ep, op), k in sorted(copies.items()):
            lines.append(f"  copies: {k} x {op} on {ep}")
    else:
        lines.append("  copies: none (no device boundary in the graph)")
    return lines


def time_runs(sess: Any, feeds: dict[str, Any], runs: int) -> tuple[list[Any], float, list[float]]:
    """(outputs of the first run, first-run ms, ms of each of ``runs`` further runs).

    The first run of a shape signature also records its plan (folded shape values, memory
    plan), so it is reported apart from the steady state.
    """
    t0 = time.perf_counter()
    outs = sess.run(None, feeds)
    first = (time.perf_counter() - t0) * 1e3
    return outs, first, wall_times(sess, feeds, runs)


def wall_times(sess: Any, feeds: dict[str, Any], runs: int) -> list[float]:
    """Wall ms of each of ``runs`` runs."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def latency_line(first: float, times: list[float]) -> str:
    if not times:
        return f"latency: first run {first:.3f} ms"
    a = np.asarray(times)
    return (
        f"latency: first run {first:.3f} ms; over {len(times)} runs median "
        f"{np.median(a):.3f} ms, p90 {np.percentile(a, 90):.3f} ms, min {a.min():.3f} ms"
    )


def _bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def memory_lines(sess: Any) -> list[str]:
    """Peak and current device memory of the session's allocators (``--memory``)."""
    stats = sess.get_allocator_stats()
    if not stats:
        return ["memory: no device allocators (host tensors are numpy arrays)"]
    lines = ["memory (a device's arena is shared by every session on it):"]
    width = max(len(d) for d in stats)
    for dev, st in stats.items():
        parts = [
            f"peak {_bytes(st.get('MaxInUse', 0))} in use",
            f"{_bytes(st.get('InUse', 0))} in use now",
        ]
        if "TotalAllocated" in st:
            parts.append(f"{_bytes(st['TotalAllocated'])} held")
        limit = st.get("Limit")
        if limit is not None:
            parts.append("no limit" if limit >= (1 << 63) - 1 else f"limit {_bytes(limit)}")
        parts.append(f"{st.get('NumAllocs', 0)} allocations")
        if "NumArenaExtensions" in st:
            parts.append(f"{st['NumArenaExtensions']} arena regions")
        if st.get("NumArenaShrinkages"):
            parts.append(f"{st['NumArenaShrinkages']} regions given back")
        lines.append(f"  {dev:<{width}}  " + ", ".join(parts))
    return lines


def memory_plot(sess: Any, feeds: dict[str, Any], path: Path) -> str:
    """Record the device memory in use over one more run, draw it to ``path`` (PNG)."""
    from onnxplug.tools.plot import COLOR_NAMES, step_chart_png

    with sess.record_memory_usage() as usage:
        sess.run(None, feeds)
    if not usage:
        return "memory plot: not written, the session has no device arena to record"
    series = [[(t * 1e3, n / (1 << 20)) for t, n in points] for points in usage.values()]
    path.write_bytes(step_chart_png(series))
    ms = max(x for s in series for x, _ in s)
    mib = max(y for s in series for _, y in s)
    legend = ", ".join(f"{dev} {COLOR_NAMES[k % len(COLOR_NAMES)]}" for k, dev in enumerate(usage))
    return (
        f"memory plot: {path} (device memory in use during one run: x 0-{ms:.2f} ms, "
        f"y 0-{mib:.2f} MiB; {legend})"
    )


def _shape_str(shape: Sequence[Any]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _io_lines(sess: Any) -> list[str]:
    lines = []
    for i in sess.get_inputs():
        lines.append(f"  input  {i.name}: {i.type} {_shape_str(i.shape)}")
    for o in sess.get_outputs():
        lines.append(f"  output {o.name}: {o.type} {_shape_str(o.shape)}")
    return lines


def _session(model: Any, providers: list[Any] | None) -> Any:
    import onnxplug as ox

    # a provider named on the command line that cannot be used is an error, not a warning:
    # the numbers printed must be those of the providers asked for
    so = ox.SessionOptions()
    so.add_session_config_entry("session.strict_providers", "1")
    return ox.InferenceSession(model, so, providers=providers)


# ---------------------------------------------------------------------------------------------
# subcommands


def demo_model_path() -> Path:
    """The demo model shipped in the package (built by scripts/make_demo_model.py)."""
    path = Path(str(resources.files("onnxplug") / "data" / "demo.onnx"))
    if not path.is_file():
        raise CliError(f"the demo model is missing from this installation ({path})")
    return path


def demo_reference(model_path: Path, image: np.ndarray) -> np.ndarray:
    """The demo CNN in plain numpy, to check the runtime's answer independently."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(model_path))
    w = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in m.graph.initializer}
    x = np.pad(image.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    n, _, h, wd = image.shape
    # 3x3 convolution as a sum of shifted windows (1 input channel)
    conv = np.zeros((n, w["conv_w"].shape[0], h, wd))
    for dy in range(3):
        for dx in range(3):
            window = x[:, 0, dy : dy + h, dx : dx + wd]
            conv += w["conv_w"][None, :, 0, dy, dx, None, None] * window[:, None]
    conv += w["conv_b"][None, :, None, None]
    relu = np.maximum(conv, 0)
    pool = relu.reshape(n, -1, h // 2, 2, wd // 2, 2).max(axis=(3, 5))
    logits = pool.reshape(n, -1) @ w["fc_w"] + w["fc_b"]
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def cmd_demo(args: argparse.Namespace) -> int:
    import onnxplug as ox

    path = demo_model_path()
    providers = provider_entries(args.provider, args.provider_option, args.device_id)
    sess = _session(path, providers)
    print(f"onnxplug {ox.__version__} demo: {path.name}, a tiny CNN classifying 8x8 images")
    print(f"providers: {sess.get_providers()}")
    for line in device_lines(sess):
        print(line)
    print("model:")
    for line in _io_lines(sess):
        print(line)
    rng = np.random.default_rng(args.seed)
    image = rng.standard_normal((args.batch, 1, 8, 8)).astype(np.float32)
    outs, first, times = time_runs(sess, {"image": image}, args.runs)
    probs = outs[0]
    print(f"ran with image {list(image.shape)} float32 -> probabilities {list(probs.shape)}:")
    for b in range(min(probs.shape[0], 4)):
        top = int(np.argmax(probs[b]))
        print(f"  image {b}: class {top} (p={probs[b, top]:.4f}); {format_values(probs[b])}")
    ref = demo_reference(path, image)
    err = float(np.max(np.abs(probs.astype(np.float64) - ref)))
    ok = err < 1e-4
    print(
        f"check against a numpy reference: max abs difference {err:.2e} ({'ok' if ok else 'MISMATCH'})"
    )
    for line in assignment_summary(sess):
        print(line)
    print(latency_line(first, times))
    if not ok:
        raise CliError(f"the demo's output differs from the numpy reference by {err:.2e}")
    return 0


def _safe_file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "output"


def cmd_run(args: argparse.Namespace) -> int:
    model = Path(args.model)
    if not model.exists():
        raise CliError(f"no such model file: {model}")
    providers = provider_entries(args.provider, args.provider_option, args.device_id)
    sess = _session(model, providers)
    print(f"model: {model}")
    print(f"providers: {sess.get_providers()}")
    for line in device_lines(sess):
        print(line)
    for line in _io_lines(sess):
        print(line)
    defaulted: list[str] = []
    feeds, generated = make_feeds(sess, args.input, args.dim, args.seed, defaulted)
    for name, value in feeds.items():
        how = "random" if name in generated else "from file"
        shape = list(getattr(value, "shape", ()))
        print(f"  feed   {name}: {how}, shape {shape} {getattr(value, 'dtype', '')}")
    if defaulted:
        print(f"dims not given, set to 1: {'; '.join(defaulted)}")
    outs, first, times = time_runs(sess, feeds, args.runs)
    print("outputs:")
    names = [o.name for o in sess.get_outputs()]
    for name, value in zip(names, outs):
        print(f"  {name}: {format_values(value)}")
    for line in assignment_summary(sess):
        print(line)
    print(latency_line(first, times))
    if args.memory:
        for line in memory_lines(sess):
            print(line)
    if args.memory_plot:
        print(memory_plot(sess, feeds, Path(args.memory_plot)))
    if args.output_dir:
        out_dir = Path(args.output_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, value in zip(names, outs):
            if not isinstance(value, np.ndarray):
                print(f"  not saved: {name} is not a tensor")
                continue
            target = out_dir / f"{_safe_file_name(name)}.npy"
            np.save(target, value, allow_pickle=value.dtype == object)
            print(f"  saved {name} -> {target}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Run a model with random inputs under the profiler; the table by op type, and charts."""
    import json
    import shutil
    import tempfile

    import onnxplug as ox
    from onnxplug.tools.profile_report import (
        format_table,
        html_report,
        op_table,
        png_report,
        runs_of,
    )

    model = Path(args.model)
    if not model.exists():
        raise CliError(f"no such model file: {model}")
    if args.runs < 1:
        raise CliError(f"--runs must be at least 1 for a profile, got {args.runs}")
    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CliError(
                f"--png {args.png} needs matplotlib (pip install matplotlib); --html writes "
                "the same charts without it"
            ) from None
    providers = provider_entries(args.provider, args.provider_option, args.device_id)
    with tempfile.TemporaryDirectory(prefix="onnxplug-profile-") as tmp:
        so = ox.SessionOptions()
        so.add_session_config_entry("session.strict_providers", "1")
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(tmp) / "onnxplug_profile")
        sess = ox.InferenceSession(model, so, providers=providers)
        try:
            defaulted: list[str] = []
            feeds, generated = make_feeds(sess, args.input, args.dim, args.seed, defaulted)
            if defaulted:
                raise CliError(
                    "a profile runs the model at the sizes you choose: give the unfixed input "
                    f"dimensions a size with --dim: {'; '.join(defaulted)}"
                )
            print(f"model: {model}")
            print(f"providers: {sess.get_providers()}")
            for name, value in feeds.items():
                how = "random" if name in generated else "from file"
                shape = list(getattr(value, "shape", ()))
                print(f"  feed   {name}: {how}, shape {shape} {getattr(value, 'dtype', '')}")
            for _ in range(PROFILE_WARMUP):
                sess.run(None, feeds)
            times = wall_times(sess, feeds, args.runs)
        finally:
            trace = sess.end_profiling()  # written into the folder before it goes
        events = json.loads(Path(trace).read_text())
        if args.trace:
            shutil.copyfile(trace, args.trace)
    runs = runs_of(events)[-args.runs :]
    rows = op_table(runs)
    timed = sorted({e["args"].get("provider", "") for r in runs for e in r.kernels})
    a = np.asarray(times)
    facts = [
        f"model {model.name}, providers {sess.get_providers()}",
        f"{args.runs} profiled runs after {PROFILE_WARMUP} warm-up runs: median "
        f"{np.median(a):.3f} ms, min {a.min():.3f} ms per run (wall time, profiling on)",
        "GPU ms: device time of each node on its stream, measured by "
        + (", ".join(timed) if timed else "no provider (host providers only)"),
    ]
    print(f"profiled {args.runs} runs after {PROFILE_WARMUP} warm-up runs (per run):")
    for line in format_table(rows):
        print(line)
    for f in facts[1:]:
        print(f)
    if args.trace:
        print(f"trace (onnxruntime's format, chrome://tracing or ui.perfetto.dev): {args.trace}")
    title = f"onnxplug profile: {model.name}"
    if args.html:
        Path(args.html).write_text(html_report(title, facts, rows, runs[-1]), encoding="utf-8")
        print(f"html report: {args.html}")
    if args.png:
        png_report(args.png, title, rows, runs[-1])
        print(f"png chart: {args.png}")
    return 0


def cmd_conformance(args: argparse.Namespace) -> int:
    from onnxplug.tools.conformance import main_run

    providers = provider_entries(
        args.provider or ["CPUExecutionProvider"], args.provider_option, args.device_id
    )
    if args.pattern:
        try:
            re.compile(args.pattern)
        except re.error as e:
            raise CliError(
                f"--pattern '{args.pattern}' is not a valid regular expression: {e}"
            ) from None
    assert providers is not None
    kwargs: dict[str, Any] = {"check": True} if args.check else {}
    if args.repeat != 1:
        if args.repeat < 1:
            raise CliError(f"--repeat must be at least 1, not {args.repeat}")
        kwargs["repeats"] = args.repeat
    return int(
        main_run(
            providers=providers,
            pattern=args.pattern,
            json_path=args.json,
            verbose=args.verbose,
            **kwargs,
        )
        or 0
    )


def _kv(d: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(d.items())) or "-"


def cmd_providers(args: argparse.Namespace) -> int:
    import onnxplug as ox
    from onnxplug.ep.loader import REGISTRY

    print(f"onnxplug {ox.__version__}, plugin API version {ox.API_VERSION}")
    print(f"available providers: {', '.join(ox.get_available_providers()) or '(none)'}")
    print("plugins:")
    for lib in REGISTRY.libraries():
        if lib.factory is not None:
            f = lib.factory
            state = f"loaded, {len(lib.devices)} device(s)"
            if not lib.devices and f.unavailable_reason():
                state += f" ({f.unavailable_reason()})"
            detail = f"{f.vendor or '-'} {f.version}, plugin API {f.api_version}"
            print(f"  {lib.name}: {state}; {detail}; from {lib.source} {lib.target}")
        else:
            print(f"  {lib.name}: failed to load; from {lib.source} {lib.target}")
    print("EP devices:")
    devices = [d.ep_device for d in ox.get_ep_devices()]
    if not devices:
        print("  (none)")
    for d in devices:
        hw = d.device
        print(
            f"  {d.ep_name} ({d.ep_vendor}) on {hw.type}:{hw.device_id} ({hw.vendor or 'unknown vendor'})"
        )
        mem = d.memory_info
        print(f"    memory: {mem.name} on {mem.device}")
        print(f"    device metadata: {_kv(dict(hw.metadata))}")
        print(f"    ep metadata: {_kv(d.ep_metadata)}")
        print(f"    ep options: {_kv(d.ep_options)}")
    errors = ox.get_provider_load_errors()
    print("plugins that failed to load:" + ("" if errors else " none"))
    for name, why in errors.items():
        print(f"  {name}: {' '.join(why.split())}")
    return 0


def cmd_parity(args: argparse.Namespace) -> int:
    import json

    from onnxplug.tools.parity import format_report, provider_parity

    try:
        results = provider_parity(args.provider, args.domain)
    except KeyError as e:
        raise CliError(str(e.args[0]) if e.args else str(e)) from None
    if not results:
        raise CliError("no execution provider is loaded")
    for k, pp in enumerate(results):
        if k:
            print()
        print(format_report(pp, gaps_only=args.gaps))
    if args.json:
        Path(args.json).write_text(json.dumps([pp.to_dict() for pp in results], indent=1))
        print(f"wrote {args.json}")
    return 1 if any(pp.error for pp in results) else 0


# ---------------------------------------------------------------------------------------------
# parser and entry point


def _add_provider_args(p: argparse.ArgumentParser, help_default: str) -> None:
    p.add_argument(
        "--provider",
        action="append",
        metavar="NAME",
        help=f"execution provider, in priority order (repeatable; default: {help_default})",
    )
    p.add_argument(
        "--provider-option",
        action="append",
        metavar="NAME:key=value",
        help="an option for provider NAME (repeatable)",
    )
    p.add_argument(
        "--device-id",
        type=int,
        metavar="N",
        help="the device of every provider but the CPU's (their device_id option; "
        "'onnxplug providers' lists the devices)",
    )


def _add_model_args(p: argparse.ArgumentParser, dims: str, runs: str) -> None:
    """The model, its providers and feeds (``--input``, ``--dim``: ``dims`` says what an
    unfixed dim without one gets), ``--runs`` (``runs``: what they are) and ``--seed``."""
    p.add_argument("model", help="path of an .onnx model")
    _add_provider_args(p, "all available")
    p.add_argument(
        "--input",
        action="append",
        metavar="name=file.npy",
        help="feed input 'name' from a .npy file (repeatable); others get random data",
    )
    p.add_argument(
        "--dim",
        action="append",
        metavar="name=value|input:axis=value",
        help="size of an unfixed dimension of random inputs, by its name (batch=4) or by input "
        f"and axis (x:0=4, also for unnamed and -1 dims); {dims} (repeatable)",
    )
    p.add_argument("--runs", type=int, default=DEFAULT_RUNS, help=runs)
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")


def build_parser() -> argparse.ArgumentParser:
    import onnxplug as ox

    parser = _Parser(
        prog="onnxplug",
        description="onnxplug: an ONNX runtime with plugin execution providers",
    )
    parser.add_argument("--version", action="version", version=f"onnxplug {ox.__version__}")
    parser.add_argument(
        "--traceback", action="store_true", help="on an error, show the Python traceback"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("demo", help="run the small model shipped with onnxplug")
    _add_provider_args(p, "all available")
    p.add_argument("--runs", type=int, default=DEMO_RUNS, help=f"timed runs (default {DEMO_RUNS})")
    p.add_argument("--batch", type=int, default=2, help="images per run (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random images")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("run", help="run a model on given or random inputs and time it")
    _add_model_args(p, "default 1", f"timed runs after the first (default {DEFAULT_RUNS})")
    p.add_argument("--output-dir", metavar="DIR", help="save each output as DIR/<name>.npy")
    p.add_argument(
        "--memory",
        action="store_true",
        help="print peak and in-use device memory of the session's allocators",
    )
    p.add_argument(
        "--memory-plot",
        metavar="FILE.png",
        help="draw the device memory in use over one more run to a PNG file",
    )
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "profile", help="profile a model: host and GPU time by op type, timeline charts"
    )
    _add_model_args(
        p,
        "required for each",
        f"profiled runs after {PROFILE_WARMUP} warm-up runs (default {DEFAULT_RUNS})",
    )
    p.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    p.add_argument("--png", metavar="FILE", help="draw the charts to a PNG (needs matplotlib)")
    p.add_argument("--trace", metavar="FILE", help="keep the trace (onnxruntime's JSON format)")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("conformance", help="run the ONNX backend node test suite")
    _add_provider_args(p, "CPUExecutionProvider")
    p.add_argument("--pattern", metavar="REGEX", help="only cases whose name matches REGEX")
    p.add_argument("--json", metavar="FILE", help="write every case's result to FILE")
    p.add_argument("-v", "--verbose", action="store_true", help="list the cases that did not pass")
    p.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when CPU results contradict the checked-in expected-failure list",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run every case N times on its session (recording, prepared, steady runs)",
    )
    p.set_defaults(func=cmd_conformance)

    p = sub.add_parser("providers", help="list providers, EP devices and plugin load errors")
    p.set_defaults(func=cmd_providers)

    p = sub.add_parser("parity", help="ONNX op/opset coverage of each provider's kernels")
    p.add_argument(
        "--provider", action="append", metavar="NAME", help="only this provider (repeatable)"
    )
    p.add_argument(
        "--domain", default="", help="operator domain (default: the default domain, ai.onnx)"
    )
    p.add_argument("--gaps", action="store_true", help="list only ops that are not fully covered")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    p.set_defaults(func=cmd_parity)
    return parser


def _validate(args: argparse.Namespace) -> None:
    for attr in ("runs", "batch"):
        v = getattr(args, attr, None)
        if v is not None and v < (1 if attr == "batch" else 0):
            raise CliError(f"--{attr} must be {'positive' if attr == 'batch' else '>= 0'}, got {v}")


def error_line(e: BaseException) -> str:
    """One line naming what went wrong."""
    from onnxplug.errors import OnnxPlugError

    if isinstance(e, CliError):
        msg = str(e)
    elif isinstance(e, OnnxPlugError):
        msg = f"{e.status}: {e.message}"
    else:
        msg = f"{type(e).__name__}: {e}"
    return "onnxplug: error: " + " ".join(msg.split())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        _validate(args)
        return int(args.func(args))
    except KeyboardInterrupt:
        print("onnxplug: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.traceback:
            raise
        print(error_line(e), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
