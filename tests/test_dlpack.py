"""DLPack interop: OrtValue.from_dlpack / to_dlpack / __dlpack__ / __dlpack_device__, DLPack
objects as run() and IOBinding inputs, used in place.

Host memory is tested against numpy's DLPack and onnxruntime's OrtValue; device memory on the
virtual device, whose stand-in for another library's tensors (``foreign.VirtArray``) queues
its writes on a stream of its own: a missing stream handshake reads poisoned memory (NaN).
"""

from __future__ import annotations

import gc
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib.array_utils import byte_bounds

import onnxplug as ox
from onnxplug.errors import InvalidArgument
from onnxplug.framework import dlpack
from tests.plugins import virtual_device as vd
from tests.plugins.graphs import make_model, node, tensor
from tests.plugins.virtual_device.foreign import VirtArray

CPU = "CPUExecutionProvider"


class HostTensor:
    """Another library's CPU tensor: speaks DLPack only (no __array__ a copy could use)."""

    def __init__(self, arr: np.ndarray):
        self._arr = arr

    def __dlpack__(self, *, stream=None, **kwargs):
        return self._arr.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


def _relu_model() -> bytes:
    return make_model(
        [node("Relu", ["x"], ["y"])], [tensor("x", ["N", 4])], [tensor("y", ["N", 4])]
    )


def _spy_inputs(sess: ox.InferenceSession, op: str) -> list[int]:
    """The address of input 0 of every call of ``op``'s kernel."""
    seen: list[int] = []
    (step,) = [s for s in sess._runner.plan.steps if s.info.op_type == op]
    kernel, compute = step.kernel, step.kernel.compute

    def spy(ctx):
        x = ctx.input(0)
        seen.append(x.ptr if hasattr(x, "ptr") else x.ctypes.data)
        compute(ctx)

    kernel.compute = spy
    return seen


# ---------------------------------------------------------------------------------------------
# the capsule format


DTYPES = dlpack.DTYPES
NUMPY_DTYPES = [d for d in DTYPES if d.type.__module__ == "numpy"]  # numpy's DLPack has these


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 4), min_size=0, max_size=4).map(tuple),
)
def test_export_then_import_keeps_address_shape_and_dtype(dtype, shape):
    a = np.zeros(shape, dtype)
    owner = object()
    cap = dlpack.to_capsule(a.ctypes.data, a.shape, a.dtype, dlpack.CPU, 0, owner)
    imp = dlpack.from_capsule(cap)
    assert (imp.ptr, imp.shape, imp.dtype) == (a.ctypes.data if a.size else imp.ptr, shape, a.dtype)
    assert imp.is_contiguous and not imp.readonly
    with pytest.raises(TypeError, match="already consumed"):
        dlpack.from_capsule(cap)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_we_read_numpys_legacy_and_versioned_capsules(dtype):
    # (OrtValue round trips through numpy are in test_session_api.py)
    a = np.arange(6).astype(dtype).reshape(2, 3)
    for cap in (a.__dlpack__(), a.__dlpack__(max_version=(1, 0))):
        imp = dlpack.from_capsule(cap)
        assert (imp.ptr, imp.shape, imp.dtype) == (a.ctypes.data, a.shape, a.dtype)
        assert (imp.device_type, imp.device_id) == (dlpack.CPU, 0)
    # and numpy reads ours
    b = np.from_dlpack(ox.OrtValue.from_dlpack(a.__dlpack__()))
    assert b.ctypes.data == a.ctypes.data and b.dtype == a.dtype


def test_strides_and_read_only_flags_are_read():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    imp = dlpack.from_capsule(a[:, ::2].__dlpack__())
    assert imp.strides == (4, 2) and not imp.is_contiguous
    ro = a.copy()
    ro.flags.writeable = False
    assert dlpack.from_capsule(ro.__dlpack__(max_version=(1, 0))).readonly
    v = ox.OrtValue.from_dlpack(ro)  # asked for as DLPack 1.x, which says read-only
    assert v.data_ptr() == ro.ctypes.data and not v.numpy().flags.writeable
    strided = ox.OrtValue.from_dlpack(a[:, ::2])  # host tensors keep their strides
    assert strided.data_ptr() == a.ctypes.data
    np.testing.assert_array_equal(strided.numpy(), a[:, ::2])


@pytest.mark.parametrize(
    "index",
    [np.s_[::-1], np.s_[:, ::-1, 1::2], np.s_[..., ::-3], np.s_[::-1, ::-1, ::-1], np.s_[1:, ::2]],
)
def test_negative_and_positive_strides_view_exactly_the_producers_elements(index):
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    b = a[index]
    got = ox.OrtValue.from_dlpack(b).numpy()
    np.testing.assert_array_equal(got, b)
    # the memory viewed is exactly the span of the producer's elements (negative strides
    # reach below the tensor's address), nothing beyond them
    views = [got]
    while isinstance(views[-1], np.ndarray) or hasattr(views[-1], "base"):
        views.append(views[-1].base)
    spans = {byte_bounds(x) for x in views if isinstance(x, np.ndarray)}
    lo, hi = byte_bounds(b)
    assert all(lo <= span[0] and span[1] <= hi for span in spans)


@pytest.mark.parametrize("versioned", [False, True])
def test_a_consumed_capsule_is_renamed_and_its_deleter_runs_exactly_once(versioned):
    """The producer's deleter (numpy's gives back its reference to the array) runs once, when
    the last value over the memory is gone; the capsule is renamed so that its own destructor
    does not run it too."""
    a = np.arange(6, dtype=np.float32)
    refs = sys.getrefcount(a)
    cap = a.__dlpack__(max_version=(1, 0)) if versioned else a.__dlpack__()
    name = b"dltensor_versioned" if versioned else b"dltensor"
    assert dlpack._is_valid(cap, name)
    v = ox.OrtValue.from_dlpack(cap)
    assert not dlpack._is_valid(cap, name) and dlpack._is_valid(cap, b"used_" + name)
    del cap
    gc.collect()
    assert sys.getrefcount(a) == refs + 1  # the imported memory holds the producer's tensor
    view = v.numpy()
    del v
    gc.collect()
    assert sys.getrefcount(a) == refs + 1  # ... while a view of it lives
    del view
    gc.collect()
    assert sys.getrefcount(a) == refs  # released once: twice would leave one reference less


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn])
def test_host_tensors_of_dtypes_numpy_cannot_share_go_through_our_capsules(dtype):
    # onnxruntime exchanges bfloat16 and float8 through DLPack; numpy refuses them
    a = np.arange(6).astype(dtype).reshape(3, 2)
    v = ox.OrtValue.ortvalue_from_numpy(a)
    back = ox.OrtValue.from_dlpack(v)  # our capsule, our reader
    assert back.data_ptr() == a.ctypes.data and back.numpy().dtype == a.dtype
    np.testing.assert_array_equal(back.numpy().astype(np.float32), a.astype(np.float32))


def test_an_unconsumed_capsule_releases_the_tensor(virt):
    before = dlpack.exported_count()
    v = ox.OrtValue.ortvalue_from_numpy(np.arange(4, dtype=np.float32), "virt", 0)
    cap = v.to_dlpack()
    assert dlpack.exported_count() == before + 1
    del cap  # never consumed: the capsule releases it
    gc.collect()
    assert dlpack.exported_count() == before


def test_unsupported_dtypes_and_foreign_objects_are_named():
    with pytest.raises(TypeError, match="int4"):
        dlpack.dl_dtype(ml_dtypes.int4)
    with pytest.raises(InvalidArgument, match="DLPack"):
        ox.OrtValue.from_dlpack(object())


# ---------------------------------------------------------------------------------------------
# onnxruntime's OrtValue, both ways (comparison with the reference implementation)


def test_onnxruntime_ortvalues_and_ours_exchange_memory():
    # (plain float round trips are in test_session_api.py)
    ort = pytest.importorskip("onnxruntime")
    a = np.arange(10, dtype=np.float32).reshape(2, 5)
    ours = ox.OrtValue.from_dlpack(a)
    theirs = ort.OrtValue.from_dlpack(ours)
    assert theirs.data_ptr() == a.ctypes.data
    assert theirs.__dlpack_device__() == ours.__dlpack_device__() == (1, 0)
    flags = ort.OrtValue.ortvalue_from_numpy(np.array([True, False]))
    got = ox.OrtValue.from_dlpack(flags)  # kDLBool
    assert got.numpy().dtype == np.bool_ and got.data_ptr() == flags.data_ptr()
    # onnxruntime's older flag: a uint8 tensor read as bool
    u8 = ox.OrtValue.from_dlpack(np.array([1, 0], np.uint8), is_bool_tensor=True)
    assert u8.numpy().dtype == np.bool_ and u8.numpy().tolist() == [True, False]


# ---------------------------------------------------------------------------------------------
# run() and IOBinding with DLPack inputs on the host


def test_run_uses_a_dlpack_host_tensor_in_place():
    sess = ox.InferenceSession(_relu_model(), providers=[CPU])
    seen = _spy_inputs(sess, "Relu")
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    (y,) = sess.run(None, {"x": HostTensor(x)})
    np.testing.assert_array_equal(y, np.maximum(x, 0))
    assert seen == [x.ctypes.data]  # the kernel read the producer's memory
    # a raw capsule too
    (y,) = sess.run(None, {"x": x.__dlpack__()})
    assert seen[-1] == x.ctypes.data
    # the model's type and shape still apply (no silent conversion)
    with pytest.raises(InvalidArgument, match="tensor\\(double\\).*input 'x'"):
        sess.run(None, {"x": HostTensor(x.astype(np.float64))})


def test_iobinding_binds_a_dlpack_host_tensor_in_place():
    sess = ox.InferenceSession(_relu_model(), providers=[CPU])
    seen = _spy_inputs(sess, "Relu")
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    io = sess.io_binding()
    io.bind_cpu_input("x", HostTensor(x))
    io.bind_output("y")
    sess.run_with_iobinding(io)
    np.testing.assert_array_equal(io.copy_outputs_to_cpu()[0], np.maximum(x, 0))
    io.bind_ortvalue_input("x", ox.OrtValue.from_dlpack(HostTensor(x)))
    sess.run_with_iobinding(io)
    assert seen == [x.ctypes.data, x.ctypes.data]


# ---------------------------------------------------------------------------------------------
# device memory: the virtual device and another library's tensors on it


def _virt_model() -> bytes:
    """y = Relu(x) on the device; z = Identity(x) (the input itself)."""
    return make_model(
        [node("Relu", ["x"], ["y"]), node("Identity", ["x"], ["z"])],
        [tensor("x", ["N", 4])],
        [tensor("y", ["N", 4]), tensor("z", ["N", 4])],
    )


def test_a_device_tensor_of_another_library_is_used_in_place_after_its_pending_work(virt):
    sess = ox.InferenceSession(_virt_model(), providers=[vd.NAME, CPU])
    x = np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)
    foreign = VirtArray.filled_later(virt, x)  # its write is still queued on its stream
    seen = _spy_inputs(sess, "Relu")
    y, z = sess.run_with_ort_values(None, {"x": foreign})
    assert seen == [foreign.ptr]  # in place: no copy to or from the host
    assert z.data_ptr() == foreign.ptr  # Identity hands the input itself on
    np.testing.assert_array_equal(y.numpy(), np.maximum(x, 0))  # not the poison
    np.testing.assert_array_equal(z.numpy(), x)
    # plain run() too, and through OrtValue.from_dlpack and IOBinding
    x2 = x[::-1].copy()
    np.testing.assert_array_equal(
        sess.run(["y"], {"x": VirtArray.filled_later(virt, x2)})[0], np.maximum(x2, 0)
    )
    io = sess.io_binding()
    v = ox.OrtValue.from_dlpack(VirtArray.filled_later(virt, x))
    assert v.device_name() == "virt" and v.__dlpack_device__() == (dlpack.EXT_DEV, 0)
    io.bind_ortvalue_input("x", v)
    io.bind_output("y", "virt", 0)
    sess.run_with_iobinding(io)
    np.testing.assert_array_equal(io.copy_outputs_to_cpu()[0], np.maximum(x, 0))


def test_without_the_handshake_the_device_tensor_would_be_read_too_early(virt):
    # what the tests above rely on: reading the producer's memory before its stream ran
    # sees the poison
    foreign = VirtArray.filled_later(virt, np.ones((2, 4), np.float32))
    assert np.isnan(foreign._view()).all()
    np.testing.assert_array_equal(foreign.read(), np.ones((2, 4), np.float32))


def test_outputs_go_to_another_library_on_the_device_without_a_copy(virt):
    sess = ox.InferenceSession(_virt_model(), providers=[vd.NAME, CPU])
    x = np.random.default_rng(3).standard_normal((2, 4)).astype(np.float32)
    y, _ = sess.run_with_ort_values(None, {"x": x})
    assert y.device_name() == "virt"
    other = VirtArray.from_dlpack(virt, y)
    assert other.ptr == y.data_ptr()
    np.testing.assert_array_equal(other.read(), np.maximum(x, 0))
    # the consumer keeps the memory alive without the OrtValue
    ptr = y.data_ptr()
    del y
    gc.collect()
    assert virt.allocator.is_live(ptr, x.nbytes)
    np.testing.assert_array_equal(other.read(), np.maximum(x, 0))


def test_the_producer_orders_its_pending_work_before_the_consumers_stream(virt):
    """OrtValue.__dlpack__(stream=...) as a producer: a tensor imported with work pending
    (its ``ready``) is handed on with the consumer's stream waiting for that work."""
    x = np.random.default_rng(4).standard_normal((3, 4)).astype(np.float32)
    v = ox.OrtValue.from_dlpack(VirtArray.filled_later(virt, x))
    consumer = VirtArray.from_dlpack(virt, v)  # passes its own stream
    assert consumer.ptr == v.data_ptr()
    np.testing.assert_array_equal(consumer.read(), x)  # its stream ran the producer's write


def test_device_tensors_no_provider_offers_or_with_strides_are_refused(virt):
    class Elsewhere(HostTensor):
        def __dlpack_device__(self):
            return (dlpack.EXT_DEV, 9)

    sess = ox.InferenceSession(_relu_model(), providers=[vd.NAME, CPU])
    with pytest.raises(InvalidArgument, match=r"input 'x'.*DLPack device \(12, 9\)"):
        sess.run(None, {"x": Elsewhere(np.zeros((1, 4), np.float32))})

    class Strided(VirtArray):
        """Exports every other column of a (2, 4) array: a (2, 2) view, strides (4, 2)."""

        def __dlpack__(self, *, stream=None, **kwargs):
            dev = self.factory.device.id
            cap = dlpack.to_capsule(self.ptr, (2, 2), self.dtype, dlpack.EXT_DEV, dev, self)
            managed = dlpack._DLManagedTensor.from_address(dlpack._get_pointer(cap, b"dltensor"))
            managed.dl_tensor.strides[0], managed.dl_tensor.strides[1] = 4, 2
            return cap

    with pytest.raises(InvalidArgument, match="not dense row-major"):
        ox.OrtValue.from_dlpack(Strided(virt, (2, 4), np.float32))
