"""On a CUDA machine, in a few minutes: the correctness core (the device model against the CPU
fp32 model, packed batches against sequences alone, the engine end to end) and decode tok/s at
batch 1 / 32 / 128 in fp32 and bf16; JSON out. Exits 1 if a check fails.

    python tools/cuda_check.py --out cuda_check.json
    python tools/cuda_check.py --device cpu --batches 1,4        # dry run of the check itself

The device runs the same code path as the CPU minus the C++ CPU kernels (attention falls back
to the pure-torch path).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from everystop.results import write_result

PROMPTS = [list(range(1000, 1037)), list(range(3000, 3003)), list(range(200, 290))]


def _runner(dtype: str, device: str, blocks: int) -> Any:
    from everystop.config import CacheConfig, ModelConfig
    from everystop.executor.model_runner import ModelRunner

    return ModelRunner(ModelConfig(dtype=dtype, device=device),
                       CacheConfig(num_gpu_blocks_override=blocks, swap_space_gib=0.05),
                       max_model_len=2048)


def _seq(rid: str, tokens: list[int], start: int, blocks: list[int], step: int = 0) -> Any:
    from everystop.core.outputs import ScheduledSequence
    from everystop.sampling_params import SamplingParams

    return ScheduledSequence(rid, tokens[start:], start, blocks, True,
                             SamplingParams(temperature=0.0, max_tokens=256), output_index=step)


def check_correctness(device: str) -> dict[str, Any]:
    import torch

    cpu = _runner("float32", "cpu", 64)
    ref = cpu.forward_logits([_seq(str(i), p, 0, list(range(8 * i, 8 * i + 8)))
                              for i, p in enumerate(PROMPTS)])[1]
    out: dict[str, Any] = {}
    for dtype, tol in (("float32", 2e-3), ("bfloat16", 1.5)):
        dev = _runner(dtype, device, 64)
        packed = dev.forward_logits([_seq(str(i), p, 0, list(range(8 * i, 8 * i + 8)))
                                     for i, p in enumerate(PROMPTS)])[1].cpu()
        alone = torch.cat([dev.forward_logits([_seq("a", p, 0, list(range(40, 48)))])[1].cpu()
                           for p in PROMPTS])
        diff = (packed - ref).abs().max().item()
        out[dtype] = {"max_abs_diff_vs_cpu_fp32": diff, "tolerance": tol,
                      "packed_vs_alone": (packed - alone).abs().max().item(),
                      "top1_agree": float((packed.argmax(-1) == ref.argmax(-1)).float().mean()),
                      "ok": diff < tol and (packed - alone).abs().max().item() < tol}
        del dev
    from everystop import LLM, SamplingParams

    llm = LLM(device=device, max_num_seqs=8, num_gpu_blocks_override=256)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    cpu_llm = LLM(device="cpu", max_num_seqs=8, num_gpu_blocks_override=256)
    want = [o.token_ids for o in cpu_llm.generate(PROMPTS, params, use_tqdm=False)]
    # fp32 on two devices: greedy tokens agree except after a near-tie; require the first 4.
    out["engine_greedy"] = {"device": got, "cpu": want,
                            "ok": all(a[:4] == b[:4] for a, b in zip(got, want))}
    return out


def decode_tok_s(dtype: str, device: str, batch: int, steps: int = 32,
                 prompt_len: int = 128) -> dict[str, Any]:
    import torch

    per_seq = -(-(prompt_len + steps + 8) // 16)
    runner = _runner(dtype, device, per_seq * batch + 8)
    toks = [[(7 * i + j) % 30000 + 100 for j in range(prompt_len)] for i in range(batch)]
    blocks = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    computed = [0] * batch

    def step(k: int) -> None:
        seqs = [_seq(str(i), toks[i], computed[i], blocks[i], k) for i in range(batch)]
        sampled, logits = runner.forward_logits(seqs)
        res = runner.sampler(logits, [s.sampling_params for s in sampled], [k] * batch)
        for i, t in enumerate(res.token_ids):
            computed[i] = len(toks[i])
            toks[i].append(t)

    step(0)  # prefill
    step(1)  # first decode (warm-up)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for k in range(steps):
        step(k + 2)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return {"dtype": dtype, "batch": batch, "steps": steps, "ms_per_step": 1e3 * dt / steps,
            "tok_s": batch * steps / dt}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out")


def run(args: argparse.Namespace) -> int:
    """Exit status 1 when a correctness check fails, 2 when there is no CUDA device."""
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    start = time.perf_counter()
    result: dict[str, Any] = {"device": args.device, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name(0)
    result["correctness"] = check_correctness(args.device)
    result["decode"] = [decode_tok_s(dt, args.device, int(b))
                        for dt in args.dtypes.split(",") for b in args.batches.split(",")]
    result["wall_s"] = time.perf_counter() - start
    c = result["correctness"]
    result["ok"] = all(v["ok"] for v in c.values())
    write_result(result, args.out)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
