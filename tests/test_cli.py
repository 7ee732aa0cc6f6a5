"""Both commands' --version, ``python -m drbalance``, the environment variables in --help, defaults said once."""

from __future__ import annotations

import argparse
import inspect
import re
from importlib.metadata import version

import pytest

import drbalance
from drbalance import cli, env
from drbalance.helptext import HelpFormatter, environment_variables
from drbalance.manager import cli as manager_cli
from tests.conftest import ROOT, python_process

COMMANDS = {"drbalance": "drbalance", "drbalance-manager": "drbalance.manager.cli"}


def run(module: str, *args: str) -> tuple[int, str, str]:
    process = python_process(module, *args)
    out, err = process.communicate(timeout=60)
    return process.returncode, out, err


@pytest.mark.parametrize("command", list(COMMANDS))
def test_version_prints_the_packages_version(command):
    code, out, err = run(COMMANDS[command], "--version")
    assert code == 0, err
    assert out.strip() == f"{command} {drbalance.__version__}"


def test_the_installed_metadata_has_the_one_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", drbalance.__version__)
    assert version("drbalance") == drbalance.__version__  # setup.py read it from drbalance/__init__.py
    assert "version=" in (ROOT / "setup.py").read_text() and '"0.' not in (ROOT / "setup.py").read_text()


def test_python_m_drbalance_is_the_drbalance_command():
    code, out, err = run("drbalance", "status", "--help")
    assert code == 0, err
    assert "--watch" in out and out.startswith("usage: drbalance status")


def all_env_variables_in_the_source() -> set[str]:
    found = set()
    for path in (ROOT / "drbalance").rglob("*.py"):
        found |= set(re.findall(r"DRBALANCE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    return found


def test_every_variable_env_py_reads_is_documented_there():
    public = [f for name, f in inspect.getmembers(env, inspect.isfunction)
              if f.__module__ == env.__name__ and not name.startswith("_")]
    documented = environment_variables()
    assert len(documented) == len(public)  # each function documents its variable as ``NAME``: ...
    assert {name for name, _ in documented if name.startswith("DRBALANCE_")} == all_env_variables_in_the_source()
    assert {name for name, _ in documented} - all_env_variables_in_the_source() == {"SLURMD_NODENAME", "SLURM_JOB_ID"}
    assert all(text and not text.startswith("``") for _, text in documented)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_lists_every_environment_variable(command):
    code, out, err = run(COMMANDS[command], "--help")
    assert code == 0, err
    epilog = out[out.index("environment variables:"):]
    for name, _ in environment_variables():
        assert f"  {name}: " in epilog, name
    assert "which manager a job talks to" in epilog
    # no private function's name for users to look up (it said: see '_tmp_runtime_dir')
    assert "'_" not in epilog and "run-<host>" in epilog


def test_every_variables_help_closes_its_parentheses():
    # the default was cut at a '; ' inside parentheses: DRBALANCE_RUNTIME_DIR's help ended
    # "('~/.local/state/drbalance/run-<host>' when another user took that name first)" with the
    # "(default: ..." it opened never closed
    for name, text in environment_variables():
        depth = 0
        for char in text:
            depth += {"(": 1, ")": -1}.get(char, 0)
            assert depth >= 0, (name, text)
        assert depth == 0, (name, text)
    runtime = dict(environment_variables())["DRBALANCE_RUNTIME_DIR"]
    assert runtime.endswith("when another user took that name first))"), runtime


def parsers() -> list[argparse.ArgumentParser]:
    found = [manager_cli.build_parser(), cli.build_parser([])[0]]
    for name, _, _ in cli.SUBCOMMANDS:
        _, sub, _ = cli.build_parser([name])
        found.append(sub)
    return found


def test_every_help_says_an_options_default_at_most_once():
    checked = 0
    for parser in parsers():
        assert parser.formatter_class is HelpFormatter, parser.prog
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.help or action.help == argparse.SUPPRESS:
                continue
            text = formatter._expand_help(action)
            assert text.count("(default") <= 1, (parser.prog, action.option_strings, text)
            assert "(default: None)" not in text and "(default: False)" not in text, (parser.prog, text)
            checked += 1
        parser.format_help()  # renders
    assert checked > 40
    namespace_help = manager_cli.build_parser()._get_formatter()._expand_help(
        next(a for a in manager_cli.build_parser()._actions if "--namespace" in a.option_strings))
    assert namespace_help.endswith("(default: DRBALANCE_NAMESPACE or 'default')")
