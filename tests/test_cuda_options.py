"""The CUDA provider's option parsing: defaults, lookup order, validation, exclusions.

Pure Python (no GPU): the option table is plugins/cuda/src/onnxplug_cuda/options.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "cuda" / "src"))

from onnxplug.errors import InvalidArgument
from onnxplug_cuda.options import SIZE_MAX, SPECS, CudaOptions, parse_options

NAME = "CUDAExecutionProvider"
P = "ep.cudaexecutionprovider."


def test_defaults_match_onnxruntime():
    o = parse_options({}, NAME)
    assert o == CudaOptions()
    assert o.device_id == 0
    assert o.gpu_mem_limit == SIZE_MAX
    assert o.cudnn_conv_algo_search == 0  # EXHAUSTIVE
    assert o.do_copy_in_default_stream is True
    assert o.cudnn_conv_use_max_workspace is True
    assert o.use_tf32 is True
    assert o.enable_cuda_graph is False
    assert o.enable_cudnn is True
    assert o.min_num_runs_before_cuda_graph_capture == 2
    assert o.sdpa_kernel == 0
    s = o.as_strings()
    assert s["cudnn_conv_algo_search"] == "EXHAUSTIVE"
    assert s["arena_extend_strategy"] == "kNextPowerOfTwo"
    assert s["use_tf32"] == "1"
    assert set(s) == {spec.key for spec in SPECS}


def test_lookup_order_provider_prefix_then_ep_cuda_then_flat():
    cfg = {"use_tf32": "0", "ep.cuda.use_tf32": "1", P + "use_tf32": "0"}
    assert parse_options(cfg, NAME).use_tf32 is False
    cfg = {"use_tf32": "0", "ep.cuda.use_tf32": "1"}
    assert parse_options(cfg, NAME).use_tf32 is True
    assert parse_options({"use_tf32": "false"}, NAME).use_tf32 is False


def test_aliases():
    assert parse_options({P + "cudnn_conv_algo": "HEURISTIC"}, NAME).cudnn_conv_algo_search == 1
    assert parse_options({"ep.cuda.prefer_nhwc_layout": "1"}, NAME).prefer_nhwc is True
    assert parse_options({"cuda_mem_limit": "1024"}, NAME).gpu_mem_limit == 1024


@pytest.mark.parametrize(
    "value,expected", [("EXHAUSTIVE", 0), ("heuristic", 1), ("Default", 2), ("2", 2)]
)
def test_conv_algo_search_names_and_numbers(value, expected):
    assert (
        parse_options({P + "cudnn_conv_algo_search": value}, NAME).cudnn_conv_algo_search
        == expected
    )


def test_min_runs_has_no_flat_alias():
    assert (
        parse_options(
            {"min_num_runs_before_cuda_graph_capture": "5"}, NAME
        ).min_num_runs_before_cuda_graph_capture
        == 2
    )
    assert (
        parse_options(
            {"ep.cuda.min_num_runs_before_cuda_graph_capture": "5"}, NAME
        ).min_num_runs_before_cuda_graph_capture
        == 5
    )


@pytest.mark.parametrize(
    "key,value,needle",
    [
        ("use_tf32", "yes", "'use_tf32'"),
        ("cudnn_conv_algo_search", "FAST", "EXHAUSTIVE"),
        ("arena_extend_strategy", "grow", "kSameAsRequested"),
        ("device_id", "-1", "'device_id'"),
        ("gpu_mem_limit", "-5", "negative"),
        ("sdpa_kernel", "4096", "'sdpa_kernel'"),
        ("user_compute_stream", "stream", "address"),
        ("min_num_runs_before_cuda_graph_capture", "-1", "outside"),
    ],
)
def test_malformed_values_name_the_key_and_accepted_values(key, value, needle):
    with pytest.raises(InvalidArgument) as e:
        parse_options({P + key: value}, NAME)
    assert needle in str(e.value)


def test_unknown_key_under_the_provider_prefix_is_an_error():
    with pytest.raises(InvalidArgument, match="unknown CUDA provider option 'use_tf23'"):
        parse_options({P + "use_tf23": "1"}, NAME)


def test_gpu_mem_limit_zero_is_unlimited():
    assert parse_options({P + "gpu_mem_limit": "0"}, NAME).gpu_mem_limit == SIZE_MAX


def test_user_stream_and_external_allocator_exclude_each_other():
    with pytest.raises(InvalidArgument, match="cannot be combined"):
        parse_options(
            {
                P + "user_compute_stream": "1234",
                P + "gpu_external_alloc": "1",
                P + "gpu_external_free": "2",
            },
            NAME,
        )


def test_external_allocator_needs_alloc_and_free():
    with pytest.raises(InvalidArgument, match="must be set together"):
        parse_options({P + "gpu_external_alloc": "1"}, NAME)
    with pytest.raises(InvalidArgument, match="needs"):
        parse_options({P + "gpu_external_empty_cache": "3"}, NAME)
    o = parse_options({P + "gpu_external_alloc": "1", P + "gpu_external_free": "2"}, NAME)
    assert o.uses_external_allocator and o.unified_stream


def test_user_stream_forces_unified_stream_and_allows_stream_zero():
    o = parse_options({P + "has_user_compute_stream": "1", P + "user_compute_stream": "0"}, NAME)
    assert o.has_user_compute_stream and o.user_compute_stream == 0 and o.unified_stream
    o = parse_options({P + "user_compute_stream": "0x10"}, NAME)
    assert o.has_user_compute_stream and o.user_compute_stream == 16
    with pytest.raises(InvalidArgument, match="user_compute_stream"):
        parse_options({P + "has_user_compute_stream": "1"}, NAME)


class _Stream:
    """Implements the CUDA stream protocol, like torch.cuda.Stream and CuPy streams."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


@pytest.mark.parametrize(
    "given, has, handle",
    [
        # a non-zero address is the user's stream, whatever the flag says (onnxruntime
        # recomputes has_user_compute_stream from it)
        ({"user_compute_stream": "4660"}, True, 4660),
        ({"user_compute_stream": "4660", "has_user_compute_stream": "0"}, True, 4660),
        # address 0 is the legacy default stream: a user's stream only when the flag says so
        # (what get_provider_options() reports without a stream must round-trip to none)
        ({"user_compute_stream": "0"}, False, 0),
        ({"user_compute_stream": "0", "has_user_compute_stream": "0"}, False, 0),
        ({"user_compute_stream": "0", "has_user_compute_stream": "1"}, True, 0),
        ({}, False, 0),
    ],
)
def test_has_user_compute_stream_is_derived(given, has, handle):
    o = parse_options({P + k: v for k, v in given.items()}, NAME)
    assert (o.has_user_compute_stream, o.user_compute_stream) == (has, handle)
    assert o.unified_stream == has


@pytest.mark.parametrize("handle", [0x5A5A00, 0])
def test_a_stream_object_is_a_user_stream_kept_alive(handle):
    # torch.cuda.current_stream() may be the legacy default stream, handle 0: given as an
    # object it is still the user's stream
    stream = _Stream(handle)
    key = P + "user_compute_stream"
    o = parse_options({key: "<python stream _Stream>"}, NAME, {key: stream})
    assert o.has_user_compute_stream and o.user_compute_stream == handle
    assert o.user_stream_object is stream and o.unified_stream
    assert o.as_strings()["user_compute_stream"] == str(handle)


def test_a_stream_object_with_a_broken_protocol_is_named():
    class Broken:
        def __cuda_stream__(self):
            return 12

    key = P + "user_compute_stream"
    with pytest.raises(InvalidArgument, match="user_compute_stream.*__cuda_stream__"):
        parse_options({key: "x"}, NAME, {key: Broken()})


def test_a_stream_object_for_another_option_is_refused():
    key = P + "device_id"
    with pytest.raises(InvalidArgument, match="'device_id'.*must be a string"):
        parse_options({key: "x"}, NAME, {key: _Stream(1)})


@pytest.mark.parametrize(
    "stream",
    [{"user_compute_stream": "1234"}, {"has_user_compute_stream": "1", "user_compute_stream": "0"}],
)
def test_user_stream_and_external_allocator_error_names_both(stream):
    with pytest.raises(InvalidArgument) as e:
        parse_options(
            {
                **{P + k: v for k, v in stream.items()},
                P + "gpu_external_alloc": "1",
                P + "gpu_external_free": "2",
            },
            NAME,
        )
    assert "'user_compute_stream'" in str(e.value) and "'gpu_external_alloc'" in str(e.value)


@pytest.mark.parametrize("value", ["0", "1"])
def test_do_copy_in_default_stream_is_accepted_and_reported(value):
    # onnxruntime's stream-aware executor copies on the stream of the node that needs the
    # copy whatever this says (its dedicated copy streams are gone); it stays an option
    o = parse_options({P + "do_copy_in_default_stream": value}, NAME)
    assert o.do_copy_in_default_stream == (value == "1")
    assert o.as_strings()["do_copy_in_default_stream"] == value
    assert not o.unified_stream


def test_cuda_graph_keeps_a_stream_per_run_frame():
    # onnxruntime's plugin EP: graph mode captures on a per-thread stream, not one EP stream
    # (its in-tree EP forced a unified stream); concurrent runs stay possible
    o = parse_options({P + "enable_cuda_graph": "1"}, NAME)
    assert o.enable_cuda_graph and not o.unified_stream
    assert parse_options({P + "use_ep_level_unified_stream": "1"}, NAME).unified_stream
    assert not parse_options({}, NAME).unified_stream


def test_tuning_without_enable_warns():
    o = parse_options({P + "tunable_op_tuning_enable": "1"}, NAME)
    assert any("no effect" in w for w in o.warnings)


@pytest.mark.parametrize(
    "env,config,want",
    [
        ({"ORT_CUDA_TUNABLE_OP_ENABLE": "1"}, {}, (True, False)),
        ({"ORT_CUDA_TUNABLE_OP_ENABLE": "0"}, {"tunable_op_enable": "1"}, (False, False)),
        (
            {"ORT_CUDA_TUNABLE_OP_ENABLE": "1", "ORT_CUDA_TUNABLE_OP_TUNING_ENABLE": "1"},
            {"tunable_op_tuning_enable": "0"},
            (True, True),
        ),
    ],
)
def test_environment_overrides_the_tunable_op_options(monkeypatch, env, config, want):
    """As onnxruntime's CUDA provider does: ORT_CUDA_TUNABLE_OP_ENABLE and
    ORT_CUDA_TUNABLE_OP_TUNING_ENABLE ("0" or "1") override the options."""
    for var in ("ORT_CUDA_TUNABLE_OP_ENABLE", "ORT_CUDA_TUNABLE_OP_TUNING_ENABLE"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    o = parse_options({P + k: v for k, v in config.items()}, NAME)
    assert (o.tunable_op_enable, o.tunable_op_tuning_enable) == want


def test_a_bad_tunable_op_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("ORT_CUDA_TUNABLE_OP_TUNING_ENABLE", "yes")
    with pytest.raises(
        InvalidArgument,
        match="ORT_CUDA_TUNABLE_OP_TUNING_ENABLE='yes'.*'tunable_op_tuning_enable'",
    ):
        parse_options({}, NAME)
