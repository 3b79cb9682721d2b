"""Write an F16 copy of a GGUF: every quantized tensor dequantized to F16 (F32 tensors, the
norms, stay F32), the metadata and tokenizer as they are. The default model as F16 is what
llama.cpp's server and `--dtype auto` (bf16 activations on a CPU with native bf16) are
compared on.

    python scripts/make_f16_gguf.py --out /tmp/smollm2-f16.gguf   # the default model
"""

from __future__ import annotations

import argparse

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, Keys
from gguf.quants import dequantize

from everystop.executor.models.loader import default_model_path

KEEP = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)


def convert(src: str, out: str) -> None:
    reader = GGUFReader(src)
    arch = str(reader.fields[Keys.General.ARCHITECTURE].contents())
    writer = GGUFWriter(out, arch)
    for field in reader.fields.values():
        # The writer adds the architecture and the GGUF.* fields itself; the file type changes.
        if field.name in (Keys.General.ARCHITECTURE, Keys.General.FILE_TYPE) or \
                field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    writer.add_file_type(1)  # LlamaFileType.MOSTLY_F16
    data = []
    for t in reader.tensors:
        if t.tensor_type in KEEP:
            arr = np.asarray(t.data)
        else:
            arr = dequantize(t.data, t.tensor_type).astype(np.float16)
        # GGUF lists dims fastest-first; numpy wants them slowest-first.
        arr = arr.reshape(tuple(int(d) for d in reversed(t.shape)))
        writer.add_tensor_info(t.name, arr.shape, arr.dtype, arr.nbytes,
                               t.tensor_type if t.tensor_type in KEEP else GGMLQuantizationType.F16)
        data.append(arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for arr in data:
        writer.write_tensor_data(arr)
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--src", default=None, help="GGUF to convert (default: the bundled model)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    convert(args.src or default_model_path(), args.out)


if __name__ == "__main__":
    main()
