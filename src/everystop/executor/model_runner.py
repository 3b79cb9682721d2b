"""Runs one scheduled step on the model: swaps, packed forward, logits for the sampled rows,
sampling. Owns the model, the KV pools and the sampler for one device.

Under tensor parallelism every rank runs one ModelRunner over its shard with the same steps, in
the same order (the collectives inside the forward pass pair them up); only rank 0 gets logits
and samples.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import OrderedDict

import numpy as np
import torch

from everystop.config import CacheConfig, ConfigError, ModelConfig
from everystop.core.outputs import ModelOutput, ScheduledSequence, SchedulerOutput
from everystop.core.sliding_window import SlidingWindow
from everystop.executor.block_gemm_choice import choose_block_gemm_bf16
from everystop.executor.dtype_choice import choose_dtype, weights_are_blocks
from everystop.executor.inputs import ModelInputs, build_inputs
from everystop.executor.int8_choice import choose_int8_decode_dot
from everystop.executor.kv_pool import KVPool
from everystop.executor.layers.cpu_kernels import load_cpu_kernels
from everystop.executor.layers.linear import fp32_gemm_is_faster, onednn_bf16_gemm_supported
from everystop.executor.layers.lora import adapter_dtype
from everystop.executor.layers.parallel import SINGLE, ParallelContext
from everystop.executor.lora.manager import LoraManager
from everystop.executor.models.decoder import Backends, DecoderForCausalLM, KVCache, lora_targets
from everystop.executor.models.loader import DTYPES, load_model, weight_memory
from everystop.executor.onednn_caches import bound_onednn_caches
from everystop.executor.prompt_logprobs import plan_prompt_logprobs, score
from everystop.executor.sampler import Sampler
from everystop.executor.verify_rows import per_position_rows
from everystop.sampling_params import SamplingParams
from everystop.startup_memory import checkpoint

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
logger = logging.getLogger(__name__)

# CPU KV pool when --kv-cache-memory is not given: this share of the memory available at
# start-up (after the weights are loaded), within these bounds.
CPU_KV_FRACTION = 0.2
CPU_KV_MIN_BYTES = 256 << 20
CPU_KV_MAX_BYTES = 2 << 30


def usable_cpus() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def select_backends(config: ModelConfig, blocks: bool, log: bool = True) -> Backends:
    """The kernels the layers call, chosen once from the config, the CPU's flags, whether the
    weights are held as quantized blocks (`blocks`, `weights_are_blocks`: int8 activations and
    bf16 tiles for them) and (for 16-bit weights with cpu_16bit_gemm="auto") a GEMM timed both
    ways. `log`: log what `auto` chose and why."""
    kernels = None
    if torch.device(config.device).type == "cpu":
        fp32_gemm = config.cpu_16bit_gemm == "fp32"
        # The bf16 tiles call oneDNN's bf16 GEMM directly, with no fallback: on a CPU where
        # oneDNN cannot build one (AVX2-only) every block-weight prefill would fail, so
        # "native" is refused here by name. (fp16 and dense weights go through F.linear,
        # which falls back to torch's own kernels.)
        native_ok = config.dtype != "bfloat16" or onednn_bf16_gemm_supported()
        if config.cpu_16bit_gemm == "native" and not native_ok:
            raise ConfigError("cpu_16bit_gemm 'native': this CPU's oneDNN has no bfloat16 "
                              "GEMM (it needs AVX-512 or AMX); use 'auto' or 'fp32'")
        if config.cpu_16bit_gemm == "auto" and config.dtype != "float32":
            fp32_gemm = not native_ok or fp32_gemm_is_faster(DTYPES[config.dtype])
        kernels = load_cpu_kernels(config.cpu_kernels, fp32_gemm,
                                   batch_invariant=config.batch_invariant)
    int8_dot, why = choose_int8_decode_dot(config, kernels, blocks)
    if log and config.int8_decode_dot == "auto":
        logger.info("int8 decode dot auto: %s (%s)", "on" if int8_dot else "off", why)
    if kernels is not None and int8_dot:
        # int8 rounding turns a last-bit difference from another row count into a visible one
        # (ModelConfig.int8_decode_dot), so every row computes as it would alone.
        kernels = dataclasses.replace(kernels, int8_decode_dot=True, batch_invariant=True)
    block_bf16, why = choose_block_gemm_bf16(config, kernels, blocks)
    if log and config.cpu_16bit_gemm == "auto" and kernels is not None:
        logger.info("block-weight GEMM auto: %s (%s)", "bf16" if block_bf16 else "fp32", why)
    if kernels is not None and block_bf16:
        kernels = dataclasses.replace(kernels, block_gemm_bf16=True)
    if config.batch_invariant and kernels is None:
        raise ConfigError("batch_invariant needs the CPU kernels, and none built here (see the "
                          "warnings above)")
    return Backends(kernels, config.attention_backend, config.decoder_stack)


def kv_cache_dtype(cache_config: CacheConfig, model_dtype: torch.dtype,
                   backends: Backends) -> torch.dtype:
    """The KV pool's element type: as configured, or for "auto" 16-bit where the CPU kernels
    run (their attention reads 16-bit blocks in place or widens each block once; it streams
    half the bytes: benchmarks/results/attention_bench*.json), else the model's dtype."""
    if cache_config.kv_cache_dtype != "auto":
        return DTYPES[cache_config.kv_cache_dtype]
    if backends.kernels is not None and backends.attention in ("auto", "kernel"):
        # bf16 activations keep bf16 K/V (same range); otherwise fp16's finer mantissa.
        return torch.bfloat16 if model_dtype == torch.bfloat16 else torch.float16
    return model_dtype


# Loaded weights by (path, dtype, device, backends). Inference never writes to them, so engines
# in one process (tests, benchmarks comparing modes) share one copy instead of reloading.
_MODELS: OrderedDict[tuple[str | None, str, str, Backends, str], DecoderForCausalLM] = OrderedDict()
_MAX_SHARED_MODELS = 2


def shared_model(path: str | None, dtype: str, device: str,
                  backends: Backends, quantization: str = "auto") -> DecoderForCausalLM:
    key = (path, dtype, device, backends, quantization)
    model = _MODELS.get(key)
    if model is None:
        model = load_model(path, dtype, device, backends=backends, quantization=quantization)
        _MODELS[key] = model
        while len(_MODELS) > _MAX_SHARED_MODELS:
            _MODELS.popitem(last=False)
    _MODELS.move_to_end(key)
    return model


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 max_model_len: int | None, max_num_batched_tokens: int = 2048,
                 parallel: ParallelContext = SINGLE) -> None:
        """max_model_len None: the model's context length, capped by the pool's tokens."""
        # One read of the weight file's header serves every choice that depends on it.
        blocks = weights_are_blocks(model_config.model, model_config.quantization)
        dtype, why = choose_dtype(model_config, blocks)
        if model_config.dtype == "auto" and parallel.rank == 0:
            logger.info("dtype auto: %s (%s)", dtype, why)
        model_config = dataclasses.replace(model_config, dtype=dtype)
        self.model_config, self.cache_config = model_config, cache_config
        self.parallel = parallel
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device = torch.device(model_config.device)
        self.dtype = DTYPES[model_config.dtype]
        self.block_size = cache_config.block_size
        if self.device.type == "cpu":
            # Before the first oneDNN GEMM of this process (the model load may run one).
            bound_onednn_caches(model_config.onednn_cache_capacity)
            # Tensor-parallel CPU ranks share the cores: each takes its share.
            threads = model_config.num_threads or usable_cpus()
            torch.set_num_threads(max(1, threads // parallel.world_size))
        self.num_threads = torch.get_num_threads()
        self.backends = select_backends(model_config, blocks, log=parallel.rank == 0)
        if parallel.rank == 0:
            kernels = self.backends.kernels
            gemm = ("" if kernels is None or self.dtype == torch.float32 else
                    f"; {model_config.dtype} prefill GEMMs in "
                    f"{'fp32' if kernels.fp32_gemm_for_16bit else model_config.dtype}")
            logger.info("CPU kernels: %s; attention: %s%s%s",
                        kernels.isa if kernels else "off (plain torch)", self.backends.attention,
                        gemm, "; batch-invariant" if kernels and kernels.batch_invariant else "")
        # NOTE: a tensor-parallel shard is never shared: it is bound to its process group.
        # NOTE: a model serving LoRA adapters is never shared either: its bank is its own.
        serves_lora = bool(model_config.lora_modules) or model_config.enable_lora
        self.model: DecoderForCausalLM = (
            shared_model(model_config.model, model_config.dtype, model_config.device,
                          self.backends, model_config.quantization)
            if parallel.world_size == 1 and not serves_lora else
            load_model(model_config.model, model_config.dtype, model_config.device, parallel,
                       self.backends, model_config.quantization))
        checkpoint("weights")
        args = self.model.args
        if max_model_len is not None and max_model_len > args.max_position_embeddings:
            raise ConfigError(f"max_model_len {max_model_len} exceeds the model's context "
                              f"length {args.max_position_embeddings}")
        self.sliding_window = args.sliding_window  # the KV cache manager's (DecoderArgs)
        # The CUDA pool sizing profiles a prefill of sequences this long; capped below.
        self.max_model_len = max_model_len or args.max_position_embeddings
        self.kv_dtype = kv_cache_dtype(cache_config, self.dtype, self.backends)
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        self.num_kv_heads = self.model.num_local_kv_heads
        # K and V, every layer, every KV head this rank caches: bytes per token *per shard*.
        self.bytes_per_token = 2 * args.num_layers * self.num_kv_heads * args.head_dim * elem
        self.bytes_per_block = self.bytes_per_token * self.block_size
        num_cpu_blocks = int(cache_config.swap_space_gib * (1 << 30)) // self.bytes_per_block
        # NOTE: the block tables are shared by all ranks, so every rank's pool must have the
        # same number of blocks: the smallest any rank can afford (shards may differ in size).
        num_device_blocks = parallel.all_min(self._num_device_blocks())
        num_cpu_blocks = parallel.all_min(num_cpu_blocks)
        self.pool = KVPool(args.num_layers, self.num_kv_heads, args.head_dim, self.block_size,
                           num_device_blocks, num_cpu_blocks, self.kv_dtype, self.device)
        checkpoint("KV pool")
        if max_model_len is None:  # as vLLM: one sequence must fit what admission may use
            usable = self.num_gpu_blocks - int(cache_config.watermark * self.num_gpu_blocks)
            # A windowed sequence holds only its window's blocks (core/sliding_window.py; the
            # cache keeps one block more, for released entries): the pool caps its length only
            # where even those do not fit.
            held = (SlidingWindow(self.sliding_window, self.block_size).max_blocks_held(
                self.max_model_len, max_num_batched_tokens) if self.sliding_window else None)
            if held is None or held + 1 > usable:
                self.max_model_len = min(self.max_model_len, usable * self.block_size)
        self.sampler = Sampler(self.device, model_config.seed, self.backends.kernels)
        self.lora: LoraManager | None = None
        if serves_lora:
            first = lora_targets(self.model.model.layers[0])["qkv_proj"]
            held = adapter_dtype(self.dtype, first.weight.dtype, self.backends.kernels)
            if held != self.dtype and parallel.rank == 0:
                logger.info("LoRA adapters held in %s (the base's projections are held below "
                            "%s)", held, self.dtype)
            self.lora = LoraManager(self.model, held, model_config.max_lora_rank,
                                    model_config.max_cpu_loras)
            for lora_id, (_, path) in enumerate(model_config.lora_modules):
                self.lora.load(lora_id, path)
        self.weight_bytes, self.num_params = weight_memory(self.model)
        if parallel.rank == 0:
            logger.info("weights: %.1f MiB resident for %.1fM parameters (%.2f bytes/param, "
                        "quantization=%s); KV pool: %.1f MiB", self.weight_bytes / 2**20,
                        self.num_params / 1e6, self.weight_bytes / max(self.num_params, 1),
                        model_config.quantization,
                        self.num_gpu_blocks * self.bytes_per_block / 2**20)

    def weight_bytes_last_pass(self) -> int:
        """Bytes of weights the last forward pass read (DecoderForCausalLM's count)."""
        return self.model.weight_bytes_last_pass()

    @property
    def num_gpu_blocks(self) -> int:
        return self.pool.num_device_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.pool.num_host_blocks

    def describe_capacity(self) -> str:
        """One line on KV capacity and max_model_len, for startup logs."""
        tokens_per_seq = self.max_model_len
        blocks_per_seq = -(-tokens_per_seq // self.block_size)
        mib = self.num_gpu_blocks * self.bytes_per_block / 2**20
        shard = (f"rank 0 of {self.parallel.world_size} (per shard): "
                 if self.parallel.world_size > 1 else "")
        dtype = str(self.kv_dtype).removeprefix("torch.")
        auto = " (auto)" if self.cache_config.kv_cache_dtype == "auto" else ""
        return (f"KV cache: {shard}{dtype}{auto}, {self.bytes_per_token} B/token, "
                f"{self.num_gpu_blocks} device blocks "
                f"x {self.block_size} tokens ({mib:.0f} MiB), {self.num_cpu_blocks} host swap "
                f"blocks; max_model_len {tokens_per_seq} (model context "
                f"{self.model.args.max_position_embeddings}; fits "
                f"{self.num_gpu_blocks // blocks_per_seq} such sequences)")

    # --- sizing ----------------------------------------------------------------------------

    def _num_device_blocks(self) -> int:
        cc = self.cache_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if self.device.type != "cuda":
            return max(self._cpu_kv_bytes() // self.bytes_per_block, 1)
        # CUDA: what is left of the allowed fraction after weights and peak activations.
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        self._dummy_forward(self.max_num_batched_tokens)
        torch.cuda.synchronize(self.device)
        activations = torch.cuda.max_memory_allocated(self.device) - weights
        _, total = torch.cuda.mem_get_info(self.device)
        free = cc.gpu_memory_utilization * total - weights - activations
        torch.cuda.empty_cache()
        if free < self.bytes_per_block:
            raise RuntimeError(f"no room for the KV cache: weights {weights / 2**30:.2f} GiB + "
                               f"activations {activations / 2**30:.2f} GiB exceed "
                               f"{cc.gpu_memory_utilization:.0%} of {total / 2**30:.1f} GiB")
        return int(free // self.bytes_per_block)

    def _cpu_kv_bytes(self) -> int:
        if self.cache_config.kv_cache_memory is not None:
            return self.cache_config.kv_cache_memory
        available = available_memory_bytes() or 4 * CPU_KV_MAX_BYTES
        return int(min(max(CPU_KV_FRACTION * available, CPU_KV_MIN_BYTES), CPU_KV_MAX_BYTES))

    def _scratch_caches(self, num_blocks: int) -> list[KVCache]:
        a = self.model.args
        shape = (num_blocks, self.block_size, self.num_kv_heads, a.head_dim)
        return [(torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                 torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
                for _ in range(a.num_layers)]

    @torch.inference_mode()
    def _dummy_forward(self, num_tokens: int) -> None:
        """A prefill of `num_tokens` tokens (split into sequences of at most max_model_len) on a
        scratch cache: profiles peak activation memory and times prefill."""
        seq_len = min(num_tokens, self.max_model_len)
        n_seqs = -(-num_tokens // seq_len)
        per_seq = -(-seq_len // self.block_size)
        caches = self._scratch_caches(per_seq * n_seqs)
        seqs = []
        for i in range(n_seqs):
            n = min(seq_len, num_tokens - i * seq_len)
            seqs.append(ScheduledSequence(
                request_id=f"dummy{i}", token_ids=[0] * n, start_pos=0,
                block_ids=list(range(i * per_seq, (i + 1) * per_seq)), sample=True,
                sampling_params=_GREEDY))
        inputs = build_inputs(seqs, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, caches, inputs.meta,
                            inputs.sample_indices)
        self.model.compute_logits(hidden)

    # --- micro-measurements for the preemption cost model ----------------------------------

    def measure_prefill_tokens_per_s(self, num_tokens: int = 64) -> float:
        """Prefill throughput of one `num_tokens` prompt (after a warm-up run)."""
        self._dummy_forward(num_tokens)
        self._sync()
        start = time.perf_counter()
        self._dummy_forward(num_tokens)
        self._sync()
        return num_tokens / max(time.perf_counter() - start, 1e-9)

    def measure_swap_bytes_per_s(self, num_blocks: int = 8) -> float:
        """Device->host->device copy bandwidth over scratch blocks (the real pools untouched)."""
        a = self.model.args
        shape = (a.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, a.head_dim)
        dev = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        host = torch.empty(shape, dtype=self.kv_dtype, pin_memory=self.device.type == "cuda")
        host.copy_(dev)
        self._sync()
        start = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        dev.copy_(host, non_blocking=True)
        self._sync()
        return 2 * dev.numel() * dev.element_size() / max(time.perf_counter() - start, 1e-9)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # --- the step --------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        """Swap blocks, run the scheduled tokens, sample one token per `sample` sequence (the
        token at each of a speculating row's 1+k positions, each sampled as plain decoding
        would sample it there: executor/verify_rows.py)."""
        start = time.perf_counter()
        # NOTE: out before in: a device block swapped out this step may be the target of a
        # swap-in in the same step.
        self.pool.swap_out(sched.blocks_to_swap_out)
        self.pool.swap_in(sched.blocks_to_swap_in)
        output = ModelOutput()
        if sched.scheduled:
            seqs = sched.scheduled
            inputs = build_inputs(seqs, self.block_size, self.device)
            sampled = [seqs[i] for i in inputs.sample_seq_indices]
            plan = plan_prompt_logprobs(seqs, inputs.meta.query_start_loc_list, self.device)
            rows = inputs.sample_indices if plan is None else torch.cat(
                [inputs.sample_indices, plan.rows])
            # NOTE: every tensor-parallel rank runs the same rows through the last layer and
            # the LM head.
            logits = self.model.compute_logits(self._forward_rows(inputs, rows, seqs,
                                                                  sched.running_lora_ids))
            if plan is not None and logits is not None:
                output.prompt_logprobs = score(logits[len(sampled):], plan)
                logits = logits[:len(sampled)]
            if sampled and logits is not None:  # None: a tensor-parallel rank other than 0
                sampled, logits = _drop_non_finite(sampled, logits, output)
            if sampled and logits is not None:
                rows = per_position_rows(sampled)
                result = self.sampler(logits, [s.sampling_params for s in rows],
                                      [s.output_index for s in rows], rows)
                verified, verified_lp = output.verified_token_ids, output.verified_logprobs
                for seq, token, logprob in zip(sampled, result.token_ids, result.logprobs):
                    rid = seq.request_id
                    output.sampled_token_ids[rid] = token
                    if seq.num_draft_tokens:  # one of a speculating row's 1+k, in order
                        verified.setdefault(rid, []).append(token)
                        if logprob is not None:
                            verified_lp.setdefault(rid, []).append(logprob)
                    elif logprob is not None:
                        output.logprobs[rid] = logprob
                for rid in output.failed:  # a part of a row's verification is none of it
                    verified.pop(rid, None)
                    verified_lp.pop(rid, None)
        self._sync()
        output.execute_time_s = time.perf_counter() - start
        return output

    @torch.inference_mode()
    def forward_logits(self, seqs: list[ScheduledSequence]
                       ) -> tuple[list[ScheduledSequence], torch.Tensor | None]:
        """Run the packed forward pass; return the sequences with `sample` set and their
        float32 logits [N, vocab] (lm_head runs only on those rows; None on ranks other than 0
        under tensor parallelism)."""
        inputs = build_inputs(seqs, self.block_size, self.device)
        logits = self.model.compute_logits(self._forward_rows(inputs, inputs.sample_indices,
                                                              seqs))
        return [seqs[i] for i in inputs.sample_seq_indices], logits

    def _forward_rows(self, inputs: ModelInputs, rows: torch.Tensor,
                      seqs: list[ScheduledSequence],
                      running_lora_ids: frozenset[int] = frozenset()) -> torch.Tensor:
        """The final hidden states of `rows` (in that order, repeats allowed): the model
        computes its last layer for those rows only, so it is given them sorted and unique.
        Rows of requests with a LoRA adapter get its deltas."""
        if rows is inputs.sample_indices:  # one last row per sampled sequence: already so
            wanted, order = rows, None
        else:
            wanted, order = torch.unique(rows, sorted=True, return_inverse=True)
        if self.lora is None:
            hidden = self.model(inputs.input_ids, inputs.positions, self.pool.kv_caches,
                                inputs.meta, wanted)
        else:
            with self.lora.running(seqs, wanted, running_lora_ids):
                hidden = self.model(inputs.input_ids, inputs.positions, self.pool.kv_caches,
                                    inputs.meta, wanted)
        return hidden if order is None else hidden[order]

    @property
    def kv_caches(self) -> list[KVCache]:
        return self.pool.kv_caches



def _drop_non_finite(sampled: list[ScheduledSequence], logits: torch.Tensor,
                     output: ModelOutput) -> tuple[list[ScheduledSequence], torch.Tensor]:
    """Rows with a NaN or infinite logit cannot be sampled from: their sequences are reported
    in `output.failed` (the engine ends them with an error) and the others sample as usual."""
    # One reduction settles the usual case: the sum is finite only when every logit is (a NaN
    # or an infinity makes it NaN or infinite); a non-finite sum (an overflow too) is then
    # checked row by row. (isfinite over [N, vocab] is five passes: ~5x the time per step.)
    if _sum_is_finite(logits):
        return sampled, logits
    finite = torch.isfinite(logits).all(dim=-1)
    keep = []
    for i, (seq, ok) in enumerate(zip(sampled, finite.tolist())):
        if ok:
            keep.append(i)
        else:
            output.failed[seq.request_id] = "the model produced non-finite logits (NaN or Inf)"
    return [sampled[i] for i in keep], logits[keep]


def _sum_is_finite(logits: torch.Tensor) -> bool:
    """Whether the sum of every logit is finite. On the CPU numpy sums on this thread: torch
    splits a vocabulary row's sum over its OpenMP pool, whose wake-up costs more than the sum
    itself (measured on a loaded 2-core host: ~20 us here against ~0.9 ms)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return bool(torch.isfinite(logits.sum()))
    with np.errstate(all="ignore"):  # inf - inf or an overflow: the rows then decide
        return bool(np.isfinite(logits.numpy().sum()))
