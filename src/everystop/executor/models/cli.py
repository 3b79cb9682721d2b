"""`everystop models`: the architectures everystop loads, the checkpoint names each answers
to, and which CPU fast-path pieces its layers run on."""

from __future__ import annotations

import argparse
from typing import Any

from everystop.executor.models.decoder import DecoderArgs
from everystop.executor.models.family import Family
from everystop.executor.models.moe_decoder import MoeArgs
from everystop.executor.models.registry import FAMILIES

# A config.json every family reads, with a sliding window that the families using one pick
# up, to show what their layers compute, and experts for the MoE families (under Mixtral's and
# Qwen3-MoE's names). (Soft-caps, where a checkpoint sets them, run in the same attention
# kernel and the decoder stack.)
_SAMPLE: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
    "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 4096,
    "num_local_experts": 8, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32}


def fast_path(args: DecoderArgs) -> str:
    """The CPU kernels a family's layers run, and whether decode passes take the one-call
    decoder stack."""
    pieces = ["block/16-bit GEMV and GEMM", "fused RMSNorm", "fused rope + KV write"]
    attention = "paged attention"
    if any(args.layer_windows) or args.attn_softcap:
        attention += " (" + " + ".join(
            n for n, on in (("window", any(args.layer_windows)),
                            ("soft-cap", args.attn_softcap > 0)) if on) + ")"
    pieces.append(attention)
    pieces.append("SwiGLU kernel" if args.hidden_act == "silu" else "GeGLU in torch")
    blockers = args.stack_blockers()
    stack = ("decoder stack" if not blockers else
             f"layer by layer (the stack lacks {', '.join(blockers)})")
    if not blockers and isinstance(args, MoeArgs):
        stack += " with the experts in it (router, top-k, the chosen experts only)"
    return f"{', '.join(pieces)}; decode: {stack}"


def describe(family: Family) -> dict[str, str]:
    return {"family": family.name, "hf": ", ".join(family.hf_architectures),
            "gguf": ", ".join(family.gguf_architectures) or "-",
            "adds": family.notes or "-", "fast path": fast_path(family.hf_args(_SAMPLE))}


def _run(args: argparse.Namespace) -> int:
    rows = [describe(f) for f in FAMILIES]
    for row in rows:
        print(f"{row['family']}")
        for key in ("hf", "gguf", "adds", "fast path"):
            label = {"hf": "HF architectures", "gguf": "GGUF architectures"}.get(key, key)
            print(f"  {label + ':':20} {row[key]}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("models", help="list the model architectures everystop loads",
                              description=__doc__)
    p.set_defaults(func=_run)
