"""Project files that must agree with each other: the README's set-up commands and CI, the
committed demo model and the script that builds it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import onnxplug
from onnxplug.cli.main import demo_model_path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [line for b in blocks for line in b.splitlines() if line.startswith("python3 -m venv")]


def test_readme_has_the_two_setup_commands():
    commands = _readme_commands()
    assert any(c.endswith(".venv/bin/onnxplug demo") for c in commands), commands
    assert any(c.endswith(".venv/bin/python -m pytest -q") for c in commands), commands


def test_ci_runs_the_readme_test_command_verbatim():
    test_cmd = next(c for c in _readme_commands() if "pytest" in c)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci


def test_demo_model_is_what_the_script_builds():
    spec = importlib.util.spec_from_file_location(
        "make_demo_model", ROOT / "scripts" / "make_demo_model.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.build().SerializeToString() == demo_model_path().read_bytes()


def test_demo_model_ships_inside_the_package():
    assert demo_model_path().parent == Path(onnxplug.__file__).parent / "data"
