"""Weights kept in GGUF's 32-value block formats: the formats' layout, quantizing a float
weight into them and widening them back, in plain torch (the CPU kernels in
csrc/quant_linear.cpp read the same bytes in place).

A quantized weight of logical shape [n, k] is a contiguous uint8 tensor [n, k / 32 * bytes]:
each row is its k / 32 blocks back to back, exactly as a GGUF file stores them, so a tensor
read from a file is used as it is (no repacking, no second copy)::

    q8_0  [fp16 d][int8 q x32]                  34 B   w = d * q
    q4_0  [fp16 d][u8 qs x16]                   18 B   w = d * (q - 8)
    q4_1  [fp16 d][fp16 m][u8 qs x16]           20 B   w = d * q + m
          (qs[j]: value j in the low nibble, value j + 16 in the high nibble)

Where the CPU kernels take int8 activations, a weight with a multiple of 16 rows is held
interleaved (`interleave`, formats ``*_x16``): each group of 16 rows block by block, the 16
rows' scales side by side and then their quants a dword at a time (csrc/block_x16.h), the same
bytes in the same total size, so that one 512-bit integer dot serves 16 output columns.

Quantizing follows ggml's reference rounding, so a weight quantized here equals the one
llama-quantize writes for the same values (up to ties).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

BLOCK = 32
# name -> (kernel format code, bytes per block); code 0 is a dense 16-bit weight.
FORMATS: dict[str, tuple[int, int]] = {"q8_0": (1, 34), "q4_0": (2, 18), "q4_1": (3, 20)}
X16 = "_x16"  # the suffix of an interleaved format's name
INTERLEAVE_ROWS = 16
# The interleaved formats, as held (never in a file): name -> (kernel format code, bytes per block).
INTERLEAVED = {name + X16: (code + 3, nbytes) for name, (code, nbytes) in FORMATS.items()}
DENSE = "dense"
# Bits per weight, for logs and memory accounting.
BITS_PER_WEIGHT = {name: 8 * nbytes / BLOCK for name, (_, nbytes) in FORMATS.items()}


@dataclass(frozen=True)
class QuantizedTensor:
    """A [rows, cols] weight held as blocks (`data`: uint8 [rows, cols / 32 * bytes])."""

    fmt: str
    data: torch.Tensor
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.cols)

    def rows(self, start: int, size: int) -> QuantizedTensor:
        return QuantizedTensor(self.fmt, self.data[start:start + size], self.cols)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.data, self.fmt, self.cols)


def format_code(fmt: str) -> int:
    """A held weight's format as the CPU kernels take it: 0 dense, else its block format's code."""
    return 0 if fmt == DENSE else {**FORMATS, **INTERLEAVED}[fmt][0]


def row_bytes(fmt: str, cols: int) -> int:
    if cols % BLOCK:
        raise ValueError(f"{fmt} needs a row length divisible by {BLOCK}, not {cols}")
    return cols // BLOCK * FORMATS[fmt][1]


def quantize(w: torch.Tensor, fmt: str) -> QuantizedTensor:
    """Blocks of the float weight w [n, k] (k divisible by 32) in `fmt`."""
    n, k = w.shape
    row_bytes(fmt, k)
    x = w.float().reshape(n, k // BLOCK, BLOCK)
    if fmt == "q8_0":
        d = x.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        # ggml rounds half away from zero (roundf).
        q = (x * inv).abs().add(0.5).floor().copysign(x * inv).to(torch.int8)
        parts = [_half_bytes(d), q.view(torch.uint8)]
    elif fmt == "q4_0":
        # The signed value of largest magnitude maps to -8, so its sign sets d's.
        idx = x.abs().argmax(-1, keepdim=True)
        d = x.gather(-1, idx) / -8
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = (x * inv + 8.5).clamp(0, 15).to(torch.uint8)  # truncation, as ggml's (int8_t) cast
        parts = [_half_bytes(d), _pack_nibbles(q)]
    elif fmt == "q4_1":
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = ((x - lo) * inv + 0.5).clamp(0, 15).to(torch.uint8)
        parts = [_half_bytes(d), _half_bytes(lo), _pack_nibbles(q)]
    else:
        raise ValueError(f"unknown quantized format {fmt!r}; expected one of {list(FORMATS)}")
    data = torch.cat(parts, dim=-1).reshape(n, -1).contiguous()
    return QuantizedTensor(fmt, data, k)


def interleave(w: QuantizedTensor) -> QuantizedTensor:
    """w in its format's interleaved layout (csrc/block_x16.h); w's rows: a multiple of 16."""
    if w.fmt not in FORMATS:
        raise ValueError(f"cannot interleave a {w.fmt!r} weight")
    n, nbytes = w.data.shape[0], FORMATS[w.fmt][1]
    if n % INTERLEAVE_ROWS:
        raise ValueError(f"interleaving needs a multiple of {INTERLEAVE_ROWS} rows, not {n}")
    nb = w.cols // BLOCK
    # [group, block, row in group, bytes of the block]
    b = w.data.reshape(n // INTERLEAVE_ROWS, INTERLEAVE_ROWS, nb, nbytes).transpose(1, 2)
    scales = 4 if w.fmt == "q4_1" else 2
    parts = [b[..., i:i + 2].reshape(*b.shape[:2], -1) for i in range(0, scales, 2)]
    qs = b[..., scales:]
    if w.fmt == "q8_0":
        qs = qs ^ 0x80
    qs = qs.reshape(*b.shape[:3], -1, 4).transpose(2, 3)  # [group, block, dword, row, 4]
    parts.append(qs.reshape(*b.shape[:2], -1))
    return QuantizedTensor(w.fmt + X16, torch.cat(parts, -1).reshape(n, -1).contiguous(), w.cols)


def deinterleave(data: torch.Tensor, fmt: str, cols: int) -> torch.Tensor:
    """The standard-layout blocks of an interleaved weight `data` of format `fmt` (``*_x16``)."""
    base = fmt.removesuffix(X16)
    rows = _standard_order(data, base, cols)
    if base == "q8_0":
        rows ^= _q8_offsets(rows.shape[-1])
    return rows


def rows_of(data: torch.Tensor, fmt: str, cols: int, ids: torch.Tensor) -> torch.Tensor:
    """The standard-layout blocks of rows `ids` (1-D) of the blocks `data` of format `fmt`: an
    interleaved weight's rows gathered byte by byte from their groups of 16 (an embedding
    lookup: four tensor ops whatever the count)."""
    if not fmt.endswith(X16):
        return data[ids]
    groups = data.view(-1, INTERLEAVE_ROWS * data.shape[1])[ids // INTERLEAVE_ROWS]
    rows = torch.gather(groups, 1, _group_index(fmt, cols)[ids % INTERLEAVE_ROWS])
    if fmt == "q8_0" + X16:
        rows ^= _q8_offsets(rows.shape[1])
    return rows


def _standard_order(data: torch.Tensor, base: str, cols: int) -> torch.Tensor:
    """An interleaved weight's elements (bytes, or any labels of them) put back in the
    standard layout's order: the permutation half of deinterleave."""
    n, nbytes, nb = data.shape[0], FORMATS[base][1], cols // BLOCK
    g = data.reshape(n // INTERLEAVE_ROWS, nb, INTERLEAVE_ROWS * nbytes)
    scales = 4 if base == "q4_1" else 2
    head = INTERLEAVE_ROWS * scales
    parts = [g[..., i * 16:(i + 2) * 16].reshape(*g.shape[:2], INTERLEAVE_ROWS, 2)
             for i in range(0, scales, 2)]
    qs = g[..., head:].reshape(*g.shape[:2], -1, INTERLEAVE_ROWS, 4).transpose(2, 3)
    qs = qs.reshape(*g.shape[:2], INTERLEAVE_ROWS, -1)
    rows = torch.cat([*parts, qs], -1)  # [group, block, row in group, bytes]
    return rows.transpose(1, 2).reshape(n, -1).contiguous()


@functools.lru_cache(maxsize=16)
def _group_index(fmt: str, cols: int) -> torch.Tensor:
    """[16, row bytes]: where each byte of a group's row r sits in the group's bytes."""
    base = fmt.removesuffix(X16)
    nbytes = row_bytes(base, cols)
    labels = torch.arange(INTERLEAVE_ROWS * nbytes).view(INTERLEAVE_ROWS, nbytes)
    return _standard_order(labels, base, cols)


@functools.lru_cache(maxsize=16)
def _q8_offsets(nbytes: int) -> torch.Tensor:
    """What to XOR a Q8_0 row's bytes with to move between the layouts: 128 on its quant
    bytes (every block's bytes after its fp16 scale), which the interleaved layout holds
    offset by 128 (csrc/block_x16.h), 0 on the scales."""
    quants = (torch.arange(nbytes) % FORMATS["q8_0"][1]) >= 2
    return quants.to(torch.uint8) * 0x80


def dequantize(data: torch.Tensor, fmt: str, cols: int) -> torch.Tensor:
    """The fp32 weight [n, cols] the blocks `data` hold."""
    if fmt.endswith(X16):
        data, fmt = deinterleave(data, fmt, cols), fmt.removesuffix(X16)
    n = data.shape[0]
    nb = cols // BLOCK
    b = data.reshape(n, nb, FORMATS[fmt][1])
    d = _half(b[..., 0:2])
    if fmt == "q8_0":
        return (b[..., 2:].contiguous().view(torch.int8).float() * d).reshape(n, cols)
    qs = b[..., 4:] if fmt == "q4_1" else b[..., 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()
    w = q * d + _half(b[..., 2:4]) if fmt == "q4_1" else (q - 8) * d
    return w.reshape(n, cols)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact|| / ||exact|| (0 for an all-zero weight)."""
    norm = float(exact.float().norm())
    return float((approx.float() - exact.float()).norm()) / norm if norm else 0.0


def _half_bytes(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).contiguous().view(torch.uint8)


def _half(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    half = BLOCK // 2
    return q[..., :half] | (q[..., half:] << 4)
