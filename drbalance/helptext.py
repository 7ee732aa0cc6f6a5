"""What ``--help`` of ``drbalance`` and ``drbalance-manager`` share: the formatter and the list of
environment variables (generated from :mod:`drbalance.env`, so it is written once)."""

from __future__ import annotations

import argparse
import inspect
import re
import textwrap

from drbalance import env

_DOCUMENTED = re.compile(r"^``((?:DRBALANCE|SLURMD?)_[A-Z0-9_]+)``:\s*(.*)$", re.DOTALL)  # ours, and Slurm's
_PRIVATE_REFERENCE = re.compile(r";?\s*``_\w+``")  # "; ``_tmp_runtime_dir``": no name for users to look up


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds ``(default: X)`` to an option's help once: not when the help already says its default,
    nor when there is none to show (None, a flag's False).

    Line breaks in the description and epilog are kept (each line is wrapped on its own), so the
    list of environment variables stays one per line.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default" in text or action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines = []
        for line in text.splitlines():
            body = line.lstrip()
            extra = " " * (len(line) - len(body))
            lines.append(textwrap.fill(body, width, initial_indent=indent + extra,
                                       subsequent_indent=indent + extra + "    ") if body else "")
        return "\n".join(lines)


def environment_variables() -> list[tuple[str, str]]:
    """(name, first sentence) of every variable :mod:`drbalance.env` documents, in source order,
    with the first clause of its "Default:" paragraph when it has one."""
    found = []
    for _, function in inspect.getmembers(env, inspect.isfunction):
        if function.__module__ != env.__name__ or function.__name__.startswith("_"):
            continue
        paragraphs = [" ".join(part.split()) for part in inspect.getdoc(function).split("\n\n")]
        match = _DOCUMENTED.match(paragraphs[0])
        if match:
            name, text = match.groups()
            sentence = re.split(r"(?<=\.)\s+(?=[A-Z])", text, maxsplit=1)[0]
            default = next((part[len("Default:"):].strip() for part in paragraphs if part.startswith("Default:")), "")
            if default:
                clause = _first_clause(_PRIVATE_REFERENCE.sub("", default))
                sentence = sentence.rstrip(".") + f" (default: {clause})"
            found.append((inspect.getsourcelines(function)[1], name, re.sub(r"``(.*?)``", r"'\1'", sentence)))
    return [(name, text) for _, name, text in sorted(found)]


def _first_clause(text: str) -> str:
    """``text`` up to its first ``; `` or ``. `` outside parentheses, without a final ``.``: a cut
    inside parentheses would leave one open in the help."""
    depth = 0
    for index, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and text.startswith(("; ", ". "), index):
            return text[:index].rstrip(".")
    return text.rstrip(".")


def environment_epilog() -> str:
    """The ``--help`` epilog: one line per environment variable."""
    return "environment variables:\n" + "\n".join(f"  {name}: {text}" for name, text in environment_variables())
