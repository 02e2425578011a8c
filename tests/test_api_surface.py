"""onnxplug's public API against the installed onnxruntime's, name by name.

Every public name of the ``onnxruntime`` module and every public attribute of its classes (on
an instance where onnxruntime hands one out) must exist in onnxplug, except those listed in
``LEFT_OUT`` with the reason. A name onnxruntime adds in a new release fails this test until it
is implemented or listed.
"""

from __future__ import annotations

import inspect
import threading

import numpy as np
import pytest
from onnx import helper

import onnxplug as ox
from onnxplug import errors

ort = pytest.importorskip("onnxruntime")

CPU = ["CPUExecutionProvider"]

# What onnxplug leaves out, and why. Keys: a module-level name, or "Class.attribute".
LEFT_OUT = {
    # onnxruntime features that have no counterpart here
    "AdapterFormat": "LoRA adapters are an onnxruntime generative-AI feature",
    "LoraAdapter": "LoRA adapters are an onnxruntime generative-AI feature",
    "RunOptions.add_active_adapter": "LoRA adapters are an onnxruntime generative-AI feature",
    "ModelCompiler": "EP-context model compilation needs compiling providers; ours run kernels",
    "OrtCompileApiFlags": "EP-context model compilation (see ModelCompiler)",
    "OrtEpContextData": "EP-context model compilation (see ModelCompiler)",
    "OrtEpContextDataBuffer": "EP-context model compilation (see ModelCompiler)",
    "SessionOptions.set_ep_context_data_read_func": "EP-context models (see ModelCompiler)",
    "SessionOptions.clear_ep_context_data_read_func": "EP-context models (see ModelCompiler)",
    "ModelPackage": "onnxruntime's model-package format",
    "ModelPackageComponentContext": "onnxruntime's model-package format",
    "ModelPackageContext": "onnxruntime's model-package format",
    "ModelPackageOptions": "onnxruntime's model-package format",
    "ModelPackageWriteMode": "onnxruntime's model-package format",
    "OrtExternalInitializerInfo": "initializers in caller-owned memory (see add_external_initializers)",
    "SessionOptions.add_external_initializers": "initializers are read from the model and its "
    "external-data files; add_initializer replaces one by value",
    "SessionOptions.add_external_initializers_from_files_in_memory": "as add_external_initializers",
    "SessionOptions.set_load_cancellation_flag": "loading is not cancellable from another thread",
    "set_global_thread_pool_sizes": "no global thread pools: intra_op_num_threads bounds each "
    "session's runs",
    "InferenceSession.set_ep_dynamic_options": "no provider has options that change after "
    "the session is made",
    "InferenceSession.create_ortvalue_from_shape_and_type": "OrtValue.ortvalue_from_shape_and_type "
    "allocates from the same shared allocators",
    "OrtValue.ort_value_from_sparse_tensor": "sparse tensors are not fed to or returned by runs",
    "SparseTensor.as_blocksparse_view": "block-sparse tensors cannot be made from Python",
    "SparseTensor.to_cuda": "sparse tensors stay on the host",
    "OrtSyncStream": "OrtEpDevice.create_sync_stream returns the provider's own stream object",
    "copy_tensors": "OrtValue.update_inplace and IOBinding copy between devices",
    # onnxruntime's build, packaging and module internals
    "cuda_version": "onnxruntime's build: the CUDA plugin reports its own versions",
    "has_collective_ops": "onnxruntime's build (NCCL collective ops)",
    "print_debug_info": "onnxruntime's build information",
    "onnxruntime_validation": "onnxruntime's install self-check module",
    "import_capi_exception": "onnxruntime's module internals",
    "contextlib": "a module onnxruntime imports, not API",
}


def _model() -> bytes:
    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", 1, ["n", 3])],
        [helper.make_tensor_value_info("y", 1, ["n", 3])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m.SerializeToString()


def _instances(rt) -> dict[str, object]:
    """One object of each public class, made the same way with either runtime."""
    s = rt.InferenceSession(_model(), providers=CPU)
    cpu = rt.OrtDevice.make("cpu", 0)
    return {
        "InferenceSession": s,
        "SessionOptions": rt.SessionOptions(),
        "RunOptions": rt.RunOptions(),
        "OrtValue": rt.OrtValue.ortvalue_from_numpy(np.ones(2, np.float32)),
        "IOBinding": s.io_binding(),
        "NodeArg": s.get_inputs()[0],
        "ModelMetadata": s.get_modelmeta(),
        "OrtEpDevice": rt.get_ep_devices()[0],
        "OrtHardwareDevice": rt.get_ep_devices()[0].device,
        "OrtMemoryInfo": rt.OrtMemoryInfo(
            "Cpu", rt.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, rt.OrtMemType.DEFAULT
        ),
        "OrtDevice": cpu,
        "OrtArenaCfg": rt.OrtArenaCfg(0, -1, -1, -1),
        "SparseTensor": rt.SparseTensor.sparse_coo_from_numpy(
            np.array([4]), np.ones(2, np.float32), np.array([0, 2]), cpu
        ),
    }


def _public(obj: object) -> set[str]:
    return {a for a in dir(obj) if not a.startswith("_")}


def test_module_names():
    missing = sorted(n for n in _public(ort) - _public(ox) if n not in LEFT_OUT)
    assert not missing, f"onnxruntime has, onnxplug lacks: {missing}"


def test_class_attributes():
    theirs, ours = _instances(ort), _instances(ox)
    missing = []
    for name, t in theirs.items():
        for attr in sorted(_public(t)):
            if not hasattr(ours[name], attr) and f"{name}.{attr}" not in LEFT_OUT:
                missing.append(f"{name}.{attr}")
    # classes handed out only as types (enums, records): compare the class attributes
    for name in sorted(_public(ort)):
        cls = getattr(ort, name)
        if name in theirs or not inspect.isclass(cls) or not hasattr(ox, name):
            continue
        if issubclass(cls, BaseException):
            continue
        members = getattr(cls, "__members__", None)
        if members:  # an enum: the same members, values and member attributes
            ours_cls = getattr(ox, name)
            assert {k: int(v) for k, v in members.items()} == {
                k: int(v) for k, v in ours_cls.__members__.items()
            }, name
            member = next(iter(ours_cls))
            missing += [f"{name}.{a}" for a in ("name", "value") if not hasattr(member, a)]
            continue
        for attr in sorted(_public(cls)):
            if not hasattr(getattr(ox, name), attr) and f"{name}.{attr}" not in LEFT_OUT:
                if attr not in getattr(getattr(ox, name), "__dataclass_fields__", {}):
                    missing.append(f"{name}.{attr}")
    assert not missing, f"onnxruntime has, onnxplug lacks: {missing}"


def test_left_out_names_are_really_missing():
    """An entry of LEFT_OUT that onnxplug has now must leave the list."""
    ours = _instances(ox)
    present = []
    for key in LEFT_OUT:
        cls, _, attr = key.rpartition(".")
        if not cls:
            present += [key] if hasattr(ox, key) else []
        elif hasattr(ours.get(cls, getattr(ox, cls, None)), attr):
            present.append(key)
    assert not present, present


# the new pieces, used as onnxruntime's scripts use them ------------------------------------------


def test_version_and_capi_pybind_state():
    assert ox.__version__ == ox.get_version_string()
    from onnxplug.capi import _pybind_state as C

    assert C.InvalidArgument is errors.InvalidArgument
    assert C.OrtValue is ox.OrtValue and C.get_available_providers is ox.get_available_providers
    for name in ("InvalidArgument", "Fail", "NoSuchFile", "OrtValue", "SessionOptions"):
        assert hasattr(ort.capi._pybind_state, name) and hasattr(C, name), name


def test_misspelt_options_raise_attribute_error():
    for rt in (ort, ox):
        with pytest.raises(AttributeError):
            rt.SessionOptions().intra_op_num_thread = 2
        with pytest.raises(AttributeError):
            rt.RunOptions().terminat = True
    so = ox.SessionOptions()
    with pytest.raises(errors.InvalidArgument, match="execution_mode"):
        so.execution_mode = 7
    with pytest.raises(errors.InvalidArgument, match="intra_op_num_threads"):
        so.intra_op_num_threads = "four"


def test_option_defaults_match():
    for cls in ("SessionOptions", "RunOptions"):
        t, o = getattr(ort, cls)(), getattr(ox, cls)()
        for attr in sorted(_public(t)):
            value = getattr(t, attr)
            if callable(value) or attr == "profile_file_prefix":  # names its runtime
                continue
            mine = getattr(o, attr)
            if hasattr(value, "__members__") or hasattr(type(value), "__members__"):
                mine, value = int(mine), int(value)  # the two runtimes' enum classes
            assert mine == value, f"{cls}.{attr}"


def test_ortvalue_from_shape_and_type_arguments():
    cases = [
        ((2, 3), np.float32),
        ([4], np.int64),
        ([2], "float64"),
        ([2], "float"),  # numpy's "float" is float64, in both
        ([3], 10),  # an ONNX type code: FLOAT16
    ]
    for shape, et in cases:
        t = ort.OrtValue.ortvalue_from_shape_and_type(shape, et)
        o = ox.OrtValue.ortvalue_from_shape_and_type(shape, et)
        assert (o.shape(), o.data_type()) == (t.shape(), t.data_type()), (shape, et)
    kw = {"shape": [2], "element_type": np.int32, "device_type": "cpu", "device_id": 0}
    assert ox.OrtValue.ortvalue_from_shape_and_type(**kw).data_type() == "tensor(int32)"
    with pytest.raises(TypeError):
        ox.OrtValue.ortvalue_from_shape_and_type([2])  # element_type is required, as there
    mi = ox.OrtMemoryInfo("Cpu", ox.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ox.OrtMemType.DEFAULT)
    v = ox.OrtValue.ortvalue_from_shape_and_type([2], np.float32, memory_info=mi)
    assert v.device_name() == "cpu"


def test_iobinding_without_outputs_is_an_error():
    for rt in (ort, ox):
        s = rt.InferenceSession(_model(), providers=CPU)
        b = s.io_binding()
        b.bind_cpu_input("x", np.ones((2, 3), np.float32))
        with pytest.raises(RuntimeError, match="At least one output should be requested"):
            s.run_with_iobinding(b)
        b.bind_output("y")
        s.run_with_iobinding(b)
        assert b.copy_outputs_to_cpu()[0].shape == (2, 3)


def test_graph_assignment_info_as_onnxruntime():
    so = ort.SessionOptions()
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    theirs = ort.InferenceSession(_model(), so, providers=CPU).get_provider_graph_assignment_info()
    ours = ox.InferenceSession(_model(), providers=CPU).get_provider_graph_assignment_info()

    def flat(info):
        return [(sg.ep_name, [(n.op_type, n.domain) for n in sg.get_nodes()]) for sg in info]

    assert flat(ours) == flat(theirs)
    assert ours[0]["ep"] == "CPUExecutionProvider"  # the record form earlier versions returned


def test_memory_infos_and_input_ep_devices():
    t = ort.InferenceSession(_model(), providers=CPU)
    o = ox.InferenceSession(_model(), providers=CPU)
    for a, b in zip(
        t.get_input_memory_infos() + t.get_output_memory_infos(),
        o.get_input_memory_infos() + o.get_output_memory_infos(),
        strict=True,
    ):
        assert (b.name, b.device_id, b.mem_type, b.allocator_type, b.device_mem_type) == (
            a.name,
            a.device_id,
            a.mem_type,
            a.allocator_type,
            a.device_mem_type,
        )
    assert [d.ep_name for d in o.get_input_epdevices()] == [
        d.ep_name for d in t.get_input_epdevices()
    ]


def test_ep_devices_and_enums():
    (t,) = [d for d in ort.get_ep_devices() if d.ep_name == "CPUExecutionProvider"]
    (o,) = [d for d in ox.get_ep_devices() if d.ep_name == "CPUExecutionProvider"]
    assert o.device.type == t.device.type == ox.OrtHardwareDeviceType.CPU
    for kind in ("DEFAULT", "HOST_ACCESSIBLE"):
        ours = o.memory_info(getattr(ox.OrtDeviceMemoryType, kind))
        assert (ours is None) == (t.memory_info(getattr(ort.OrtDeviceMemoryType, kind)) is None)
    assert str(ox.OrtMemType.DEFAULT) == str(ort.OrtMemType.DEFAULT)
    d, e = ort.OrtDevice.make("cuda", 1), ox.OrtDevice.make("cuda", 1)
    assert (e.device_type(), e.device_id(), e.device_vendor_id(), e.device_mem_type()) == (
        d.device_type(),
        d.device_id(),
        d.device_vendor_id(),
        d.device_mem_type(),
    )
    a, b = ort.OrtArenaCfg({"max_mem": 16}), ox.OrtArenaCfg({"max_mem": 16})
    assert [getattr(a, k) for k in ox.OrtArenaCfg._KEYS] == [
        getattr(b, k) for k in ox.OrtArenaCfg._KEYS
    ]


def test_sparse_tensor():
    dense_shape, values = np.array([3, 4]), np.array([1.0, 2.0, 3.0], np.float32)
    coo = np.array([0, 5, 11])
    inner, outer = np.array([0, 1, 3]), np.array([0, 1, 2, 3])
    for rt in (ort, ox):
        cpu = rt.OrtDevice.make("cpu", 0)
        s = rt.SparseTensor.sparse_coo_from_numpy(dense_shape, values, coo, cpu)
        assert s.format() == rt.OrtSparseFormat.ORT_SPARSE_COO
        np.testing.assert_array_equal(s.values(), values)
        np.testing.assert_array_equal(s.as_coo_view().indices(), coo)
        assert list(s.dense_shape()) == [3, 4] and s.data_type() == "sparse_tensor(float)"
        c = rt.SparseTensor.sparse_csr_from_numpy(dense_shape, values, inner, outer, cpu)
        np.testing.assert_array_equal(c.as_csrc_view().outer(), outer)
    dense = ox.SparseTensor.sparse_coo_from_numpy(
        dense_shape, values, coo, ox.OrtDevice.make("cpu", 0)
    ).to_dense()
    assert dense.reshape(-1)[[0, 5, 11]].tolist() == [1, 2, 3] and dense.sum() == 6


def test_set_seed_makes_unseeded_random_ops_repeat():
    g = helper.make_graph(
        [
            helper.make_node("RandomNormal", [], ["y"], shape=[4]),
            helper.make_node("Multinomial", ["p"], ["z"], sample_size=8),
        ],
        "g",
        [helper.make_tensor_value_info("p", 1, [1, 3])],
        [helper.make_tensor_value_info("y", 1, [4]), helper.make_tensor_value_info("z", 6, [1, 8])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    p = {"p": np.zeros((1, 3), np.float32)}

    def draw():
        return ox.InferenceSession(m.SerializeToString(), providers=CPU).run(None, p)

    ox.set_seed(7)
    try:
        a, b = draw(), draw()
    finally:
        import onnxplug.framework.seed as seed

        seed._seed = None
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(draw()[0], draw()[0])  # unseeded: OS entropy


def test_logger_callback_and_default_severity(capsys):
    got: list[tuple] = []
    lock = threading.Lock()

    def callback(severity, category, logid, where, message):
        with lock:
            got.append((severity, category, logid, message))

    ox.set_default_logger_callback(callback, 1)
    try:
        so = ox.SessionOptions()
        so.logid = "cb"
        ox.InferenceSession(_model(), so, providers=CPU)  # severity -1: the default's (info)
    finally:
        ox.set_default_logger_callback(None, 2)
        ox.set_default_logger_severity(2)
    assert got and all(g[1] == "onnxplug" and g[2] == "cb" for g in got)
    assert any(g[0] == 1 and "session for" in g[3] for g in got)
    assert capsys.readouterr().err == ""  # the callback took the lines
    ox.InferenceSession(_model(), providers=CPU)
    assert capsys.readouterr().err == ""  # warning level: nothing to say


def test_provider_selection_policy():
    so = ox.SessionOptions()
    assert not so.has_providers()
    so.set_provider_selection_policy(ox.OrtExecutionProviderDevicePolicy.PREFER_GPU)
    assert so.has_providers()
    s = ox.InferenceSession(_model(), so)
    gpus = [d.ep_name for d in ox.get_ep_devices() if d.device.type.name == "GPU"]
    assert s.get_providers() == [*dict.fromkeys(gpus), "CPUExecutionProvider"]

    seen = []

    def delegate(devices, model_metadata, runtime_metadata, max_selections):
        seen.append((len(devices), max_selections))
        return [d for d in devices if d.ep_name == "CPUExecutionProvider"]

    so = ox.SessionOptions()
    so.set_provider_selection_policy_delegate(delegate)
    assert ox.InferenceSession(_model(), so).get_providers() == CPU
    assert seen and seen[0][0] == seen[0][1] == len(ox.get_ep_devices())
