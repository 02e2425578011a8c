"""Tuning results: onnxruntime's TunableOp results (``TuningResults``), as a provider keeps them
and as ``InferenceSession.get_tuning_results()`` / ``set_tuning_results()`` exchange them.

One provider's results are a dict ``{"ep": <provider name>, "results": {op signature:
{params signature: kernel id}}, "validators": {key: value}}``. The validators say what the
results hold for (this runtime's version, the device, the libraries); results whose validators
do not match the running ones are refused, with onnxruntime's messages. A provider that tunes
has a ``TuningContext`` (``Ep.get_tuning_context()``): the results it tuned, found or was given
(a ``TuningResultsManager``), the validators it registered, and what enabling TunableOp means
for it.
"""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from .._version import __version__

KernelMap = dict[str, int]

# validators every provider's results carry (onnxruntime's ``mandatory_keys``; this runtime has
# no git commit or build configuration to offer, so the version is the one key)
MANDATORY_VALIDATORS = ("ORT_VERSION",)


class TuningResultsManager:
    """Thread-safe ``{op signature: {params signature: kernel id}}`` store. A signature keeps
    the first kernel id it was given: a different id for it later is ignored with a warning
    (onnxruntime's ``TuningResultsManager``)."""

    def __init__(self) -> None:
        self._results: dict[str, KernelMap] = {}
        self._lock = threading.Lock()

    def lookup(self, op_signature: str, params_signature: str) -> int:
        """The kernel id kept for the pair, or -1."""
        with self._lock:
            return self._results.get(op_signature, {}).get(params_signature, -1)

    def add(self, op_signature: str, params_signature: str, kernel_id: int) -> int:
        """Keep ``kernel_id`` for the pair unless it has one; returns the id it now has."""
        with self._lock:
            return self._add(op_signature, params_signature, int(kernel_id))

    def _add(self, op_signature: str, params_signature: str, kernel_id: int) -> int:
        kernels = self._results.setdefault(op_signature, {})
        held = kernels.setdefault(params_signature, kernel_id)
        if held != kernel_id:
            warnings.warn(
                f"tuning results: {op_signature}({params_signature}) already has kernel "
                f"id={held}; the new id={kernel_id} is ignored",
                RuntimeWarning,
                stacklevel=3,
            )
        return held

    def load(self, results: Mapping[str, Mapping[str, int]]) -> None:
        """Merge ``results`` in; pairs that already have an id keep it."""
        with self._lock:
            for op_signature, kernels in results.items():
                for params_signature, kernel_id in kernels.items():
                    self._add(op_signature, params_signature, kernel_id)

    def dump(self) -> dict[str, KernelMap]:
        with self._lock:
            return copy.deepcopy(self._results)


class TuningContext:
    """A provider's TunableOp state (onnxruntime's ``ITuningContext``): its name, its results
    (``manager``, which may be shared by the provider's instances on one device) and its
    validators, each a getter of the running value, which a given value must equal. Providers
    register their own validators and override ``enable_tunable_op``."""

    def __init__(self, ep_name: str, manager: TuningResultsManager):
        self.ep_name = ep_name
        self.manager = manager
        self._validators: dict[str, tuple[Callable[[], str], str]] = {}
        self.register_validator("ORT_VERSION", lambda: __version__, "onnxplug version mismatch")

    def register_validator(self, key: str, getter: Callable[[], str], mismatch: str) -> None:
        """Add validator ``key``: a given value must equal ``getter()``; where it does not, the
        reason is ``mismatch`` with both values."""
        if key in self._validators:
            raise ValueError(f"tuning results validator {key!r} is already registered")
        self._validators[key] = (getter, mismatch)

    def validators(self) -> dict[str, str]:
        return {key: getter() for key, (getter, _) in self._validators.items()}

    def validate(self, given: Mapping[str, Any]) -> str | None:
        """Why results with validators ``given`` cannot be used here (None: they can)."""
        problems = []
        for key in MANDATORY_VALIDATORS:
            if key not in given:
                problems.append(f'key="{key}" is not provided for validation.')
        if problems:
            return " ".join(problems)
        for key in sorted(self._validators):
            if key not in given:
                problems.append(
                    f'Unmatched validator: "{key}" is required, but the tuning results does '
                    "not provide it."
                )
        for key in sorted(given):
            if key not in self._validators:
                problems.append(
                    f'Unmatched validator: "{key}" is provided, but onnxplug is unable to '
                    "consume it."
                )
        if problems:
            return " ".join(problems)
        for key, value in given.items():
            getter, mismatch = self._validators[key]
            current = getter()
            if str(value) != current:
                return (
                    f"{mismatch}: tuning results produced with {value!r}, running with {current!r}"
                )
        return None

    def get_tuning_results(self) -> dict[str, Any]:
        return {
            "ep": self.ep_name,
            "results": self.manager.dump(),
            "validators": self.validators(),
        }

    def load_tuning_results(self, tuning_results: Mapping[str, Any]) -> str | None:
        """Load one provider's results after checking them; the reason they were refused, or
        None once loaded."""
        if tuning_results.get("ep") != self.ep_name:
            return "EP mismatch"
        reason = self.validate(tuning_results.get("validators") or {})
        if reason is not None:
            return reason
        self.manager.load(tuning_results.get("results") or {})
        return None

    def enable_tunable_op(self) -> None:
        """Use the results (results embedded in a model turn TunableOp on, as in onnxruntime);
        a provider whose kernels read them only when enabled overrides this."""


def check_tuning_results(value: Any) -> list[dict[str, Any]]:
    """``value`` as a list of results dicts, or a ``ValueError`` naming what is malformed
    (the shape ``set_tuning_results`` and a model's ``tuning_results`` metadata must have)."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"tuning results must be a list of dicts, got {type(value).__name__}")
    out = []
    for i, tr in enumerate(value):
        if not isinstance(tr, Mapping):
            raise ValueError(f"tuning results (index={i}) must be a dict, got {type(tr).__name__}")
        for key in ("ep", "results", "validators"):
            if key not in tr:
                raise ValueError(f"tuning results (index={i}) have no {key!r}")
        if not isinstance(tr["ep"], str):
            raise ValueError(f"tuning results (index={i}): 'ep' must be a provider name")
        if not isinstance(tr["validators"], Mapping):
            raise ValueError(f"tuning results (index={i}): 'validators' must be a dict")
        results = tr["results"]
        if not isinstance(results, Mapping) or not all(
            isinstance(op, str)
            and isinstance(kernels, Mapping)
            and all(
                isinstance(p, str) and isinstance(k, int) and not isinstance(k, bool)
                for p, k in kernels.items()
            )
            for op, kernels in results.items()
        ):
            raise ValueError(
                f"tuning results (index={i}): 'results' must map op signatures to dicts of "
                "params signature -> kernel id (an int)"
            )
        out.append(
            {
                "ep": tr["ep"],
                "results": {op: dict(kernels) for op, kernels in results.items()},
                "validators": {str(k): str(v) for k, v in tr["validators"].items()},
            }
        )
    return out
