"""Packaging: CI runs the README's command verbatim (lint included), then the slow tier; every runtime
dependency is used."""

from __future__ import annotations

import ast
import re

from tests.conftest import ROOT

IMPORT_NAMES = {"torch": "torch", "posix-ipc": "posix_ipc", "nvidia-ml-py": "pynvml",
                "prometheus-client": "prometheus_client", "tqdm": "tqdm", "numpy": "numpy", "scipy": "scipy"}


def test_ci_runs_the_readmes_test_command_verbatim_with_ruff():
    readme = (ROOT / "README.md").read_text()
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))]
    assert len(ci) == 2
    assert f"\n    {ci[0]}\n" in readme  # the README's indented command block, the same text
    assert "ruff check ." in ci[0] and "pytest -q -n 2" in ci[0]  # the fast tier, in two processes (pytest-xdist)
    assert ci[1] == ".venv/bin/python -m pytest -q -n 2 -m slow"  # then the slow tier, in the same venv


def install_requires() -> list[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return [re.split(r"[<>=!~;\[ ]", ast.literal_eval(node.value)[i])[0]
                    for i in range(len(node.value.elts))]
    raise AssertionError("setup.py has no install_requires")


def imported_modules() -> set[str]:
    found = set()
    for path in (ROOT / "drbalance").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


def test_every_runtime_dependency_is_imported_by_the_package():
    required = install_requires()
    assert set(required) == set(IMPORT_NAMES), required  # a new dependency: say here what it imports as
    imported = imported_modules()
    assert {IMPORT_NAMES[name] for name in required} <= imported
