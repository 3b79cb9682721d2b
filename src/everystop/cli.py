"""The `everystop` command: each subcommand lives with the subsystem it drives."""

from __future__ import annotations

import argparse
import importlib
import sys

from everystop.startup_memory import checkpoint

# (subcommand, module with `register(subparsers)`); imported lazily so `everystop --help` is fast.
SUBCOMMANDS = [
    ("generate", "everystop.entrypoints.generate"),
    ("serve", "everystop.server.cli"),
    ("bench", "everystop.bench.cli"),
    ("simulate", "everystop.sim.cli"),
    ("report", "everystop.telemetry.report"),
    ("models", "everystop.executor.models.cli"),
]


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="everystop", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, module in SUBCOMMANDS:
        if wanted not in (None, name):
            sub.add_parser(name)  # listed in --help without importing its module
            continue
        try:
            importlib.import_module(module).register(sub)
        except ModuleNotFoundError as exc:
            if not exc.name or not module.startswith(exc.name):
                raise
            sub.add_parser(name, help="(not available in this build)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    checkpoint("interpreter")
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if args.command == "serve":
        from everystop.server.cli import scaled_out
        if scaled_out(args):  # on Ray: the cluster floor sits above the server's app
            from everystop.cluster.deploy import serve_cluster_command
            return serve_cluster_command(args)
    return int(args.func(args) or 0)
