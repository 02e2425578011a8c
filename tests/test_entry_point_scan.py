"""``loader.installed_entry_points``: the fast scan of installed entry points gives what
``importlib.metadata.entry_points(group=...)`` gives (same pairs, order and de-duplication), and
falls back to it where it cannot be sure to."""

from __future__ import annotations

import contextlib
import importlib.metadata
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from onnxplug.ep import loader
from onnxplug.ep.loader import ENTRY_POINT_GROUP, PluginRegistry

G = "onnxplug.test_group"


def stdlib(group: str) -> list[tuple[str, str]]:
    return [(ep.name, ep.value) for ep in importlib.metadata.entry_points(group=group)]


def dist(root: Path, dirname: str, entry_points: str | None = None, name: str = "") -> Path:
    """A metadata folder ``root/dirname`` with a METADATA and, if given, an entry_points.txt."""
    d = root / dirname
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name or dirname}\n")
    if entry_points is not None:
        (d / "entry_points.txt").write_text(entry_points)
    return d


@contextlib.contextmanager
def only_on_sys_path(paths: list[str]) -> Iterator[None]:
    """sys.path is ``paths`` and nothing else (no import may happen meanwhile)."""
    saved = sys.path[:]
    sys.path[:] = paths
    try:
        yield
    finally:
        sys.path[:] = saved


# ---------------------------------------------------------------------------------------------
# this venv


def test_this_venv_every_group_matches_importlib_metadata():
    groups = importlib.metadata.entry_points().groups
    assert {ENTRY_POINT_GROUP, "console_scripts"} <= groups
    for group in sorted(groups | {"no.such.group"}):
        fast = loader._scan_entry_points(group)
        assert fast is not None, "the fast scan fell back on this venv"
        assert fast == stdlib(group), group
        assert loader.installed_entry_points(group) == fast
    assert ("CPUExecutionProvider", "onnxplug.providers.cpu:create_factory") in stdlib(
        ENTRY_POINT_GROUP
    )


# ---------------------------------------------------------------------------------------------
# fake distributions on sys.path


def test_fake_distributions_match_importlib_metadata(tmp_path, monkeypatch):
    a, b, c, missing = (tmp_path / n for n in ("a", "b", "c", "missing"))
    text = (
        "# a comment\n"
        "\n"
        "[console_scripts]\n"
        "tool = foo_bar.cli:main\n"
        f"[{G}]\n"
        "  FirstExecutionProvider =  foo_bar.ep:create_factory  \n"
        "; NotAComment = foo_bar.semi:f\n"  # importlib.metadata skips "#" lines only
        "   # indented comment\n"
        "Extras = foo_bar.ep:f [gpu, x]\n"
        "Equals=a:b=c\n"
        "[other.group]\n"
        f"Other = {G}:x\n"
        f"[[{G}]]\n"  # also the group: the header is strip("[]")-ed
        "Second = foo_bar.two:f\r\n"
    )
    dist(a, "foo_bar-1.0.dist-info", text, name="foo_bar")
    # the same distribution (normalized) further along sys.path: shadowed
    dist(b, "Foo.Bar-2.0.dist-info", f"[{G}]\nShadowed = foo_bar:old\n", name="Foo.Bar")
    dist(b / "sub", "ignored-1.0.dist-info", f"[{G}]\nNested = x:y\n")  # not on sys.path
    dist(c, "legacy-0.1-py3.11.egg-info", f"[{G}]\nLegacy = legacy.ep:f\n", name="legacy")
    dist(c, "nothing-1.0.dist-info", None, name="nothing")  # no entry_points.txt
    (a / "plain.egg-info").write_text("Name: plain\n")  # a distutils egg-info file
    dist(c, "plain-2.0.dist-info", f"[{G}]\nPlain = plain:f\n", name="plain")  # shadowed by it
    dist(c, "notmetadata", f"[{G}]\nNot = x:y\n")
    for p in (c, missing, b, a):
        monkeypatch.syspath_prepend(str(p))
    monkeypatch.syspath_prepend(str(a))  # twice on sys.path

    fast = loader._scan_entry_points(G)
    assert fast == stdlib(G) == loader.installed_entry_points(G)
    assert fast == [
        ("FirstExecutionProvider", "foo_bar.ep:create_factory"),
        ("; NotAComment", "foo_bar.semi:f"),
        ("Extras", "foo_bar.ep:f [gpu, x]"),
        ("Equals", "a:b=c"),
        ("Second", "foo_bar.two:f"),
        ("Legacy", "legacy.ep:f"),
    ]
    for group in ("console_scripts", "other.group", ENTRY_POINT_GROUP):
        assert loader._scan_entry_points(group) == stdlib(group), group


def test_empty_string_on_sys_path_is_the_current_directory(tmp_path, monkeypatch):
    dist(tmp_path, "here-1.0.dist-info", f"[{G}]\nHere = here:f\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend("")
    assert loader._scan_entry_points(G) == stdlib(G) == [("Here", "here:f")]


# ---------------------------------------------------------------------------------------------
# where the fast scan falls back to importlib.metadata


def test_a_zip_on_sys_path_falls_back(tmp_path, monkeypatch):
    archive = tmp_path / "zipped.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("zipped-1.0.dist-info/METADATA", "Name: zipped\n")
        z.writestr("zipped-1.0.dist-info/entry_points.txt", f"[{G}]\nZipped = zipped:f\n")
    dist(tmp_path / "dir", "plain-1.0.dist-info", f"[{G}]\nPlain = plain:f\n")
    monkeypatch.syspath_prepend(str(tmp_path / "dir"))
    monkeypatch.syspath_prepend(str(archive))
    assert loader._scan_entry_points(G) is None
    assert (
        loader.installed_entry_points(G)
        == stdlib(G)
        == [
            ("Zipped", "zipped:f"),
            ("Plain", "plain:f"),
        ]
    )


def test_an_egg_directory_falls_back(tmp_path, monkeypatch):
    egg = tmp_path / "eggy-1.0-py3.11.egg"
    info = dist(egg, "EGG-INFO", f"[{G}]\nEggy = eggy:f\n")
    (info / "PKG-INFO").write_text("Metadata-Version: 1.1\nName: eggy\nVersion: 1.0\n")
    monkeypatch.syspath_prepend(str(egg))
    assert loader._scan_entry_points(G) is None
    assert loader.installed_entry_points(G) == stdlib(G) == [("Eggy", "eggy:f")]


def test_a_name_not_taken_from_the_folder_falls_back(tmp_path, monkeypatch):
    # importlib.metadata names these from METADATA: an extension spelled otherwise, no name
    dist(tmp_path, "Odd-1.0.DIST-INFO", f"[{G}]\nOdd = odd:f\n", name="odd")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert loader._scan_entry_points(G) is None
    assert loader.installed_entry_points(G) == stdlib(G) == [("Odd", "odd:f")]
    dist(tmp_path / "b", "-1.0.dist-info", f"[{G}]\nNoName = noname:f\n", name="noname")
    monkeypatch.syspath_prepend(str(tmp_path / "b"))
    assert loader._scan_entry_points(G) is None
    assert loader.installed_entry_points(G) == stdlib(G)


def test_another_distribution_finder_falls_back(tmp_path, monkeypatch):
    class Finder:  # a meta path finder that finds distributions of its own
        def find_spec(self, *args):
            return None

        def find_distributions(self, context=None):
            return [importlib.metadata.PathDistribution(tmp_path / "elsewhere-1.0.dist-info")]

    dist(tmp_path, "elsewhere-1.0.dist-info", f"[{G}]\nElsewhere = elsewhere:f\n")
    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, Finder()])
    assert loader._scan_entry_points(G) is None
    assert loader.installed_entry_points(G) == stdlib(G) == [("Elsewhere", "elsewhere:f")]


def test_finders_without_find_distributions_keep_the_fast_scan(monkeypatch):
    class ImportHook:  # like pytest's assertion rewriter or setuptools' distutils hack
        def find_spec(self, *args):
            return None

    monkeypatch.setattr(sys, "meta_path", [ImportHook(), *sys.meta_path])
    assert loader._scan_entry_points(ENTRY_POINT_GROUP) == stdlib(ENTRY_POINT_GROUP)


# ---------------------------------------------------------------------------------------------
# broken metadata


def test_a_line_without_equals_in_the_group_raises_like_importlib_metadata(tmp_path, monkeypatch):
    dist(tmp_path, "broken-1.0.dist-info", f"[{G}]\nno equals sign here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="without '='"):
        loader.installed_entry_points(G)
    with pytest.raises(TypeError):
        stdlib(G)


def test_broken_metadata_of_the_plugin_group_leaves_the_builtin_cpu_provider(tmp_path, monkeypatch):
    dist(tmp_path, "broken-1.0.dist-info", f"[{ENTRY_POINT_GROUP}]\nno equals sign here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert PluginRegistry().available_providers() == ["CPUExecutionProvider"]


def test_accepted_difference_a_broken_file_without_the_group_is_not_parsed(tmp_path, monkeypatch):
    dist(tmp_path, "good-1.0.dist-info", f"[{G}]\nGood = good:f\n")
    dist(tmp_path, "broken-1.0.dist-info", "[console_scripts]\nno equals sign here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TypeError):  # importlib.metadata parses every distribution's file
        stdlib(G)
    assert loader.installed_entry_points(G) == [("Good", "good:f")]


# ---------------------------------------------------------------------------------------------
# random distributions and entry_points.txt files

_word = st.text("abAB", min_size=1, max_size=3)
_name = st.builds(lambda a, b: a + b, _word, st.text("abAB._-", max_size=3))
_entry = st.builds(
    lambda k, v, sp: f"{sp}{k}{sp}={sp}{v}{sp}",
    _word,
    st.text("ab:.=[] ", max_size=6),
    st.sampled_from(["", " ", "\t"]),
)
_line = st.one_of(
    st.sampled_from(["", "   ", "# c = d", "\t# x", "; semi = colon", "[other]", "[]"]),
    st.sampled_from([f"[{G}]", f" [{G}] ", f"[[{G}]]", f"[ {G} ]", f"[{G}.x]"]),
    _entry,
    _entry,
)
_folder = st.tuples(
    _name,
    st.sampled_from(["", "-1.0", "-2.0-py3"]),
    st.sampled_from([".dist-info"] * 6 + [".egg-info"] * 3 + [".Dist-Info", ".txt"]),
    st.sampled_from(["dir", "dir", "file", "empty"]),
    st.lists(_line, max_size=10),
    st.sampled_from(["\n", "\r\n"]),
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    layout=st.lists(st.lists(_folder, max_size=5), min_size=1, max_size=3),
    repeat_first=st.booleans(),
)
def test_random_layouts_match_importlib_metadata(layout, repeat_first, tmp_path_factory):
    base = Path(tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp()))  # fresh: no stale cache
    paths = []
    for i, folders in enumerate(layout):
        root = base / str(i)
        root.mkdir()
        paths.append(str(root))
        for name, version, ext, kind, lines, eol in folders:
            child = root / f"{name}{version}{ext}"
            if child.exists():
                continue
            if kind == "file":
                child.write_text(f"Name: {name}\n")
            else:
                dist(root, child.name, eol.join(lines) if kind == "dir" else None, name=name)
    if repeat_first:
        paths.append(paths[0])
    paths.append(str(base / "missing"))
    odd = any(ext == ".Dist-Info" for folders in layout for *_, ext, _k, _l, _e in folders)
    with only_on_sys_path(paths):
        for group in (G, "other"):
            fast = loader._scan_entry_points(group)
            event("fallback" if fast is None else f"fast scan, {min(len(fast), 3)}+ entries")
            assert fast == (None if odd else stdlib(group))
            assert loader.installed_entry_points(group) == stdlib(group)
