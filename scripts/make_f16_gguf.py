"""Write an F16 copy of a GGUF (everystop.bench.gguf_f16: every quantized tensor dequantized
to F16, F32 tensors and the metadata as they are). The default model as F16 is what llama.cpp's
server and `--dtype auto` (bf16 activations on a CPU with native bf16) are compared on.

    python scripts/make_f16_gguf.py --out /tmp/smollm2-f16.gguf   # the default model
"""

from __future__ import annotations

import argparse

from everystop.bench.gguf_f16 import write_f16_copy
from everystop.executor.models.loader import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--src", default=None, help="GGUF to convert (default: the bundled model)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    write_f16_copy(args.src or default_model_path(), args.out)


if __name__ == "__main__":
    main()
