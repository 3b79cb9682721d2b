"""Thin entry point for `everystop bench routing` (same flags; the code is everystop/bench/)."""

from everystop.bench.cli import script_main

if __name__ == "__main__":
    script_main("routing")
