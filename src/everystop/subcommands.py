"""Subcommands that are modules: each module has `add_arguments(parser)` and `run(args) -> int`
and is listed once as (name, module path, help); `everystop bench ...` and `everystop simulate
...` add theirs to their parsers here."""

from __future__ import annotations

import argparse
import importlib
from typing import Any

ModuleCommands = list[tuple[str, str, str]]


def add_module_commands(subparsers: Any, commands: ModuleCommands) -> None:
    """One subparser per listed module: its docstring as the description, its flags, its run."""
    for name, module_name, help_text in commands:
        module = importlib.import_module(module_name)
        p = subparsers.add_parser(name, help=help_text, description=module.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
