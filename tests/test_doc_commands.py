"""Every `everystop ...` command the docs and the README quote parses with the CLI's own
argparse: a renamed flag or a deleted subcommand breaks this test, not a reader's first try.
(The README's curl and Python examples run verbatim in tests/server/test_readme.py.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from everystop.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
# Placeholders (`everystop bench NAME`, `[--flag X]`, `--replicas N`): a shape, not a command.
PLACEHOLDER = re.compile(r"\[|\]|\.\.\.|<|(?<=\s)[A-Z][A-Z_|]*(?=\s|$)")
PROGRAM = re.compile(r"^(?:\S+=\S+\s+)*(?:\.venv/bin/)?everystop\s")


def _fenced_commands(text: str) -> list[str]:
    """Command lines inside ``` blocks, backslash continuations joined, comments dropped."""
    out: list[str] = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if PROGRAM.match(line):
                out.append(line)
    return out


def _inline_commands(text: str) -> list[str]:
    """Inline code that gives flags (`everystop simulate --replicas 16 ...`); a bare name in
    prose (`everystop bench gate`, `everystop serve --help`) names a command, it runs nothing."""
    without_blocks = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return [c for c in re.findall(r"`([^`\n]+)`", without_blocks)
            if PROGRAM.match(c) and " --" in c and "--help" not in c]


def quoted_commands() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for command in _fenced_commands(text) + _inline_commands(text):
            if not PLACEHOLDER.search(command):
                found.append((doc.name, command))
    return found


def argv_of(command: str) -> list[str]:
    words = shlex.split(command)
    while words and "=" in words[0] and not words[0].startswith("-"):
        words.pop(0)  # VAR=value before the program
    assert words and words[0].endswith("everystop"), command
    return words[1:]


COMMANDS = quoted_commands()


def test_the_docs_quote_commands() -> None:
    assert len(COMMANDS) >= 20, COMMANDS
    assert {doc for doc, _ in COMMANDS} >= {"README.md", "scale-out.md", "fleet-simulation.md"}


@pytest.mark.parametrize(("doc", "command"), COMMANDS, ids=[f"{d}:{c[:60]}" for d, c in COMMANDS])
def test_a_quoted_command_parses(doc: str, command: str) -> None:
    argv = argv_of(command)
    try:
        args = build_parser(argv).parse_args(argv)
    except SystemExit as exc:  # argparse's way of refusing
        pytest.fail(f"{doc}: `{command}` does not parse (exit {exc.code})")
    assert getattr(args, "func", None), f"{doc}: `{command}` names no runnable command"


def test_a_wrong_flag_is_caught() -> None:
    argv = argv_of("everystop serve --no-such-flag 1")
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args(argv)
