"""An F16 GGUF of a block-quantized one: every block tensor dequantized to F16, F32 tensors and
every metadata key as they are (the file type becomes MOSTLY_F16). The benchmarks' target for a
quantized copy to draft for: the default model ships as Q4_1 only, so its F16 "conversion" holds
the Q4_1 values in 16 bits (the same model, four times the bytes per weight)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize

# Written by GGUFWriter itself (the header, the architecture) or replaced (the file type).
_SKIP_KEYS = ("GGUF.", "general.architecture", "general.file_type")
_KEEP = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)


def write_f16_copy(src: str | Path, dst: str | Path) -> Path:
    """Write `src`'s F16 copy to `dst` (replaced if present); returns `dst`."""
    reader = GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith(_SKIP_KEYS):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    for t in reader.tensors:
        if t.tensor_type in _KEEP:
            data = np.asarray(t.data)
        else:
            data = dequantize(t.data, t.tensor_type).astype(np.float16)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


COPIES = Path("/tmp/everystop-f16")  # kept between runs: a rerun reuses its copy


def default_model_f16(work_dir: Path = COPIES) -> Path:
    """The F16 copy of the default model under `work_dir`, written on first use."""
    from everystop.executor.models.loader import default_model_path

    target = Path(work_dir) / "default-model-f16.gguf"
    if not target.is_file():
        print(f"writing the F16 copy of {default_model_path()} to {target}", flush=True)
        write_f16_copy(default_model_path(), target)
    return target
