"""The duplex core stays below the gateway and above the engine: it imports neither."""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import duplex

FORBIDDEN = ("mlx", "websockets", "engine", "gateway", "numpy", "pydantic")
DUPLEX_DIR = Path(duplex.__file__).parent
MODULES = sorted(f"duplex.{m.name}" for m in pkgutil.iter_modules([str(DUPLEX_DIR)]))


def test_every_duplex_module_is_checked() -> None:
    expected = {"actions", "contracts", "errors", "events", "manager", "outputs", "playback"}
    expected |= {"session", "state", "turn"}
    assert {m.removeprefix("duplex.") for m in MODULES} >= expected


def test_importing_duplex_loads_no_forbidden_package() -> None:
    script = (
        "import importlib, json, sys\n"
        f"for name in {MODULES!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    root = DUPLEX_DIR.parent
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, check=True
    )
    loaded = json.loads(result.stdout)
    assert "duplex.manager" in loaded
    offending = [m for m in loaded if m.split(".")[0] in FORBIDDEN]
    assert offending == []


def test_duplex_sources_import_only_stdlib_and_duplex() -> None:
    for path in sorted(DUPLEX_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                roots = [node.module.split(".")[0]]
            else:
                continue
            for root in roots:
                allowed = root in sys.stdlib_module_names or root == "duplex"
                assert allowed, f"{path.name} imports {root}"
