"""Thin entry point for `everystop bench quant-kernels` (same flags; code: everystop/bench/)."""

from everystop.bench.cli import script_main

if __name__ == "__main__":
    script_main("quant-kernels")
