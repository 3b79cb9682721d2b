"""Thin entry point for `everystop bench health-big-request` (same flags)."""

from everystop.bench.cli import script_main

if __name__ == "__main__":
    script_main("health-big-request")
