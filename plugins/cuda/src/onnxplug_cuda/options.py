"""The CUDA provider's options: one table of keys, defaults and validation rules.

Options arrive as session config entries. For each key the first entry present wins, in
onnxruntime's order: ``ep.<lowercased provider name>.<key>`` (what ``providers=[(name, {...})]``
and ``add_provider_for_devices`` write), then the legacy ``ep.cuda.<key>``, then the flat
``<key>``; aliases (e.g. ``cudnn_conv_algo``) are looked up the same way. A malformed value
is an error naming the key and the accepted values — stricter than onnxruntime, which logs
and keeps the default.

Arena options (``arena.*``, see ``ARENA_KEYS``) come from ``ep.<name>.arena.*`` or
``ep.cuda.arena.*``; ``gpu_mem_limit`` and ``arena_extend_strategy`` are the device arena's
``arena.max_mem`` and ``arena.extend_strategy`` (an ``arena.*`` key wins over them, as
onnxruntime's ``default_memory_arena_cfg`` does). They configure the shared device arena when
a session creates it (see factory.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from onnxplug.ep import ARENA_OPTIONS, ArenaConfig, InvalidArgument, parse_byte_count

SIZE_MAX = (1 << 64) - 1


def _bool(key: str, v: str) -> bool:
    s = v.strip().lower()
    if s in ("1", "true"):
        return True
    if s in ("0", "false"):
        return False
    raise InvalidArgument(
        f"CUDA provider option {key}: '{v}' is not a boolean; use 0, 1, true or false"
    )


def _int(lo: int | None = None, hi: int | None = None) -> Callable[[str, str], int]:
    def parse(key: str, v: str) -> int:
        try:
            n = int(v.strip(), 0)
        except ValueError:
            raise InvalidArgument(f"CUDA provider option {key}: '{v}' is not an integer") from None
        if (lo is not None and n < lo) or (hi is not None and n > hi):
            rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
            raise InvalidArgument(f"CUDA provider option {key}: {n} is outside {rng}")
        return n

    return parse


def _enum(names: Mapping[str, int]) -> Callable[[str, str], int]:
    def parse(key: str, v: str) -> int:
        s = v.strip()
        for name, num in names.items():
            if s.lower() == name.lower() or s == str(num):
                return num
        accepted = ", ".join(f"{n} ({i})" for n, i in names.items())
        raise InvalidArgument(f"CUDA provider option {key}: '{v}' is not one of {accepted}")

    return parse


def _text(key: str, v: str) -> str:
    return str(v)


def _pointer(key: str, v: str) -> int:
    try:
        n = int(v.strip(), 0)
    except ValueError:
        raise InvalidArgument(
            f"CUDA provider option {key}: '{v}' is not an address (a decimal or 0x integer)"
        ) from None
    if n < 0:
        raise InvalidArgument(f"CUDA provider option {key}: an address cannot be negative")
    return n


def _mem_limit(key: str, v: str) -> int:
    s = v.strip()
    if s.startswith("-"):
        raise InvalidArgument(f"CUDA provider option {key}: a memory limit cannot be negative")
    n = _int(0, SIZE_MAX)(key, s)
    return SIZE_MAX if n == 0 else n  # onnxruntime treats 0 as unlimited


# Session options whose values may be Python objects, not strings: the external allocator's
# callbacks may be callables, the user's stream an object with ``__cuda_stream__``.
OBJECT_KEYS = frozenset({"gpu_external_alloc", "gpu_external_free", "gpu_external_empty_cache"})
STREAM_KEY = "user_compute_stream"


def stream_handle(label: str, obj: Any) -> int:
    """The ``cudaStream_t`` of an object implementing the CUDA stream protocol
    (``__cuda_stream__() -> (version, handle)``: torch.cuda.Stream, CuPy and cuda.core
    streams)."""
    try:
        got = obj.__cuda_stream__()
        version, handle = got
        handle = int(handle)
    except Exception as e:
        raise InvalidArgument(
            f"CUDA provider option {label}: {type(obj).__name__}.__cuda_stream__() must return "
            f"(version, stream handle) ({type(e).__name__}: {e})"
        ) from None
    if handle < 0:
        raise InvalidArgument(f"CUDA provider option {label}: a stream handle cannot be negative")
    return handle


CONV_ALGO_SEARCH = {"EXHAUSTIVE": 0, "HEURISTIC": 1, "DEFAULT": 2}
ARENA_EXTEND_STRATEGY = {"kNextPowerOfTwo": 0, "kSameAsRequested": 1}
SDPA_KERNEL_BITS = (
    511  # FLASH 1 | EFFICIENT 2 | TRT_FUSED 4 | CUDNN_FLASH 8 | MATH 16 | TRT_* 32..128 | LEAN 256
)


@dataclass(frozen=True)
class OptionSpec:
    key: str
    parse: Callable[[str, str], Any]
    default: Any
    aliases: tuple[str, ...] = ()
    flat: bool = True  # also accept the bare key (not only ep.<name>. / ep.cuda.)
    doc: str = ""


SPECS: tuple[OptionSpec, ...] = (
    OptionSpec("device_id", _int(0), 0, doc="CUDA device ordinal (selects the EP device)"),
    OptionSpec(
        "gpu_mem_limit",
        _mem_limit,
        SIZE_MAX,
        aliases=("cuda_mem_limit",),
        doc="device arena limit in bytes",
    ),
    OptionSpec(
        "arena_extend_strategy", _enum(ARENA_EXTEND_STRATEGY), 0, doc="how the device arena grows"
    ),
    OptionSpec(
        "cudnn_conv_algo_search",
        _enum(CONV_ALGO_SEARCH),
        0,
        aliases=("cudnn_conv_algo",),
        doc="cuDNN conv (and float16 fused attention) plan search",
    ),
    OptionSpec("do_copy_in_default_stream", _bool, True, doc="copies on the compute stream"),
    OptionSpec(
        "cudnn_conv_use_max_workspace", _bool, True, doc="let cuDNN use the largest workspace"
    ),
    OptionSpec("cudnn_conv1d_pad_to_nc1d", _bool, False, doc="pad 1-D conv input to [N,C,1,D]"),
    OptionSpec("enable_cuda_graph", _bool, False, doc="capture and replay CUDA graphs"),
    OptionSpec("enable_skip_layer_norm_strict_mode", _bool, False, doc="SkipLayerNorm strict mode"),
    OptionSpec(
        # onnxplug's default is 1 (onnxruntime's 0): channels-last convolutions measured
        # faster in every ResNet-50 row on the H100 (b1 fp32 0.72 vs 0.93 ms, b32 fp16 1.94 vs
        # 2.70 ms, IOBinding + graph); the layout is internal, inputs and outputs stay NCHW
        "prefer_nhwc",
        _bool,
        True,
        aliases=("prefer_nhwc_layout",),
        doc="prefer NHWC layout",
    ),
    OptionSpec("use_ep_level_unified_stream", _bool, False, doc="one stream for every run"),
    OptionSpec("use_tf32", _bool, True, doc="allow TF32 math for float32"),
    OptionSpec("fuse_conv_bias", _bool, False, doc="fuse Conv+bias(+activation) in cuDNN"),
    OptionSpec(
        "tuning_cache_dir",
        _text,
        "",
        doc="folder of the on-disk autotune cache ('off': none; default $ONNXPLUG_CACHE_DIR)",
    ),
    OptionSpec("sdpa_kernel", _int(0, SDPA_KERNEL_BITS), 0, doc="attention backend bitmask"),
    OptionSpec(
        "has_user_compute_stream",
        _bool,
        False,
        doc="user_compute_stream is set (0 is a valid stream)",
    ),
    OptionSpec(
        "user_compute_stream",
        _pointer,
        0,
        doc="run on this cudaStream_t (an address, or an object with __cuda_stream__)",
    ),
    OptionSpec("gpu_external_alloc", _pointer, 0, doc="external allocator: alloc(size) -> address"),
    OptionSpec("gpu_external_free", _pointer, 0, doc="external allocator: free(address)"),
    OptionSpec("gpu_external_empty_cache", _pointer, 0, doc="external allocator: empty_cache()"),
    OptionSpec(
        "enable_cudnn", _bool, True, doc="use cuDNN; 0 leaves cuDNN-only ops to other providers"
    ),
    OptionSpec(
        "min_num_runs_before_cuda_graph_capture",
        _int(0),
        2,
        flat=False,
        doc="regular runs before capture",
    ),
    OptionSpec("tunable_op_enable", _bool, False, doc="use TunableOp"),
    OptionSpec("tunable_op_tuning_enable", _bool, False, doc="tune online"),
    OptionSpec("tunable_op_max_tuning_duration_ms", _int(0), 0, doc="tuning time limit"),
)
SPEC_BY_KEY = {s.key: s for s in SPECS}


@dataclass(frozen=True)
class CudaOptions:
    device_id: int = 0
    gpu_mem_limit: int = SIZE_MAX
    arena_extend_strategy: int = 0
    cudnn_conv_algo_search: int = 0
    do_copy_in_default_stream: bool = True
    cudnn_conv_use_max_workspace: bool = True
    cudnn_conv1d_pad_to_nc1d: bool = False
    enable_cuda_graph: bool = False
    enable_skip_layer_norm_strict_mode: bool = False
    prefer_nhwc: bool = True
    use_ep_level_unified_stream: bool = False
    use_tf32: bool = True
    fuse_conv_bias: bool = False
    tuning_cache_dir: str = ""
    sdpa_kernel: int = 0
    has_user_compute_stream: bool = False
    user_compute_stream: int = 0
    # the stream object ``user_compute_stream`` came as (its handle is above), kept alive for
    # the session; never closed or destroyed by the provider
    user_stream_object: Any = field(default=None, compare=False)
    gpu_external_alloc: Any = 0  # an address or a Python callable
    gpu_external_free: Any = 0
    gpu_external_empty_cache: Any = 0
    enable_cudnn: bool = True
    min_num_runs_before_cuda_graph_capture: int = 2
    tunable_op_enable: bool = False
    tunable_op_tuning_enable: bool = False
    tunable_op_max_tuning_duration_ms: int = 0
    # the device arena's options as bare ``arena.*`` keys (gpu_mem_limit and
    # arena_extend_strategy included), validated
    arena: tuple[tuple[str, str], ...] = ()
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @property
    def arena_options(self) -> dict[str, str]:
        return dict(self.arena)

    @property
    def uses_external_allocator(self) -> bool:
        return bool(self.gpu_external_alloc and self.gpu_external_free)

    @property
    def unified_stream(self) -> bool:
        """One stream for all runs: forced by a user stream or an external allocator. Graph
        mode is not unified: as in onnxruntime's plugin EP each run frame (so each thread's
        graph) has a stream of its own."""
        return (
            self.use_ep_level_unified_stream
            or self.has_user_compute_stream
            or self.uses_external_allocator
        )

    def as_strings(self) -> dict[str, str]:
        """Effective values, as ``get_provider_options()`` reports them."""
        out = {}
        for f in fields(self):
            if f.name in ("warnings", "arena", "user_stream_object"):
                continue
            v = getattr(self, f.name)
            if callable(v):
                v = f"<python callable {getattr(v, '__qualname__', type(v).__name__)}>"
            elif f.name == "cudnn_conv_algo_search":
                v = next(k for k, n in CONV_ALGO_SEARCH.items() if n == v)
            elif f.name == "arena_extend_strategy":
                v = next(k for k, n in ARENA_EXTEND_STRATEGY.items() if n == v)
            elif isinstance(v, bool):
                v = "1" if v else "0"
            out[f.name] = str(v)
        out.update(self.arena)
        return out


def lookup(
    config: Mapping[str, str], provider_name: str, spec: OptionSpec
) -> tuple[str, str] | None:
    """(key found, value) for ``spec`` in the session config, in precedence order."""
    prefixes = [f"ep.{provider_name.lower()}.", "ep.cuda."]
    for name in (spec.key, *spec.aliases):
        for p in prefixes:
            if p + name in config:
                return p + name, config[p + name]
    if spec.flat:
        for name in (spec.key, *spec.aliases):
            if name in config:
                return name, config[name]
    return None


# Environment variables that override the TunableOp options, as in onnxruntime's CUDA provider
# (OverrideTunableOpInfoByEnv): "0" or "1".
TUNABLE_OP_ENV = {
    "tunable_op_enable": "ORT_CUDA_TUNABLE_OP_ENABLE",
    "tunable_op_tuning_enable": "ORT_CUDA_TUNABLE_OP_TUNING_ENABLE",
}


def parse_options(
    config: Mapping[str, str], provider_name: str, objects: Mapping[str, Any] | None = None
) -> CudaOptions:
    """Parse and cross-validate the CUDA options found in ``config``; ``objects`` holds the
    values given as Python objects (callables for the external allocator), by config key."""
    values: dict[str, Any] = {}
    for spec in SPECS:
        hit = lookup(config, provider_name, spec)
        if hit is not None:
            label = (
                f"'{spec.key}'" if hit[0] == spec.key else f"'{spec.key}' (config key '{hit[0]}')"
            )
            obj = (objects or {}).get(hit[0])
            if obj is not None and spec.key == STREAM_KEY and hasattr(obj, "__cuda_stream__"):
                values[spec.key] = stream_handle(label, obj)
                values["user_stream_object"] = obj  # kept alive while the session runs on it
            elif obj is not None:
                if spec.key not in OBJECT_KEYS or not callable(obj):
                    raise InvalidArgument(
                        f"CUDA provider option {label} must be a string, not a {type(obj).__name__}"
                    )
                values[spec.key] = obj
            else:
                values[spec.key] = spec.parse(label, hit[1])
    _reject_unknown(config, provider_name)
    values["arena"] = tuple(sorted(_arena_options(config, provider_name, values).items()))
    warnings: list[str] = []
    values["has_user_compute_stream"] = _has_user_stream(values)
    ext = [bool(values.get("gpu_external_alloc")), bool(values.get("gpu_external_free"))]
    if any(ext) and not all(ext):
        raise InvalidArgument(
            "CUDA provider options 'gpu_external_alloc' and 'gpu_external_free' must be set together"
        )
    if values.get("gpu_external_empty_cache") and not all(ext):
        raise InvalidArgument(
            "CUDA provider option 'gpu_external_empty_cache' needs 'gpu_external_alloc' and 'gpu_external_free'"
        )
    if values.get("has_user_compute_stream") and all(ext):
        raise InvalidArgument(
            "CUDA provider options 'user_compute_stream' and 'gpu_external_alloc'/'gpu_external_free' "
            "cannot be combined (as in onnxruntime)"
        )
    for key, var in TUNABLE_OP_ENV.items():  # onnxruntime's overrides of the options
        env = os.environ.get(var)
        if env is not None:
            if env not in ("0", "1"):
                raise InvalidArgument(
                    f"environment variable {var}={env!r} must be 0 or 1 (it overrides CUDA "
                    f"provider option '{key}')"
                )
            values[key] = env == "1"
    if values.get("tunable_op_tuning_enable") and not values.get("tunable_op_enable"):
        warnings.append(
            "TunableOp is enabled for tuning but is not enabled for using. This will have no effect."
        )
    return CudaOptions(**values, warnings=tuple(warnings))


_KNOWN = {name for s in SPECS for name in (s.key, *s.aliases)}

# the mempool mode's keys, next to the arena keys every BFC arena has (ARENA_OPTIONS)
MEMPOOL_KEYS = frozenset(
    {
        "arena.use_cuda_mempool",
        "arena.cuda_mempool_release_threshold",
        "arena.cuda_mempool_bytes_to_keep_on_shrink",
    }
)
ARENA_KEYS = frozenset(ARENA_OPTIONS) | MEMPOOL_KEYS


@dataclass(frozen=True)
class ArenaSettings:
    """How the device memory of a shared allocator is managed: a BFC arena with ``arena``,
    or (``use_cuda_mempool``) a CUDA memory pool."""

    arena: ArenaConfig = ArenaConfig()
    use_cuda_mempool: bool = False
    cuda_mempool_release_threshold: int = 0
    cuda_mempool_bytes_to_keep_on_shrink: int = 0


def arena_settings(options: Mapping[str, str], where: str) -> ArenaSettings:
    """Validate ``arena.*`` options (``ARENA_KEYS``); also accepts the provider options
    ``gpu_mem_limit`` (``cuda_mem_limit``) and ``arena_extend_strategy`` as their
    ``arena.max_mem`` / ``arena.extend_strategy``, which an ``arena.*`` key overrides."""
    opts = dict(options)
    for key in ("gpu_mem_limit", "cuda_mem_limit"):
        if key in opts:
            v = opts.pop(key)
            opts.setdefault("arena.max_mem", str(_mem_limit(f"'{key}'", v)))
    if "arena_extend_strategy" in opts:
        v = opts.pop("arena_extend_strategy")
        n = _enum(ARENA_EXTEND_STRATEGY)("'arena_extend_strategy'", v)
        opts.setdefault("arena.extend_strategy", str(n))
    for key in opts:
        if not key.startswith("arena."):
            raise InvalidArgument(
                f"{where}: '{key}' is not an allocator option; use arena.* keys "
                f"({', '.join(sorted(ARENA_KEYS))}), gpu_mem_limit or arena_extend_strategy"
            )
    config = ArenaConfig.from_options(opts, where, MEMPOOL_KEYS)
    mempool = opts.get("arena.use_cuda_mempool", "0").strip()
    if mempool not in ("0", "1"):
        raise InvalidArgument(
            f"{where}: arena option 'arena.use_cuda_mempool': '{mempool}' must be 0 or 1"
        )
    threshold = opts.get("arena.cuda_mempool_release_threshold")
    keep = opts.get("arena.cuda_mempool_bytes_to_keep_on_shrink")
    return ArenaSettings(
        config,
        mempool == "1",
        parse_byte_count(where, "arena.cuda_mempool_release_threshold", threshold)
        if threshold is not None
        else 0,
        parse_byte_count(where, "arena.cuda_mempool_bytes_to_keep_on_shrink", keep)
        if keep is not None
        else 0,
    )


def _arena_options(
    config: Mapping[str, str], provider_name: str, values: Mapping[str, Any]
) -> dict[str, str]:
    """The device arena's options of a session, validated: ``ep.<name>.arena.*`` over
    ``ep.cuda.arena.*``, over ``gpu_mem_limit`` / ``arena_extend_strategy`` when given."""
    out: dict[str, str] = {}
    if "gpu_mem_limit" in values:
        limit = values["gpu_mem_limit"]
        out["arena.max_mem"] = "0" if limit == SIZE_MAX else str(limit)
    if "arena_extend_strategy" in values:
        out["arena.extend_strategy"] = str(values["arena_extend_strategy"])
    for prefix in ("ep.cuda.", f"ep.{provider_name.lower()}."):
        for key, value in config.items():
            if key.startswith(prefix + "arena."):
                name = key[len(prefix) :]
                if name not in ARENA_KEYS:
                    raise InvalidArgument(
                        f"unknown CUDA arena option '{name}' (config key '{key}'); known: "
                        f"{', '.join(sorted(ARENA_KEYS))}"
                    )
                out[name] = value
    arena_settings(out, f"{provider_name} (session options)")
    return out


def _has_user_stream(values: Mapping[str, Any]) -> bool:
    """``has_user_compute_stream`` derived as onnxruntime does: a stream given (a non-zero
    address, or a stream object) is the user's stream whatever the flag says (onnxruntime's
    ``FromProviderOptions`` recomputes the flag); the address 0 (the legacy default stream,
    which ``torch.cuda.current_stream()`` may be) counts as a user stream when the flag says so
    or when it came as a stream object, as in onnxruntime's plugin EP. The flag without a
    stream is an error."""
    flag = values.get("has_user_compute_stream")
    if STREAM_KEY not in values:
        if flag:
            raise InvalidArgument(
                "CUDA provider option 'has_user_compute_stream' is 1 but 'user_compute_stream' "
                "is not set"
            )
        return False
    return bool(values[STREAM_KEY]) or "user_stream_object" in values or bool(flag)


def _reject_unknown(config: Mapping[str, str], provider_name: str) -> None:
    """Unknown keys under the provider's own prefix are typos: name them."""
    prefix = f"ep.{provider_name.lower()}."
    for key in config:
        if key.startswith(prefix):
            name = key[len(prefix) :]
            if name not in _KNOWN and not name.startswith("arena."):
                raise InvalidArgument(
                    f"unknown CUDA provider option '{name}'; known options: {', '.join(sorted(_KNOWN))}"
                )
