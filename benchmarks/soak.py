"""Thin entry point for `everystop bench soak` (same flags)."""

from everystop.bench.cli import script_main

if __name__ == "__main__":
    script_main("soak")
