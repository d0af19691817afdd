"""The folders show the layers: what each part of the tree may import, and how long a
module may grow (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 500


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def imported_roots(path: Path) -> set[str]:
    """The top-level packages `path` imports, wherever in the module it does."""
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_only_the_cli_wires_the_gateway_to_the_engine() -> None:
    importers = {
        str(path.relative_to(ROOT))
        for path in sources("gateway")
        if {"engine", "mlx"} & imported_roots(path)
    }
    assert importers == {"gateway/cli.py"}


def test_the_sans_io_session_and_protocol_do_no_network_io() -> None:
    for package in ("gateway/session", "gateway/protocol"):
        for path in sources(package):
            roots = imported_roots(path)
            assert not {"websockets", "aiortc", "asyncio", "engine"} & roots, path


def test_the_engine_knows_nothing_of_the_gateway() -> None:
    for path in sources("engine"):
        assert not {"gateway", "websockets"} & imported_roots(path), path


def test_no_module_outside_the_model_files_is_over_500_lines() -> None:
    models = ROOT / "engine" / "models"
    long = {
        str(path.relative_to(ROOT)): lines
        for package in ("gateway", "duplex", "engine")
        for path in sources(package)
        if models not in path.parents and (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_every_package_says_what_it_holds() -> None:
    for package in ("gateway", "duplex", "engine"):
        for init in (ROOT / package).rglob("__init__.py"):
            docstring = ast.get_docstring(ast.parse(init.read_text()))
            assert docstring, f"{init.relative_to(ROOT)} has no docstring"
