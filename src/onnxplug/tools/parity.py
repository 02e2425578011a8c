"""Operator parity: which ONNX ops and opset versions each provider's kernel registry covers.

The spec side comes from ``onnx.defs.get_all_schemas_with_history()`` of the installed onnx:
every op of a domain with each *schema version* (the ``since_version`` at which the op last
changed; schema version ``v`` serves opsets ``v`` up to the next schema version minus one).
The provider side is the ``KernelRegistry`` its EP returns from ``get_kernel_registry()``.

A schema version is

* ``kernel``: the provider registers a kernel whose opset range includes it (this is exactly
  the version check the partitioner makes; type constraints are not checked here, because
  they depend on the model's tensor types);
* ``function``: no kernel, but the schema has a function body that the partitioner expands
  into other ops when no provider claims the node;
* ``missing``: neither. A node of that version cannot run on this provider.

Deprecated schema versions (onnx keeps e.g. ``Upsample-10`` only to reject it) are listed but
not counted. The logic works for any registered provider plugin: it only needs the factory to
create an EP for one of its devices, so it can ask for the registry.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import onnx
import onnx.defs

from ..ep.api import EpFactory, KernelDef, KernelRegistry, SessionConfig
from ..ep.loader import REGISTRY

KERNEL = "kernel"
FUNCTION = "function"
MISSING = "missing"


@dataclass
class OpParity:
    """One op of the spec against one provider."""

    op_type: str
    schema_versions: list[int]  # non-deprecated, ascending
    deprecated_versions: list[int]
    kernel_ranges: list[tuple[int, int | None]]  # merged opset ranges of the provider's kernels
    version_status: dict[int, str]  # schema version -> kernel | function | missing

    @property
    def gaps(self) -> list[int]:
        """Schema versions without a kernel (function-expandable ones included)."""
        return [v for v in self.schema_versions if self.version_status[v] != KERNEL]

    @property
    def status(self) -> str:
        """'full' (a kernel for every version), 'none' (no kernel at all) or 'partial'."""
        with_kernel = sum(1 for v in self.schema_versions if self.version_status[v] == KERNEL)
        if with_kernel == len(self.schema_versions):
            return "full"
        return "none" if with_kernel == 0 else "partial"


@dataclass
class ProviderParity:
    """Every op of one domain against one provider's kernel registry."""

    provider: str
    domain: str
    onnx_version: str
    max_opset: int
    ops: list[OpParity] = field(default_factory=list)
    extra_ops: list[str] = field(default_factory=list)  # kernels for ops the spec lacks
    error: str | None = None  # why the registry could not be read

    def totals(self) -> dict[str, Any]:
        versions = [op.version_status[v] for op in self.ops for v in op.schema_versions]
        n = len(versions)
        kernel = versions.count(KERNEL)
        statuses = [op.status for op in self.ops]
        return {
            "ops": len(self.ops),
            "ops_full": statuses.count("full"),
            "ops_partial": statuses.count("partial"),
            "ops_none": statuses.count("none"),
            "schema_versions": n,
            "versions_kernel": kernel,
            "versions_function": versions.count(FUNCTION),
            "versions_missing": versions.count(MISSING),
            "kernel_pct": round(100.0 * kernel / n, 1) if n else 0.0,
        }

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["totals"] = self.totals()
        for op, src in zip(d["ops"], self.ops):
            op["status"] = src.status
            op["gaps"] = src.gaps
        return d


def spec_schemas(domain: str = "") -> dict[str, list[Any]]:
    """The installed onnx's schemas of ``domain`` ('' = ai.onnx), by op, oldest first."""
    want = {"", "ai.onnx"} if domain in ("", "ai.onnx") else {domain}
    by_op: dict[str, list[Any]] = {}
    for s in onnx.defs.get_all_schemas_with_history():
        if s.domain in want:
            by_op.setdefault(s.name, []).append(s)
    for schemas in by_op.values():
        schemas.sort(key=lambda s: s.since_version)
    return dict(sorted(by_op.items()))


def max_opset(domain: str = "") -> int:
    if domain in ("", "ai.onnx"):
        return onnx.defs.onnx_opset_version()
    versions = [
        s.since_version for schemas in spec_schemas(domain).values() for s in schemas
    ]  # a domain's opset is at least the newest schema version in it
    return max(versions, default=1)


def merge_ranges(defs: Iterable[KernelDef]) -> list[tuple[int, int | None]]:
    """The union of the kernels' ``[since, end]`` opset ranges (end None = open)."""
    # an open end sorts last among equal starts (None does not compare with ints)
    spans = sorted(
        ((d.since_version, d.end_version) for d in defs),
        key=lambda s: (s[0], s[1] is None, s[1] or 0),
    )
    out: list[tuple[int, int | None]] = []
    for since, end in spans:
        if out:
            last_since, last_end = out[-1]
            if last_end is None:
                continue  # already open-ended: everything later is inside
            if since <= last_end + 1:
                new_end = None if end is None else max(end, last_end)
                out[-1] = (last_since, new_end)
                continue
        out.append((since, end))
    return out


def _has_function(schema: Any) -> bool:
    return bool(
        getattr(schema, "has_function", False)
        or getattr(schema, "has_context_dependent_function", False)
        or getattr(schema, "function_opset_versions", None)
        or getattr(schema, "context_dependent_function_opset_versions", None)
    )


def compare(registry: KernelRegistry, provider: str, domain: str = "") -> ProviderParity:
    """``registry`` against the spec of ``domain``."""
    dom = "" if domain == "ai.onnx" else domain
    schemas = spec_schemas(dom)
    by_op: dict[str, list[KernelDef]] = {}
    for kdef in registry.kernel_defs():
        if kdef.domain == dom:
            by_op.setdefault(kdef.op_type, []).append(kdef)
    result = ProviderParity(provider, dom, onnx.__version__, max_opset(dom))
    for op_type, op_schemas in schemas.items():
        defs = by_op.get(op_type, [])
        status: dict[int, str] = {}
        versions: list[int] = []
        deprecated: list[int] = []
        for s in op_schemas:
            v = s.since_version
            if s.deprecated:
                deprecated.append(v)
                continue
            versions.append(v)
            if any(d.version_matches(v) for d in defs):
                status[v] = KERNEL
            elif _has_function(s):
                status[v] = FUNCTION
            else:
                status[v] = MISSING
        if not versions:
            continue  # only deprecated versions remain: nothing a model may use
        result.ops.append(OpParity(op_type, versions, deprecated, merge_ranges(defs), status))
    result.extra_ops = sorted(set(by_op) - set(schemas))
    return result


def _registry_of(factory: EpFactory, devices: list[Any]) -> KernelRegistry:
    """Ask the provider for its kernel registry through a throwaway EP, as a session would."""
    ep = factory.create_ep(list(devices[:1]), SessionConfig({}))
    try:
        return ep.get_kernel_registry()
    finally:
        try:
            factory.release_ep(ep)
        except Exception:  # releasing a throwaway EP must not hide the registry we got
            pass


def provider_parity(providers: list[str] | None = None, domain: str = "") -> list[ProviderParity]:
    """Parity of every loaded provider (or the named ones), in registration order.

    A named provider that is not loaded raises ``KeyError`` with the reason; a loaded one
    whose registry cannot be read gets a result with ``error`` set.
    """
    loaded: dict[str, tuple[EpFactory, list[Any]]] = {}
    for lib in REGISTRY.libraries():
        if lib.factory is not None:
            loaded.setdefault(lib.factory.name, (lib.factory, lib.devices))
    if providers:
        for name in providers:
            if name not in loaded:
                errors = {x.name: x.error for x in REGISTRY.libraries() if x.error}
                why = errors.get(name)
                raise KeyError(why or f"no provider named '{name}'; loaded: {sorted(loaded)}")
        chosen = list(dict.fromkeys(providers))
    else:
        chosen = list(loaded)
    out = []
    for name in chosen:
        factory, devices = loaded[name]
        try:
            registry = _registry_of(factory, devices)
        except Exception as e:
            pp = ProviderParity(name, domain, onnx.__version__, max_opset(domain))
            pp.error = f"could not create an EP to read its kernel registry: {e}"
            out.append(pp)
            continue
        out.append(compare(registry, name, domain))
    return out


# formatting -----------------------------------------------------------------------------------


def format_ranges(ranges: list[tuple[int, int | None]]) -> str:
    if not ranges:
        return "-"
    parts = []
    for since, end in ranges:
        if end is None:
            parts.append(f"{since}+")
        elif end == since:
            parts.append(str(since))
        else:
            parts.append(f"{since}-{end}")
    return ",".join(parts)


def _opset_span(op: OpParity, v: int, top: int) -> str:
    later = [x for x in op.schema_versions + op.deprecated_versions if x > v]
    end = min(later) - 1 if later else top
    return f"{v}" if end == v else f"{v}-{end}"


def format_gaps(op: OpParity, top: int) -> str:
    parts = []
    for v in op.gaps:
        note = " via function" if op.version_status[v] == FUNCTION else ""
        parts.append(f"v{v} (opsets {_opset_span(op, v, top)}){note}")
    return ", ".join(parts)


def format_report(pp: ProviderParity, gaps_only: bool = False) -> str:
    dom = pp.domain or "ai.onnx"
    lines = [f"{pp.provider}: domain {dom} of onnx {pp.onnx_version} (opsets 1-{pp.max_opset})"]
    if pp.error:
        lines.append(f"  error: {pp.error}")
        return "\n".join(lines)
    width = max((len(op.op_type) for op in pp.ops), default=10) + 2
    lines.append(f"  {'op':<{width}}{'schema versions':<22}{'kernels':<14}{'status':<9}gaps")
    for op in pp.ops:
        if gaps_only and op.status == "full":
            continue
        versions = ",".join(str(v) for v in op.schema_versions)
        lines.append(
            f"  {op.op_type:<{width}}{versions:<22}{format_ranges(op.kernel_ranges):<14}"
            f"{op.status:<9}{format_gaps(op, pp.max_opset)}"
        )
    if pp.extra_ops:
        lines.append(f"  kernels for ops not in this onnx's spec: {', '.join(pp.extra_ops)}")
    t = pp.totals()
    lines.append(
        f"  totals: {t['ops']} ops: {t['ops_full']} full, {t['ops_partial']} partial, "
        f"{t['ops_none']} without a kernel; {t['schema_versions']} schema versions: "
        f"{t['versions_kernel']} with a kernel ({t['kernel_pct']}%), "
        f"{t['versions_function']} only via function expansion, {t['versions_missing']} missing"
    )
    return "\n".join(lines)


__all__ = [
    "FUNCTION",
    "KERNEL",
    "MISSING",
    "OpParity",
    "ProviderParity",
    "compare",
    "format_gaps",
    "format_ranges",
    "format_report",
    "merge_ranges",
    "provider_parity",
    "spec_schemas",
]
