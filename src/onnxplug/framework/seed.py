"""The process-wide random seed (``onnxplug.set_seed``, onnxruntime's ``set_seed``).

Random ops without a ``seed`` attribute (RandomNormal, RandomUniform, Bernoulli, Multinomial,
training-mode Dropout) take this seed when their kernel is created, as onnxruntime's do, so that
their draws repeat from session to session; with no seed set they draw from OS entropy.
"""

from __future__ import annotations

_seed: int | None = None


def set_seed(seed: int) -> None:
    global _seed
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"set_seed takes an int, not {seed!r}")
    _seed = int(seed) & 0xFFFFFFFF  # numpy seeds are 32-bit


def node_seed(attr_seed: object = None) -> int | None:
    """The seed a random op's kernel uses: its ``seed`` attribute, else the global one."""
    if attr_seed is not None:
        return int(attr_seed)  # type: ignore[call-overload]
    return _seed
