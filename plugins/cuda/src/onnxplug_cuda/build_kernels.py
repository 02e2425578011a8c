"""Compile the plugin's shipped kernels: every source the kernel families list with
``compiler.ship`` (those that do not depend on the model), for one or more GPU architectures,
into ``shipped_kernels/sm_<arch>/<digest>.cubin`` beside the compiler (see its docstring).

    python -m onnxplug_cuda.build_kernels [--arch native|90,80] [--jobs N] [--out DIR]

Run once after installing the plugin (``scripts/gpu-session.sh`` does; a release wheel would be
built after it). ``native`` (the default) is the architecture of each visible GPU; for those
GPUs it also has the driver compile cuDNN's fused-attention kernels into its JIT cache
(``warm_attention``), which a machine's first float16 attention would otherwise wait for. A folder
ends up holding exactly the catalogue: cubins of sources no longer listed are removed. A kernel
that does not compile for an architecture (tensor-core code below sm_80) is left out there and
reported; the run never selects it on that architecture.

The options are those CuPy's ``RawModule`` gives NVRTC for our ``compiler.OPTIONS`` (its
include folders, ``-ftz=true``, ``--device-as-default-execution-space``), so that a shipped
kernel is the one the run would compile.
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

from . import compiler


def nvrtc_options(arch: str) -> list[str]:
    """NVRTC's options for ``arch`` ("sm_90"), as CuPy's ``RawModule`` compiles our kernels."""
    from cupy._core.core import assemble_cupy_compiler_options

    return [
        *assemble_cupy_compiler_options(compiler.OPTIONS),
        "-ftz=true",
        f"-arch={arch}",
        "--device-as-default-execution-space",
    ]


def nvrtc_compile(text: str, name: str, options: Sequence[str]) -> bytes:
    """The cubin NVRTC builds of ``text``; a compile error raises with NVRTC's log."""
    from cuda.bindings import nvrtc

    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    err, prog = nvrtc.nvrtcCreateProgram(text.encode(), f"{name}.cu".encode(), 0, [], [])
    if err != ok:
        raise RuntimeError(f"nvrtcCreateProgram: {err}")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        if err != ok:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(log.decode(errors="replace").strip())
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        image = b" " * size
        nvrtc.nvrtcGetCUBIN(prog, image)
        return image
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def native_devices() -> dict[str, int]:
    """The architecture of each visible GPU ("sm_90"), each once, with its first device."""
    import cupy

    devices: dict[str, int] = {}
    for d in range(cupy.cuda.runtime.getDeviceCount()):
        devices.setdefault("sm_" + str(cupy.cuda.Device(d).compute_capability), d)
    return devices


def warm_attention(devices: dict[str, int], jobs: int) -> None:
    """cuDNN's fused-attention kernels compiled into the driver's JIT cache: one graph of each
    kind of ``dnn.ATTENTION_KINDS`` built on the first GPU of each architecture, in spawned
    processes (the frontend holds the interpreter lock while it builds). Reported, never
    fatal: without the cuDNN frontend, or with the cache turned off, a machine's first
    float16 attention compiles them in its first run instead."""
    if not devices:  # a build for other machines (--arch): their drivers compile their own
        return
    if os.environ.get("CUDA_CACHE_DISABLE", "0") not in ("", "0"):
        print("build_kernels: CUDA_CACHE_DISABLE is set: cuDNN's attention kernels not cached")
        return
    try:
        from . import dnn

        dnn.import_cudnn()
    except ImportError as e:
        print(f"build_kernels: cuDNN frontend not importable ({e}): attention kernels not cached")
        return
    kinds = dnn.ATTENTION_KINDS
    for arch, ordinal in devices.items():
        start = time.perf_counter()
        # a CUDA context per worker: a few, not one per core
        with _pool(True, min(jobs, 4)) as pool:
            futures = [pool.submit(dnn.build_attention_kind, ordinal, *kind) for kind in kinds]
            failed = [(kind, f.exception()) for kind, f in zip(kinds, futures) if f.exception()]
        took = time.perf_counter() - start
        print(
            f"build_kernels: {arch}: {len(kinds) - len(failed)} of {len(kinds)} kinds of "
            f"cuDNN fused attention in the driver's JIT cache in {took:.1f} s"
        )
        for kind, error in failed:
            print(f"  left out {kind}: {(str(error).strip().splitlines() or [''])[0]}")


def _import_families() -> None:
    """Import every kernel module: each family lists its kernels with ``compiler.ship`` when
    imported (the provider imports them when it builds its registry)."""
    from .kernels import kernel_modules

    for name in ("_fused", *kernel_modules()):
        importlib.import_module(f"{__package__}.kernels.{name}")


def _pool(nvrtc: bool, jobs: int) -> Executor:
    """Workers for the compiles: NVRTC in processes (on threads, which it allows, its compiles
    scaled about 2x on a 16-core H100 host, and the catalogue holds about a thousand kernels),
    started fresh (``spawn``: this process has initialised CUDA); a given ``compile_fn`` on
    threads."""
    if nvrtc:
        return ProcessPoolExecutor(max(1, jobs), mp_context=multiprocessing.get_context("spawn"))
    return ThreadPoolExecutor(max(1, jobs))


def build(
    archs: Sequence[str],
    out: Path,
    jobs: int,
    compile_fn: Callable[[str, str, str], bytes] | None = None,
) -> dict[str, list[tuple[str, str]]]:
    """Compile the catalogue for each of ``archs`` into ``out/<arch>/``; remove what the
    catalogue no longer lists. ``compile_fn(text, name, arch)`` defaults to NVRTC. Returns, per
    architecture, the (kernel name, first line of the error) of the kernels left out."""
    _import_families()
    options: dict[str, list[str]] = {}
    if compile_fn is None:
        options = {a: nvrtc_options(a) for a in archs}
    catalogue = list(compiler.shipped_sources())
    left_out: dict[str, list[tuple[str, str]]] = {}
    for arch in archs:
        folder = out / arch
        folder.mkdir(parents=True, exist_ok=True)
        todo = [item for item in catalogue if not (folder / f"{item[0]}.cubin").exists()]
        errors: list[tuple[str, str]] = []
        with _pool(compile_fn is None, jobs) as pool:
            futures = [
                pool.submit(nvrtc_compile, text, name, options[arch])
                if compile_fn is None
                else pool.submit(compile_fn, text, name, arch)
                for _, name, text in todo
            ]
            for (digest, name, _), fut in zip(todo, futures):
                try:
                    image = fut.result()
                except Exception as e:
                    errors.append((name, (str(e).strip().splitlines() or [""])[0]))
                    continue
                path = folder / f"{digest}.cubin"
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_bytes(image)
                os.replace(tmp, path)  # a reader never sees half a cubin
        listed = {f"{digest}.cubin" for digest, _, _ in catalogue}
        for path in folder.iterdir():
            if path.name not in listed:
                path.unlink()
        left_out[arch] = errors
    return left_out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m onnxplug_cuda.build_kernels")
    parser.add_argument("--arch", default="native", help="native, or e.g. 90,80")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=compiler.SHIPPED_DIR)
    args = parser.parse_args(argv)
    devices: dict[str, int] = {}
    if args.arch == "native":
        devices = native_devices()
        archs = list(devices)
    else:
        archs = ["sm_" + a.strip().removeprefix("sm_") for a in args.arch.split(",") if a.strip()]
    if not archs:
        print("build_kernels: no GPU and no --arch: nothing to build", file=sys.stderr)
        return 1
    start = time.perf_counter()
    left_out = build(archs, args.out, args.jobs)
    n = sum(1 for _ in compiler.shipped_sources())
    for arch, errors in left_out.items():
        print(f"build_kernels: {arch}: {n - len(errors)} of {n} kernels in {args.out / arch}")
        for name, error in errors:
            print(f"  left out {name}: {error}")
    warm_attention(devices, args.jobs)  # only for the GPUs of this machine (--arch native)
    print(f"build_kernels: {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
