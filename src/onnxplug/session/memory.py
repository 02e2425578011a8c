"""A session's allocators, shrinking and statistics; onnxruntime's allocator API
(``OrtMemoryInfo``, ``OrtArenaCfg``, ``create_and_register_allocator``).

A session takes one reference per (provider, device) to the allocator it runs with: the
provider's per-session allocator when it has one (an external allocator), the environment's
registered allocator with ``session.use_env_allocators=1``, otherwise the factory's shared
allocator for the device (one arena per device, shared by every session), created if needed
with the session's ``ep.<provider>.arena.*`` options over the environment's
``ep_factory.<factory>.arena.*``. The references are given back when the session goes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..ep.api import Ep, EpFactory
from ..errors import InvalidArgument
from ..framework.arena import EXTEND_STRATEGIES, BFCArena
from ..framework.memory import Allocator, Device, MemoryInfo
from .devices import OrtMemoryInfo
from .environment import Environment, get_environment

SHRINK_RUN_KEY = "memory.enable_memory_arena_shrinkage"
USE_ENV_ALLOCATORS_KEY = "session.use_env_allocators"


@dataclass
class _Held:
    ep: Ep
    device: Device
    memory_info: MemoryInfo
    allocator: Allocator
    owned_by: EpFactory | None  # the factory to give the reference back to (None: not ours)


class SessionAllocators:
    """The allocators of one session; ``allocator_for(ep, device)`` is what the build uses."""

    def __init__(self, env: Environment, use_env_allocators: bool = False):
        self.env = env
        self.use_env_allocators = use_env_allocators
        self._held: dict[tuple[int, Device], _Held] = {}
        self._lock = threading.Lock()
        self._shrink_specs: dict[str, list[tuple[str, int]]] = {}

    def allocator_for(self, ep: Ep, device: Device) -> Allocator:
        key = (id(ep), device)
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                return held.allocator
            mi = self.env.memory_info_for(ep.ep_device, device)
            owner: EpFactory | None = None
            alloc = ep.get_allocator(mi)
            if alloc is None:
                # with use_env_allocators the environment's registered allocator is used as
                # it is configured (the factory shares it): the session's options do not count
                env_only = self.use_env_allocators and self.env.registered_allocator(ep.factory, mi)
                options = None if env_only else ep.allocator_options(mi)
                alloc = self.env.create_allocator(ep.factory, mi, options)
                owner = ep.factory
            self._held[key] = _Held(ep, device, mi, alloc, owner)
            return alloc

    def release(self) -> None:
        """Give back the references this session took (the session is going)."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for h in held:
            if h.owned_by is not None:
                h.owned_by.release_allocator(h.allocator)

    # statistics and shrinking ---------------------------------------------------------------
    def _entries(self) -> list[tuple[str, _Held]]:
        with self._lock:
            held = list(self._held.values())
        out: list[tuple[str, _Held]] = []
        seen: dict[int, str] = {}
        for h in held:
            if id(h.allocator) in seen:
                continue
            name = str(h.device)
            if any(n == name for n, _ in out):  # two providers' allocators on one device
                name = f"{name} ({h.ep.name})"
            seen[id(h.allocator)] = name
            out.append((name, h))
        return out

    def stats(self) -> dict[str, dict[str, int]]:
        return {name: dict(h.allocator.get_stats()) for name, h in self._entries()}

    @contextlib.contextmanager
    def record_usage(self) -> Iterator[dict[str, list[tuple[float, int]]]]:
        """While the block runs, the bytes in use of every arena of the session after each
        allocation and free: ``{device: [(seconds since the start, bytes), ...]}``, from the
        start to the end of the block, filled in when it ends. Allocators that are not arenas
        record nothing."""
        arenas = [(n, h.allocator) for n, h in self._entries() if isinstance(h.allocator, BFCArena)]
        saved = [a.trace for _, a in arenas]
        traces: list[list[tuple[int, int]]] = []
        t0 = time.perf_counter_ns()
        for _, a in arenas:
            t = [(t0, a.get_stats()["InUse"])]
            traces.append(t)
            a.trace = t
        out: dict[str, list[tuple[float, int]]] = {}
        try:
            yield out
        finally:
            t1 = time.perf_counter_ns()
            for (name, a), prev, t in zip(arenas, saved, traces):
                a.trace = prev
                t.append((t1, a.get_stats()["InUse"]))
                out[name] = [((ns - t0) / 1e9, n) for ns, n in t]

    def shrink_targets(self, spec: str | None = None) -> list[Allocator]:
        """The allocators of the devices ``spec`` lists ("gpu:0;cpu:0", see
        ``parse_shrink_spec``), or all of them; a device the session does not use is an
        InvalidArgument."""
        entries = self._entries()
        if spec is None:
            return [h.allocator for _, h in entries]
        targets: list[Allocator] = []
        for dev_type, dev_id in self._parsed(spec):
            if dev_type == "cpu":
                continue  # host tensors are numpy arrays: there is no CPU arena to shrink
            hits = [h.allocator for _, h in entries if _matches(h, dev_type, dev_id)]
            if not hits:
                have = sorted({str(h.device) for _, h in entries})
                raise InvalidArgument(
                    f"{SHRINK_RUN_KEY}: this session has no allocator on '{dev_type}:"
                    f"{dev_id}'; its devices are {have or 'none (host memory only)'}"
                )
            targets.extend(a for a in hits if all(a is not t for t in targets))
        return targets

    def _parsed(self, spec: str) -> list[tuple[str, int]]:
        hit = self._shrink_specs.get(spec)
        if hit is None:
            hit = self._shrink_specs[spec] = parse_shrink_spec(spec)
        return hit


def parse_shrink_spec(spec: str) -> list[tuple[str, int]]:
    """``"cpu:0;gpu:0"`` -> ``[("cpu", 0), ("gpu", 0)]``. A device is ``cpu``, ``gpu`` (any
    GPU provider's device) or a device type of onnxplug (``cuda``, ...), then ``:`` and its
    id."""
    out: list[tuple[str, int]] = []
    for token in spec.split(";"):
        token = token.strip()
        if not token:
            continue
        dev_type, sep, dev_id = token.partition(":")
        dev_type = dev_type.strip().lower()
        try:
            n = int(dev_id.strip()) if sep else -1
        except ValueError:
            n = -1
        if not dev_type or n < 0:
            raise InvalidArgument(
                f"{SHRINK_RUN_KEY}: '{token}' is not a device; write 'type:id' entries "
                "separated by ';', e.g. 'cpu:0;gpu:0'"
            )
        out.append((dev_type, n))
    return out


def _matches(h: _Held, dev_type: str, dev_id: int) -> bool:
    d = h.device
    if d.id != dev_id:
        return False
    if d.type == dev_type:
        return True
    hw = h.ep.ep_device.device.type if h.ep.ep_device is not None else ""
    return dev_type == "gpu" and hw.upper() == "GPU" and not d.is_cpu


# onnxruntime's allocator API ------------------------------------------------------------------


# OrtArenaCfg field -> arena option key
_ARENA_CFG_KEYS = {
    "max_mem": "arena.max_mem",
    "arena_extend_strategy": "arena.extend_strategy",
    "initial_chunk_size_bytes": "arena.initial_chunk_size_bytes",
    "max_dead_bytes_per_chunk": "arena.max_dead_bytes_per_chunk",
    "initial_growth_chunk_size_bytes": "arena.initial_growth_chunk_size_bytes",
    "max_power_of_two_extend_bytes": "arena.max_power_of_two_extend_bytes",
    "use_cuda_mempool": "arena.use_cuda_mempool",
    "cuda_mempool_release_threshold": "arena.cuda_mempool_release_threshold",
    "cuda_mempool_bytes_to_keep_on_shrink": "arena.cuda_mempool_bytes_to_keep_on_shrink",
}


class OrtArenaCfg:
    """An arena configuration, as in onnxruntime: ``OrtArenaCfg(max_mem, arena_extend_strategy,
    initial_chunk_size_bytes, max_dead_bytes_per_chunk)`` or ``OrtArenaCfg({key: value})``.
    ``-1`` (``0`` for ``max_mem``) keeps the default."""

    # the fields onnxruntime's OrtArenaCfg has (ours also take the CUDA mempool keys)
    _KEYS = (
        "max_mem",
        "arena_extend_strategy",
        "initial_chunk_size_bytes",
        "max_dead_bytes_per_chunk",
        "initial_growth_chunk_size_bytes",
        "max_power_of_two_extend_bytes",
    )

    def __init__(self, *args: Any):
        self._values: dict[str, int] = {}
        if len(args) == 1 and isinstance(args[0], dict):
            for k, v in args[0].items():
                if k not in _ARENA_CFG_KEYS:
                    raise InvalidArgument(
                        f"OrtArenaCfg: unknown key '{k}'; known keys: {', '.join(_ARENA_CFG_KEYS)}"
                    )
                self._values[k] = _cfg_int(k, v)
        elif len(args) == 4:
            names = ("max_mem", "arena_extend_strategy", "initial_chunk_size_bytes")
            for k, v in zip((*names, "max_dead_bytes_per_chunk"), args):
                self._values[k] = _cfg_int(k, v)
        elif args:
            raise InvalidArgument(
                "OrtArenaCfg takes (max_mem, arena_extend_strategy, initial_chunk_size_bytes, "
                f"max_dead_bytes_per_chunk) or a dict, got {len(args)} arguments"
            )

    def __getattr__(self, name: str) -> int:
        if name in _ARENA_CFG_KEYS:
            return self._values.get(name, 0 if name in ("max_mem", "use_cuda_mempool") else -1)
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _ARENA_CFG_KEYS:
            self._values[name] = _cfg_int(name, value)
        else:
            super().__setattr__(name, value)

    def to_options(self) -> dict[str, str]:
        """The ``arena.*`` options of the values that are set (not -1; max_mem not 0)."""
        out = {}
        for k, v in self._values.items():
            if v == -1 or (k == "max_mem" and v == 0):
                continue
            out[_ARENA_CFG_KEYS[k]] = str(v)
        return out

    def __repr__(self) -> str:
        return f"OrtArenaCfg({self._values})"


def _cfg_int(key: str, value: Any) -> int:
    if isinstance(value, str) and key == "arena_extend_strategy" and value in EXTEND_STRATEGIES:
        return EXTEND_STRATEGIES[value]
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"OrtArenaCfg: '{key}' must be an integer, got {value!r}") from None


def _resolve(env: Environment, mem_info: OrtMemoryInfo) -> tuple[EpFactory, MemoryInfo] | None:
    """The factory and memory info that ``mem_info`` names (None: host memory)."""
    if mem_info.name.lower() == "cpu":
        return None
    for d in env.registry.ep_devices():
        if d.memory_info.name == mem_info.name and d.memory_info.device.id == mem_info.device_id:
            return d.factory, d.memory_info
        hm = d.host_accessible_memory_info
        if hm is not None and hm.name == mem_info.name and d.device.device_id == mem_info.device_id:
            return d.factory, hm
    names = sorted(
        {f"{d.memory_info.name}:{d.memory_info.device.id}" for d in env.registry.ep_devices()}
    )
    raise InvalidArgument(
        f"no execution provider offers memory '{mem_info.name}' on device {mem_info.device_id}; "
        f"known: Cpu:0, {', '.join(names)}"
    )


def create_and_register_allocator(mem_info: OrtMemoryInfo, arena_cfg: OrtArenaCfg | None) -> None:
    """Replace the environment's shared allocator for ``mem_info`` by one configured with
    ``arena_cfg`` (onnxruntime's ``CreateAndRegisterAllocator``). Sessions use it with
    ``session.use_env_allocators=1``; since a provider shares one arena per device, sessions
    created afterwards without that entry get it too. If sessions still hold the old arena,
    the provider keeps it and warns that the configuration was ignored.

    ``Cpu`` memory is accepted and its configuration validated, without effect: host tensors
    are numpy arrays."""
    create_and_register_allocator_v2("", mem_info, {}, arena_cfg)


def create_and_register_allocator_v2(
    provider_type: str,
    mem_info: OrtMemoryInfo,
    provider_options: dict[str, Any],
    arena_cfg: OrtArenaCfg | None,
) -> None:
    """``create_and_register_allocator`` for ``provider_type``'s memory; ``provider_options``
    may carry the provider's allocator options (``arena.*``, and for CUDA ``gpu_mem_limit``,
    ``arena_extend_strategy``), which ``arena_cfg`` overrides."""
    if not isinstance(mem_info, OrtMemoryInfo):
        raise InvalidArgument(
            f"create_and_register_allocator needs an OrtMemoryInfo, got {type(mem_info).__name__}"
        )
    env = get_environment()
    options = {str(k): str(v) for k, v in (provider_options or {}).items()}
    if arena_cfg is not None:
        options.update(arena_cfg.to_options())
    target = _resolve(env, mem_info)
    if target is None:
        from ..framework.arena import ArenaConfig

        ArenaConfig.from_options(
            {k: v for k, v in options.items() if k in _ARENA_CFG_KEYS.values()},
            "create_and_register_allocator(Cpu)",
            frozenset(k for k in _ARENA_CFG_KEYS.values() if "cuda" in k),
        )
        return
    factory, mi = target
    if provider_type and provider_type != factory.name:
        raise InvalidArgument(
            f"create_and_register_allocator_v2: memory '{mem_info.name}' belongs to "
            f"{factory.name}, not {provider_type}"
        )
    env.ensure_transfer(factory)
    env.register_allocator(factory, mi, options)


__all__ = [
    "SHRINK_RUN_KEY",
    "OrtArenaCfg",
    "SessionAllocators",
    "create_and_register_allocator",
    "create_and_register_allocator_v2",
    "parse_shrink_spec",
]
