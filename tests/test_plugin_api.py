"""The plugin API and plugin loading: discovery through entry points, registration, broken
plugins, EP devices, provider options in the EP's session config, capability gating and the
CPU fallback."""

from __future__ import annotations

import ast
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import onnxplug as ox
from onnxplug.ep import API_VERSION, CAPABILITIES, loader, supports
from onnxplug.ep.loader import ENTRY_POINT_GROUP, PluginRegistry
from tests.conftest import VIRT, registered
from tests.plugins import graphs
from tests.plugins import virtual_device as vd

CPU = "CPUExecutionProvider"
PKG = "tests.plugins"
VIRT_FACTORY = f"{VIRT}:create_factory"


def relu_session(providers: list, **kw) -> ox.InferenceSession:
    return ox.InferenceSession(graphs.chain("Relu", 2), providers=providers, **kw)


def check_relu(sess: ox.InferenceSession) -> None:
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], np.maximum(x, 0))


# ---------------------------------------------------------------------------------------------
# discovery through entry points


@pytest.fixture
def entry_points(monkeypatch):
    """Installs fake entry points in the ``onnxplug.execution_providers`` group."""

    def install(**targets: str) -> None:
        def fake(group: str) -> list[tuple[str, str]]:
            assert group == ENTRY_POINT_GROUP
            return list(targets.items())

        monkeypatch.setattr(loader, "installed_entry_points", fake)

    return install


def test_entry_points_are_discovered_and_broken_plugins_are_reported(entry_points):
    entry_points(
        VirtualDeviceExecutionProvider=f"{PKG}.virtual_device:create_factory",
        MissingExecutionProvider=f"{PKG}.no_such_module:create_factory",
        BrokenExecutionProvider=f"{PKG}.broken_plugin:create_factory",
        NotAFactoryExecutionProvider=f"{PKG}.bad_plugins:not_a_factory",
        FutureExecutionProvider=f"{PKG}.bad_plugins:FutureFactory",
        CrashingExecutionProvider=f"{PKG}.bad_plugins:CrashingFactory",
        NoDeviceExecutionProvider=f"{PKG}.bad_plugins:NoDeviceFactory",
    )
    reg = PluginRegistry()
    # the good plugin and the builtin CPU provider (CPU last), nothing else
    assert reg.available_providers() == [vd.NAME, CPU]
    assert [d.ep_name for d in reg.ep_devices()] == [vd.NAME, CPU]
    errors = {lib.name: lib.error for lib in reg.libraries() if lib.error}
    expected = {
        "MissingExecutionProvider": "No module named 'tests.plugins.no_such_module'",
        "BrokenExecutionProvider": "libvirtual_device.so: cannot open shared object file",
        "NotAFactoryExecutionProvider": "returned dict, not an EpFactory",
        "FutureExecutionProvider": f"needs plugin API version {API_VERSION + 1}",
        "CrashingExecutionProvider": "driver version 1.0 is too old",
    }
    assert set(errors) == set(expected)
    for name, why in expected.items():
        # each message names the plugin, where it came from and what went wrong
        assert f"execution provider plugin '{name}'" in errors[name]
        assert why in errors[name]
    # asking for a broken plugin gives its error; one without devices says so
    factory, why = reg.find_factory("FutureExecutionProvider")
    assert factory is None and "upgrade onnxplug" in why
    factory, why = reg.find_factory("NoDeviceExecutionProvider")
    assert factory is None and "found no device" in why


def test_broken_metadata_leaves_the_builtin_cpu_provider(monkeypatch):
    def broken(group: str) -> list[tuple[str, str]]:
        raise OSError("unreadable site-packages")

    monkeypatch.setattr(loader, "installed_entry_points", broken)
    reg = PluginRegistry()
    assert reg.available_providers() == [CPU]


# ---------------------------------------------------------------------------------------------
# registration through the public API


def test_register_and_unregister(virt):
    assert ox.get_available_providers()[-2:] == [vd.NAME, CPU]
    assert vd.NAME in ox.get_all_providers()
    check_relu(relu_session([vd.NAME, CPU]))
    with pytest.raises(ox.errors.InvalidArgument, match="already registered"):
        ox.register_execution_provider_library(vd.NAME, VIRT_FACTORY)
    with pytest.raises(ox.errors.InvalidArgument, match="no execution provider library"):
        ox.unregister_execution_provider_library("NeverRegisteredExecutionProvider")


def test_unregistered_provider_is_gone():
    with registered(vd.NAME, VIRT_FACTORY):
        assert vd.NAME in ox.get_available_providers()
    assert vd.NAME not in ox.get_available_providers()
    with pytest.warns(UserWarning, match=f"Unknown execution provider '{vd.NAME}'"):
        assert relu_session([vd.NAME, CPU]).get_providers() == [CPU]


@pytest.mark.parametrize(
    ("target", "why"),
    [
        (f"{PKG}.no_such_module:create_factory", "No module named"),
        (f"{PKG}.broken_plugin:create_factory", "cannot open shared object file"),
        (f"{PKG}.bad_plugins:not_a_factory", "not an EpFactory"),
        (f"{PKG}.bad_plugins:FutureFactory", "upgrade onnxplug"),
        (f"{PKG}.bad_plugins:no_such_attribute", "has no no_such_attribute"),
    ],
)
def test_a_failed_registration_names_the_plugin_and_the_cpu_provider_keeps_working(target, why):
    name = "SomePluginExecutionProvider"
    with pytest.raises(ox.errors.Fail) as info:
        ox.register_execution_provider_library(name, target)
    assert f"'{name}'" in str(info.value) and why in str(info.value)
    assert name not in ox.get_provider_load_errors()
    assert CPU in ox.get_available_providers()
    check_relu(relu_session([CPU]))


def test_a_failed_override_of_the_builtin_cpu_provider_keeps_it(entry_points):
    entry_points()  # a source tree without installed entry points: CPU is the builtin
    reg = PluginRegistry()
    with pytest.raises(ox.errors.Fail, match="'CPUExecutionProvider'.*No module named"):
        reg.register(CPU, f"{PKG}.no_such_module:create_factory")
    factory, why = reg.find_factory(CPU)
    assert factory is not None and why == ""
    assert reg.available_providers() == [CPU]
    # overriding it with a working plugin is allowed
    reg.register(CPU, f"{PKG}.bad_plugins:NewerPluginFactory")
    assert reg.find_factory("NewerPluginExecutionProvider")[0] is not None


def test_a_plugin_written_for_a_newer_api_runs_on_this_host():
    name = "NewerPluginExecutionProvider"
    with registered(name, f"{PKG}.bad_plugins:NewerPluginFactory") as factory:
        assert factory.api_version > API_VERSION
        check_relu(relu_session([name, CPU]))
        assert factory.stats.snapshot()["op:Relu"] == 2


def test_reregistering_uses_the_new_factory_for_memory_and_copies():
    model = graphs.mlp()
    x = np.ones((2, 4), np.float32)
    with registered(vd.NAME, VIRT_FACTORY) as first:
        ox.InferenceSession(model, providers=[vd.NAME, CPU]).run(None, {"x": x})
    with registered(vd.NAME, VIRT_FACTORY) as second:
        before = first.stats.snapshot(), first.allocator.get_stats()["NumAllocs"]
        ox.InferenceSession(model, providers=[vd.NAME, CPU]).run(None, {"x": x})
        assert (first.stats.snapshot(), first.allocator.get_stats()["NumAllocs"]) == before
        assert second.stats.snapshot()["copies_d2h"] > 0
        assert second.allocator.get_stats()["NumAllocs"] > 0


# ---------------------------------------------------------------------------------------------
# EP devices and provider options


def test_ep_devices_describe_the_plugin_device(virt):
    (dev,) = [d for d in ox.get_ep_devices() if d.ep_name == vd.NAME]
    assert dev.ep_vendor == vd.provider.VENDOR
    assert dev.device.type == ox.OrtHardwareDeviceType.NPU
    assert dev.device.vendor_id == vd.provider.VENDOR_ID
    assert dev.ep_metadata == {"virt_device_id": "0"}
    assert dev.ep_options == {"device_id": "0"}
    # onnxruntime's OrtEpDevice.memory_info(memory type) method
    mem = dev.memory_info(ox.OrtDeviceMemoryType.DEFAULT)
    assert mem.name == "Virt" and str(mem.device) == "virt:0" and mem.device_id == 0
    assert dev.factory is virt
    (cpu,) = [d for d in ox.get_ep_devices() if d.ep_name == CPU]
    assert cpu.device.type == ox.OrtHardwareDeviceType.CPU
    # the CPU provider has no memory of its own, as in onnxruntime
    assert cpu.memory_info(ox.OrtDeviceMemoryType.DEFAULT) is None


def test_add_provider_for_devices_passes_options_as_session_config(virt):
    (dev,) = [d for d in ox.get_ep_devices() if d.ep_name == vd.NAME]
    so = ox.SessionOptions()
    so.add_session_config_entry("session.some_key", "some value")
    so.add_provider_for_devices([dev], {"ops": "Relu", "streams": "none"})
    sess = ox.InferenceSession(graphs.chain("Relu", 2), so)
    assert sess.get_providers() == [vd.NAME, CPU]
    config = virt.last_config
    assert config.get("ep.virtualdeviceexecutionprovider.ops") == "Relu"
    assert config.get("ep.virtualdeviceexecutionprovider.streams") == "none"
    assert config.get("session.some_key") == "some value"
    assert sess.get_provider_options()[vd.NAME]["streams"] == "none"
    check_relu(sess)
    assert virt.stats.snapshot()["streams"] == 0  # "none": the EP made no stream


def test_provider_options_by_name(virt):
    sess = relu_session([(vd.NAME, {"device_id": 0, "ops": "Relu"}), CPU])
    assert virt.last_config.get("ep.virtualdeviceexecutionprovider.device_id") == "0"
    assert {r["ep"] for r in sess.get_provider_graph_assignment_info()} == {vd.NAME}
    relu_session([vd.NAME, CPU], provider_options=[{"ops": "Add"}, {}])
    assert virt.last_config.get("ep.virtualdeviceexecutionprovider.ops") == "Add"
    with pytest.raises(ox.errors.InvalidArgument, match="device_id '3' is not one of"):
        relu_session([(vd.NAME, {"device_id": 3}), CPU])
    with pytest.raises(ox.errors.InvalidArgument, match=f"{vd.NAME}: streams must be one of"):
        relu_session([(vd.NAME, {"streams": "sometimes"}), CPU])


def test_ops_option_limits_what_the_plugin_claims(virt):
    sess = ox.InferenceSession(graphs.mlp(), providers=[(vd.NAME, {"ops": "MatMul"}), CPU])
    eps = {r["op_type"]: r["ep"] for r in sess.get_provider_graph_assignment_info()}
    assert eps["MatMul"] == vd.NAME and eps["Add"] == CPU and eps["Softmax"] == CPU


# ---------------------------------------------------------------------------------------------
# capability gating and the CPU fallback


def test_supports_needs_both_sides():
    assert supports(API_VERSION, "data_transfer")
    assert not supports(0, "data_transfer")  # a plugin older than the capability
    assert not supports(API_VERSION, "no_such_capability")
    assert all(1 <= v <= API_VERSION for v in CAPABILITIES.values())


def test_host_skips_callbacks_a_plugin_predates(monkeypatch):
    # a host one version ahead whose data-transfer callback is new in that version: a
    # version-1 plugin is not asked for it
    monkeypatch.setattr(ox.ep.api, "API_VERSION", API_VERSION + 1)
    monkeypatch.setitem(CAPABILITIES, "data_transfer", API_VERSION + 1)
    with registered(vd.NAME, VIRT_FACTORY) as factory:
        asked: list[int] = []
        monkeypatch.setattr(factory, "create_data_transfer", lambda: asked.append(1))
        relu_session([vd.NAME, CPU])
        assert asked == []
    monkeypatch.undo()
    with registered(vd.NAME, VIRT_FACTORY) as factory:
        asked = []
        monkeypatch.setattr(factory, "create_data_transfer", lambda: asked.append(1))
        relu_session([vd.NAME, CPU])
        assert asked == [1]


def test_without_cpu_fallback_an_unclaimed_op_is_an_error(virt):
    so = ox.SessionOptions()
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    with pytest.raises(ox.errors.NotImplemented, match="Tanh.*'Tanh_y'.*VirtualDevice"):
        ox.InferenceSession(graphs.chain("Tanh", 1), so, providers=[vd.NAME])
    sess = ox.InferenceSession(graphs.chain("Relu", 1), so, providers=[vd.NAME])
    assert sess.get_providers() == [vd.NAME]
    check_relu_chain = np.maximum(np.arange(-3, 3, dtype=np.float32).reshape(2, 3), 0)
    assert np.array_equal(
        sess.run(None, {"x": np.arange(-3, 3, dtype=np.float32).reshape(2, 3)})[0],
        check_relu_chain,
    )
    # with the fallback the host runs it
    sess = ox.InferenceSession(graphs.chain("Tanh", 1), providers=[vd.NAME])
    assert sess.get_providers() == [vd.NAME, CPU]


def test_the_virtual_device_plugin_sees_only_the_plugin_api():
    allowed = {"onnxplug.ep", "numpy"} | set(sys.stdlib_module_names)
    for path in Path(vd.__file__).parent.glob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom) and n.level == 0:
                names = [n.module or ""]
            elif isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert name in allowed or top in allowed - {"onnxplug"}, f"{path.name}: {name}"


def test_a_deferred_registry_is_built_once_on_its_first_query():
    from onnxplug.ep import DeferredKernelRegistry, Kernel, KernelRegistry

    builds = []

    def build() -> KernelRegistry:
        builds.append(1)
        reg = KernelRegistry("P")
        reg.kernel("Relu", since=6)(Kernel)
        return reg

    reg = DeferredKernelRegistry("P", build)
    assert reg.provider == "P" and not reg.built and not builds
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(reg.has_op("Relu"))) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 8 and builds == [1] and reg.built
    assert reg.lookup("Relu", "", 14) is not None and reg.lookup("Relu", "", 5) is None
    assert [d.op_type for d in reg.kernel_defs()] == ["Relu"]
    with pytest.raises(AttributeError):
        reg.no_such_attribute  # noqa: B018


def test_a_cpu_session_of_native_kernels_never_imports_onnx_reference():
    """onnx.reference's kernels (and the checked ones built on them) are registered when a
    query finds no native kernel: a session of native ops never imports it (~0.4 s)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import sys
        import numpy as np
        from onnx import TensorProto, helper
        import onnxplug as ox

        vi = helper.make_tensor_value_info
        g = helper.make_graph(
            [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("MatMul", ["r", "x"], ["y"])],
            "g", [vi("x", TensorProto.FLOAT, [2, 2])], [vi("y", TensorProto.FLOAT, [2, 2])],
        )
        s = ox.InferenceSession(helper.make_model(g).SerializeToString(),
                                providers=["CPUExecutionProvider"])
        s.run(None, {"x": np.ones((2, 2), np.float32)})
        print("onnx.reference.ops" in sys.modules)
        """
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert p.stdout.strip().splitlines()[-1] == "False"


def test_the_cpu_providers_deferred_registry_has_every_cpu_kernel():
    from onnxplug.ep import SessionConfig
    from onnxplug.providers.cpu.factory import CpuEpFactory
    from onnxplug.providers.cpu.kernels import cpu_registry, native_modules

    def registry():
        return CpuEpFactory().create_ep([], SessionConfig({})).get_kernel_registry()

    def keys(r):
        return sorted((d.domain, d.op_type, d.since_version) for d in r.kernel_defs())

    reg = registry()
    assert reg is registry()  # one per process
    assert keys(reg) == keys(cpu_registry())
    # the same kernels, in the same precedence, as registering onnx.reference's first
    from onnxplug.framework.kernel import KernelRegistry

    flat = KernelRegistry("CPUExecutionProvider")
    flat.merge(cpu_registry())
    assert keys(flat) == keys(reg)
    for d in flat.kernel_defs():
        for v in {d.since_version, d.end_version or d.since_version + 3}:
            want, got = flat.lookup(d.op_type, d.domain, v), reg.lookup(d.op_type, d.domain, v)
            assert (want is None) == (got is None) and (want is None or want[1] is got[1])
    assert len(reg.kernel_defs()) > 400
    # every native kernel module registered something, and the reference long tail is there
    assert len(native_modules()) > 15
    assert reg.has_op("Conv") and reg.has_op("Hardmax") and reg.has_op("If")


def test_warm_up_is_called_once_per_kernel_at_creation_and_a_failing_guess_is_ignored(
    monkeypatch,
):
    """``Kernel.warm_up`` runs when the session creates the kernel (before any run); one that
    raises does not fail the session: the run does the work."""
    from onnxplug.providers.cpu.kernels.activation import Relu

    calls: list[str] = []

    def warm_up(self) -> None:
        calls.append(self.info.name)
        raise RuntimeError("a guess that does not compile")

    monkeypatch.setattr(Relu, "warm_up", warm_up, raising=False)
    sess = relu_session([CPU])
    assert len(calls) == 2 and len(set(calls)) == 2  # the chain's two Relu nodes, once each
    check_relu(sess)
    check_relu(sess)
    assert len(calls) == 2  # runs do not call it
