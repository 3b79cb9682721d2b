"""Thin entry point for `everystop bench fleet-report` (same flags; the code is everystop/sim/)."""

from everystop.bench.cli import script_main

if __name__ == "__main__":
    script_main("fleet-report")
