"""IOBinding: bind inputs and outputs to values on any device, then run without host copies."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import Fail, InvalidArgument
from ..framework.control_flow import place
from ..framework.executor import FETCH_DEVICE, FETCH_HOST
from ..framework.memory import CPU, DeviceTensor
from ..framework.stream import device_of
from .value import OrtValue, _as_dtype, import_dlpack, to_numpy, unwrap


class IOBinding:
    def __init__(self, session: Any):
        self._session = session
        self._inputs: dict[str, Any] = {}
        self._outputs: dict[str, Any] = {}  # name -> OrtValue (preallocated) or a Device
        self._results: list[OrtValue] = []

    # inputs ---------------------------------------------------------------------------------
    def bind_cpu_input(self, name: str, arr_on_cpu: Any) -> None:
        """Bind a host array; an object with ``__dlpack__`` (a PyTorch CPU tensor, say) is
        bound in place, like a numpy array."""
        if hasattr(arr_on_cpu, "__dlpack__") and not isinstance(arr_on_cpu, np.ndarray):
            self._inputs[name] = import_dlpack(arr_on_cpu)
            return
        self._inputs[name] = np.asarray(arr_on_cpu)

    def bind_input(
        self,
        name: str,
        device_type: str,
        device_id: int,
        element_type: Any,
        shape: Any,
        buffer_ptr: int,
    ) -> None:
        dt = _as_dtype(element_type)
        shape = tuple(int(d) for d in shape)
        if device_type.lower() == "cpu":
            from ..framework.memory import host_view

            self._inputs[name] = host_view(int(buffer_ptr), shape, dt, None)
            return
        d = self._session._env.find_device(device_type, device_id)
        self._inputs[name] = DeviceTensor(d.memory_info.device, dt, shape, int(buffer_ptr), None)

    def bind_ortvalue_input(self, name: str, ortvalue: OrtValue) -> None:
        self._inputs[name] = unwrap(ortvalue)

    def clear_binding_inputs(self) -> None:
        self._inputs.clear()

    def synchronize_inputs(self) -> None:
        for ep in self._session._eps:
            ep.sync()

    # outputs --------------------------------------------------------------------------------
    def bind_output(
        self,
        name: str,
        device_type: str = "cpu",
        device_id: int = 0,
        element_type: Any = None,
        shape: Any = None,
        buffer_ptr: int | None = None,
    ) -> None:
        self._check_output(name)
        if buffer_ptr is not None:
            if element_type is None or shape is None:
                raise InvalidArgument(
                    f"bind_output('{name}'): a buffer needs element_type and shape"
                )
            dt = _as_dtype(element_type)
            shape = tuple(int(d) for d in shape)
            if device_type.lower() == "cpu":
                from ..framework.memory import host_view

                self._outputs[name] = OrtValue(host_view(int(buffer_ptr), shape, dt, None))
            else:
                d = self._session._env.find_device(device_type, device_id)
                self._outputs[name] = OrtValue(
                    DeviceTensor(d.memory_info.device, dt, shape, int(buffer_ptr), None)
                )
            return
        if device_type.lower() == "cpu":
            self._outputs[name] = CPU
        else:
            self._outputs[name] = self._session._env.find_device(
                device_type, device_id
            ).memory_info.device

    def bind_ortvalue_output(self, name: str, ortvalue: OrtValue) -> None:
        self._check_output(name)
        self._outputs[name] = ortvalue

    def _check_output(self, name: str) -> None:
        if name not in self._session._output_index:
            raise InvalidArgument(
                f"Invalid output name: {name}. The model's outputs are {self._session._output_names}"
            )

    def clear_binding_outputs(self) -> None:
        self._outputs.clear()
        self._results = []

    def synchronize_outputs(self) -> None:
        """Nothing is left to wait for: every run ends by synchronising its streams (as
        onnxruntime's runs do by default), so the outputs are complete when
        ``run_with_iobinding`` returns. onnxruntime synchronises the whole device here;
        onnxplug does not, so this never waits for other threads' runs nor interrupts their
        CUDA graph captures."""

    def get_outputs(self) -> list[OrtValue]:
        return list(self._results)

    def get_outputs_as_ortvaluevector(self) -> list[OrtValue]:
        return list(self._results)

    def copy_outputs_to_cpu(self) -> list[Any]:
        return [to_numpy(unwrap(v)) for v in self._results]

    # running --------------------------------------------------------------------------------
    def _run(self, run_options: Any) -> None:
        sess = self._session
        if not self._outputs:  # onnxruntime's words
            raise Fail("Error in execution: At least one output should be requested.")
        feeds = sess._prepare_feeds(self._inputs)
        names = list(self._outputs) or sess._output_names
        fetch: list[Any] = [None] * len(sess._output_names)
        for name in names:
            target = self._outputs.get(name)
            i = sess._output_index[name]
            if isinstance(target, OrtValue):
                fetch[i] = unwrap(target)  # the run copies the output into the bound value
            elif target is not None and target.is_cpu:
                fetch[i] = FETCH_HOST
            else:
                fetch[i] = FETCH_DEVICE
        outs = sess._run_values(feeds, run_options, fetch)
        results: list[OrtValue] = []
        for name in names:
            v = outs[sess._output_index[name]]
            target = self._outputs.get(name)
            if isinstance(target, OrtValue):
                results.append(target)
            elif target is not None and not isinstance(v, list) and device_of(v) != target:
                allocs = sess._allocators_for(target)
                results.append(OrtValue(place(v, target, sess._env.transfer, allocs)))
            else:
                results.append(OrtValue(v))
        self._results = results


SessionIOBinding = IOBinding
