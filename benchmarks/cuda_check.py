"""Thin entry point for `everystop bench cuda-check` (same flags; the code is everystop/bench/)."""

from everystop.bench.cli import script_main

if __name__ == "__main__":
    script_main("cuda-check")
