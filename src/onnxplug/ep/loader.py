"""Finding, loading and registering provider plugins.

Plugins come from the entry-point group ``onnxplug.execution_providers`` (``name =
"package.module:factory"``) or from ``register_execution_provider_library(name, target)``.
A target resolves to an ``EpFactory`` instance, an ``EpFactory`` subclass or a callable that
returns one. A plugin that fails to import, has the wrong shape or needs a newer host API is
recorded with a clear message naming it; every other provider keeps working.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from ..errors import Fail, InvalidArgument
from .api import API_VERSION, CPU_HARDWARE, EpDevice, EpFactory

ENTRY_POINT_GROUP = "onnxplug.execution_providers"
# The CPU provider ships in the core distribution; it is found by name like any other plugin,
# so that running from a source tree without installed entry points still has it.
_BUILTIN = {"CPUExecutionProvider": "onnxplug.providers.cpu:create_factory"}

# onnxruntime's provider names (``onnxruntime.get_all_providers()``), CPU last: every name a
# script written for onnxruntime may ask for, whether or not a plugin here provides it.
ONNXRUNTIME_PROVIDERS = (
    "TensorrtExecutionProvider",
    "CUDAExecutionProvider",
    "MIGraphXExecutionProvider",
    "OpenVINOExecutionProvider",
    "DnnlExecutionProvider",
    "VitisAIExecutionProvider",
    "QNNExecutionProvider",
    "NnapiExecutionProvider",
    "VSINPUExecutionProvider",
    "JsExecutionProvider",
    "CoreMLExecutionProvider",
    "DmlExecutionProvider",
    "RknpuExecutionProvider",
    "WebNNExecutionProvider",
    "WebGpuExecutionProvider",
    "XnnpackExecutionProvider",
    "CANNExecutionProvider",
    "AzureExecutionProvider",
    "CPUExecutionProvider",
)
# How to get a provider that is not installed.
_INSTALL_HINTS = {
    "CUDAExecutionProvider": (
        "install the CUDA plugin (`pip install onnxplug-cuda`, or `pip install -e plugins/cuda` "
        "in a source checkout) on a machine with an NVIDIA GPU and driver"
    ),
}


# installed entry points ----------------------------------------------------------------------
#
# ``importlib.metadata.entry_points(group=...)`` reads and parses every distribution's
# entry_points.txt and builds EntryPoint objects for all of them before selecting the group:
# ~24-39 ms of a ResNet-50 session's creation on a host with 201 installed distributions.
# ``installed_entry_points`` gives the same (name, value) pairs, in the same order, by listing
# each sys.path directory once and parsing only the entry_points.txt files that name the group.
# It mirrors importlib.metadata of CPython 3.11-3.13 (identical in all that matters here;
# other versions take the slow path):
#
# - distributions come from every ``sys.meta_path`` finder's ``find_distributions``; only the
#   stdlib ``PathFinder`` (MetadataPathFinder: FastPath/Lookup) is mirrored, so any other finder
#   that has one (the importlib_metadata backport installs its own, and deletes PathFinder's)
#   means the slow path;
# - per sys.path entry, Lookup keeps the children whose lower-cased name ends in ".dist-info" or
#   ".egg-info" (files too: a distutils "foo.egg-info" file is a distribution without entry
#   points), grouped by normalized name in order of first appearance, each group in listing
#   order (not dist-info before egg-info), then an ``*.egg`` entry's EGG-INFO (slow path:
#   its name comes from PKG-INFO); a zip or other file on sys.path means the slow path;
# - ``_unique`` keeps the first distribution of each ``_normalized_name``: the stem's name
#   (``_name_from_stem``) normalized, or the METADATA Name where the stem gives none (an
#   extension not spelled exactly ".dist-info"/".egg-info", an empty name: slow path);
# - Sectioned: stripped lines, blank lines and lines starting with "#" skipped (not ";": a
#   ";" line is an entry like any other), "[name]" headers (``strip("[]")``), lines before the
#   first header ignored, entries split at the first "=" and stripped.
#
# Accepted difference: importlib.metadata raises (TypeError) when any kept distribution's
# entry_points.txt has a line without "=" inside a section; here only the files that name the
# group are parsed, so such a line elsewhere goes unnoticed (in a file naming the group it
# raises ValueError). Either way the registry treats an exception as "no entry points".
# A missing entry_points.txt is told by ``os.access`` (no exception raised: most distributions
# have none), so one that cannot be reached for another reason than PermissionError (a symlink
# loop, say), which importlib.metadata raises, is skipped here. importlib.metadata's FastPath
# also caches a directory's listing by its mtime; this reads it afresh every time.

_MIRRORED_PYTHON = (3, 11) <= sys.version_info[:2] <= (3, 13)
_INFO_SUFFIXES = (".dist-info", ".egg-info")


def installed_entry_points(group: str) -> list[tuple[str, str]]:
    """(name, value) of the installed entry points in ``group``, in the order and with the
    de-duplication of ``importlib.metadata.entry_points(group=group)``."""
    found = _scan_entry_points(group)
    if found is None:  # the fast scan cannot be sure to match: ask importlib.metadata
        found = [(ep.name, ep.value) for ep in metadata.entry_points(group=group)]
    return found


def _only_stdlib_distribution_finder() -> bool:
    """Whether importlib.metadata's distributions all come from the stdlib PathFinder."""
    path_finder = False
    for finder in sys.meta_path:
        find = getattr(finder, "find_distributions", None)
        if not find:  # importlib.metadata skips these too (BuiltinImporter, pytest's hook...)
            continue
        if (
            finder is not importlib.machinery.PathFinder
            or getattr(find, "__qualname__", None) != "PathFinder.find_distributions"
            or getattr(find, "__module__", None)
            not in ("_frozen_importlib_external", "importlib._bootstrap_external")
        ):
            return False
        path_finder = True
    return path_finder


_SEPARATORS = re.compile(r"[-_.]+")


def _normalize(name: str) -> str:
    # importlib.metadata.Prepared.normalize
    return _SEPARATORS.sub("-", name).lower().replace("-", "_")


def _scan_entry_points(group: str) -> list[tuple[str, str]] | None:
    """The fast scan; None where it cannot be sure to match importlib.metadata."""
    if not _MIRRORED_PYTHON or not _only_stdlib_distribution_finder():
        return None
    header = f"[{group}]"
    seen: set[str] = set()
    out: list[tuple[str, str]] = []
    roots: set[str] = set()
    for root in list(sys.path):
        if not isinstance(root, str):
            return None
        if root in roots:  # a repeated entry adds no distribution that is not seen already
            continue
        roots.add(root)
        try:
            children = os.listdir(root or ".")
        except Exception:
            if os.path.exists(root) and not os.path.isdir(root):
                return None  # a zip (or other file) on sys.path: importlib.metadata reads zips
            continue  # missing or unreadable: importlib.metadata finds nothing there either
        prefix = os.path.join(root, "")  # "root/", or "" for the current directory
        base_is_egg = os.path.basename(root).lower().endswith(".egg")
        # Lookup.infos: grouped by normalized name, groups in order of first appearance; only
        # each group's first member can survive _unique, so that is all that is kept
        firsts: dict[str, str] = {}
        for child in children:
            low = child.lower()
            if low.endswith(_INFO_SUFFIXES):
                stem, ext = os.path.splitext(child)  # PathDistribution._name_from_stem
                key = _normalize(stem.partition("-")[0]) if ext in _INFO_SUFFIXES else ""
                if not key:
                    return None  # _normalized_name would come from METADATA's Name
                firsts.setdefault(key, child)
            elif base_is_egg and low == "egg-info":
                return None  # an .egg directory's EGG-INFO: named by its PKG-INFO
        for key, child in firsts.items():
            if key in seen:
                continue
            seen.add(key)
            path = f"{prefix}{child}/entry_points.txt"
            # most distributions have none: os.access says so without raising an exception
            if not os.access(path, os.F_OK):
                continue
            try:  # PathDistribution.read_text
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError):
                continue
            if header in text:
                out += _parse_group(text, group, path)
    return out


def _parse_group(text: str, group: str, path: str) -> list[tuple[str, str]]:
    """The entries of ``group`` in an entry_points.txt, as importlib.metadata's Sectioned
    reads it."""
    out: list[tuple[str, str]] = []
    section: str | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line.strip("[]")
            continue
        if section is None:
            continue
        name, eq, value = line.partition("=")
        if not eq:
            raise ValueError(f"{path}: entry point line without '=': {line!r}")
        if section == group:
            out.append((name.strip(), value.strip()))
    return out


@dataclass
class RegisteredLibrary:
    name: str
    target: str
    factory: EpFactory | None = None
    error: str | None = None
    devices: list[EpDevice] = field(default_factory=list)
    source: str = "registered"  # "entry_point" | "builtin" | "registered"


class PluginRegistry:
    def __init__(self) -> None:
        self._libs: dict[str, RegisteredLibrary] = {}
        self._lock = threading.RLock()
        self._discovered = False
        self._unload_listeners: list[Callable[[EpFactory], None]] = []

    def add_unload_listener(self, fn: Callable[[EpFactory], None]) -> None:
        """Call ``fn(factory)`` when a loaded factory is unregistered or replaced, so that
        whoever holds its allocators and data transfer lets go of them."""
        with self._lock:
            self._unload_listeners.append(fn)

    def _unloaded(self, lib: RegisteredLibrary | None) -> None:
        if lib is not None and lib.factory is not None:
            for fn in list(self._unload_listeners):
                fn(lib.factory)

    # discovery ------------------------------------------------------------------------------
    def _discover(self) -> None:
        if self._discovered:
            return
        with self._lock:
            if self._discovered:
                return
            self._discovered = True
            try:
                eps = installed_entry_points(ENTRY_POINT_GROUP)
            except Exception:  # broken metadata must not break the runtime
                eps = []
            for name, target in eps:
                if name not in self._libs:
                    self._load(name, target, "entry_point")
            for name, target in _BUILTIN.items():
                if name not in self._libs or self._libs[name].factory is None:
                    self._load(name, target, "builtin")

    def _load(self, name: str, target: str, source: str) -> RegisteredLibrary:
        lib = RegisteredLibrary(name, target, source=source)
        try:
            factory = _resolve_factory(name, target)
            _check_factory(name, factory)
            lib.factory = factory
            lib.devices = list(factory.get_supported_devices([CPU_HARDWARE]))
            for d in lib.devices:
                d.factory = factory
        except Exception as e:  # record, never propagate: other providers keep working
            lib.error = f"execution provider plugin '{name}' ({target}) failed to load: {e}"
        self._libs[name] = lib
        return lib

    # public -----------------------------------------------------------------------------------
    def register(self, name: str, target: str) -> None:
        self._discover()
        with self._lock:
            existing = self._libs.get(name)
            if (
                existing is not None
                and existing.factory is not None
                and existing.source != "builtin"
            ):
                raise InvalidArgument(
                    f"an execution provider library is already registered as '{name}'"
                )
            lib = self._load(name, target, "registered")
            if lib.error:
                # keep what was there (the builtin CPU provider, say) working
                if existing is not None:
                    self._libs[name] = existing
                else:
                    del self._libs[name]
                raise Fail(lib.error)
            self._unloaded(existing)

    def unregister(self, name: str) -> None:
        self._discover()
        with self._lock:
            if name not in self._libs:
                raise InvalidArgument(f"no execution provider library is registered as '{name}'")
            self._unloaded(self._libs.pop(name))

    def libraries(self) -> list[RegisteredLibrary]:
        self._discover()
        with self._lock:
            return list(self._libs.values())

    def ep_devices(self) -> list[EpDevice]:
        return [d for lib in self.libraries() if lib.factory for d in lib.devices]

    def available_providers(self) -> list[str]:
        """Names of loaded providers that have at least one device, CPU last."""
        names = [lib.factory.name for lib in self.libraries() if lib.factory and lib.devices]
        names = list(dict.fromkeys(names))
        if "CPUExecutionProvider" in names:
            names.remove("CPUExecutionProvider")
            names.append("CPUExecutionProvider")
        return names

    def find_factory(self, provider_name: str) -> tuple[EpFactory | None, str]:
        """(factory, "") or (None, why it cannot be used and how to get it)."""
        for lib in self.libraries():
            if lib.factory is not None and lib.factory.name == provider_name:
                if not lib.devices:
                    reason = lib.factory.unavailable_reason()
                    return None, (
                        f"execution provider '{provider_name}' is installed but found no device "
                        f"it can use on this machine{f': {reason}' if reason else ''}"
                    )
                return lib.factory, ""
        for lib in self.libraries():
            if lib.name == provider_name and lib.error:
                return None, lib.error
        hint = _INSTALL_HINTS.get(provider_name)
        if hint is not None:
            return None, f"'{provider_name}' is not installed: {hint}"
        if provider_name in ONNXRUNTIME_PROVIDERS:
            return None, f"'{provider_name}' is onnxruntime's, and no onnxplug plugin provides it"
        return None, f"Unknown execution provider '{provider_name}'"

    def all_providers(self) -> list[str]:
        """onnxruntime's provider names and every plugin's, CPU last."""
        names = [lib.factory.name if lib.factory else lib.name for lib in self.libraries()]
        out = [n for n in ONNXRUNTIME_PROVIDERS if n != "CPUExecutionProvider"]
        out += [n for n in dict.fromkeys(names) if n not in ONNXRUNTIME_PROVIDERS]
        return [*out, "CPUExecutionProvider"]

    def devices_of(self, factory: EpFactory) -> list[EpDevice]:
        for lib in self.libraries():
            if lib.factory is factory:
                return lib.devices
        return []


def _resolve_factory(name: str, target: str) -> EpFactory:
    if not isinstance(target, str) or not target:
        raise InvalidArgument(f"plugin '{name}': target must be 'package.module:factory'")
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    candidates = [attr] if attr else ["create_factory", "create_ep_factory", "factory"]
    obj: Any = None
    for a in candidates:
        obj = module
        try:
            for part in a.split("."):
                obj = getattr(obj, part)
            break
        except AttributeError:
            obj = None
    if obj is None:
        raise AttributeError(f"module '{module_name}' has no {' or '.join(candidates)}")
    if isinstance(obj, EpFactory):
        return obj
    if callable(obj):
        made = obj()
        if isinstance(made, EpFactory):
            return made
        raise TypeError(f"'{target}' returned {type(made).__name__}, not an EpFactory")
    raise TypeError(f"'{target}' is {type(obj).__name__}, not an EpFactory or a callable")


def _check_factory(name: str, factory: EpFactory) -> None:
    for attr in ("name", "get_supported_devices", "create_ep"):
        if not getattr(factory, attr, None):
            raise TypeError(f"the factory has no '{attr}'")
    need = int(getattr(factory, "min_host_api_version", 1))
    if need > API_VERSION:
        raise RuntimeError(
            f"it needs plugin API version {need} but this onnxplug provides version "
            f"{API_VERSION}; upgrade onnxplug"
        )


REGISTRY = PluginRegistry()
