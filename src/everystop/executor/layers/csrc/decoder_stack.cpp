// The whole Llama decoder stack for a decode-sized batch in one op call.
//
// At a few rows a layer's work is ~0.25 ms of weight streaming, and reaching its ~9 kernels
// from Python (module calls, op dispatch, argument boxing, the shape checks) cost ~2 ms per
// 30-layer step: a fifth of the step. This op runs the same kernels, in the same order and on
// the same buffers, as the module path (models/llama.py with CPU kernels): the results are
// bit-identical, only the Python between them is gone.
//
// Per layer (6 weights: in_norm, qkv, o, post_norm, gate_up, down; each linear dense 16/32-bit
// or GGUF-style blocks, as its format says):
//   h = add_rms_norm_(residual, x, in_norm)           (layer 0: residual = x, h = rms_norm(x))
//   qkv = h @ qkv.T; rope q, k; store k, v in the cache slots
//   a = paged_attention(q) @ o.T
//   h = add_rms_norm_(residual, a, post_norm)
//   x = silu_mul(h @ gate_up.T) @ down.T
// and at the end norm(x + residual) with the final norm weight.
//
// decoder_stack_ext takes the families' differences as parameters, each as the layers apply
// it (models/decoder.py): a [q; k; v] bias added after the projection, an RMSNorm over each
// q and k head before rope, a sliding window and a score soft-cap in the attention, and
// Gemma's: an RMSNorm on the attention's and on the MLP's output (sandwich norms), tanh-GELU
// for the MLP's gate (GeGLU), the windowed layers' own rope tables, and a sparse
// mixture-of-experts block in place of a layer's MLP (csrc/moe_experts.cpp): where that layer
// has a router, its gate_up and down weights are the experts' stacked ones.
//
// LoRA adapters are parameters too (csrc/lora_delta.cpp): each row's adapter slot (-1: base)
// and the pass's adapters' (A, B^T) pairs, one per part of each projection (q, k, v, o, gate,
// up, down: a fused projection's parts apart, so no zero block of its block-diagonal B is read),
// whose deltas are added after each projection as layers/lora.py adds them. With no slots
// given the stack does no LoRA work at all.
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <c10/util/ArrayRef.h>
#include <torch/library.h>

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "lora.h"
#include "simd.h"

namespace ES_NS {
at::Tensor direct_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor direct_add_rms_norm_(at::Tensor residual, const at::Tensor& x, const at::Tensor& w,
                                double eps);
at::Tensor direct_silu_mul(const at::Tensor& gate_up);
void direct_rope_write_kv_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin,
                           at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& slots,
                           int64_t num_heads, int64_t num_kv_heads);
at::Tensor direct_project(const at::Tensor& x, const at::Tensor& w, int64_t fmt, bool int8_dot);
at::Tensor direct_moe_block(const at::Tensor& h, const at::Tensor& router,
                            const at::Tensor& gate_up, int64_t gate_up_fmt, const at::Tensor& down,
                            int64_t down_fmt, int64_t top_k, bool renormalize, bool int8_dot,
                            int64_t* chosen);
at::Tensor direct_paged_attention(const at::Tensor& q, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                  double scale, int64_t rows_per_item);
at::Tensor direct_paged_attention_ext(const at::Tensor& q, const at::Tensor& key_cache,
                                      const at::Tensor& value_cache,
                                      const at::Tensor& block_tables,
                                      const at::Tensor& query_start_loc,
                                      const at::Tensor& seq_lens, double scale,
                                      int64_t rows_per_item, int64_t window, double softcap);
}  // namespace ES_NS

namespace {

constexpr int64_t kWeightsPerLayer = 6;
constexpr int64_t kLinearsPerLayer = 4;  // qkv, o, gate_up, down
constexpr int64_t kLoraPartsPerLayer = 7;  // q, k, v, o, gate, up, down

// qkv_biases: none or one per layer; qk_norms: none or (q_norm, k_norm) per layer; windows:
// none or one per layer (0: no window); softcap 0: none; out_norms: none or (attention
// output norm, MLP output norm) per layer; gelu_tanh: GeGLU rather than SwiGLU; local_rope:
// none or (cos, sin) for the layers with a window; routers: none or one per layer (an empty
// tensor: that layer's MLP is dense), each MoE layer's top-k weights renormalized with
// moe_renormalize, and the number of experts it ran written to moe_chosen[layer].
// lora_slots: empty, or each row's index into the pass's adapters (-1: base); lora_weights:
// per adapter, per layer, per part (q, k, v, o, gate, up, down) its A then its B^T, both empty
// where the adapter does not target the part.
at::Tensor decoder_stack_ext(const at::Tensor& x0, at::TensorList weights,
                             at::IntArrayRef formats, at::TensorList key_caches,
                             at::TensorList value_caches, const at::Tensor& cos,
                             const at::Tensor& sin, const at::Tensor& slot_mapping,
                             const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                             const at::Tensor& seq_lens, const at::Tensor& final_norm,
                             double eps, double scale, int64_t num_heads, int64_t num_kv_heads,
                             int64_t rows_per_item, bool int8_dot, at::TensorList qkv_biases,
                             at::TensorList qk_norms, at::IntArrayRef windows, double softcap,
                             at::TensorList out_norms, bool gelu_tanh,
                             at::TensorList local_rope, at::TensorList routers,
                             int64_t moe_top_k, bool moe_renormalize, at::Tensor moe_chosen,
                             const at::Tensor& lora_slots, at::TensorList lora_weights) {
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kWeightsPerLayer * num_layers &&
                  static_cast<int64_t>(value_caches.size()) == num_layers,
              "decoder_stack: 6 weights and one K and one V cache per layer expected");
  TORCH_CHECK(static_cast<int64_t>(formats.size()) == kLinearsPerLayer * num_layers,
              "decoder_stack: one weight format per linear expected");
  TORCH_CHECK(x0.dim() == 2 && x0.is_contiguous(), "decoder_stack: x must be [tokens, hidden]");
  TORCH_CHECK(qkv_biases.empty() || static_cast<int64_t>(qkv_biases.size()) == num_layers,
              "decoder_stack: no qkv bias or one per layer expected");
  TORCH_CHECK(qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * num_layers,
              "decoder_stack: no q/k norms or two per layer expected");
  TORCH_CHECK(windows.empty() || static_cast<int64_t>(windows.size()) == num_layers,
              "decoder_stack: no windows or one per layer expected");
  TORCH_CHECK(out_norms.empty() || static_cast<int64_t>(out_norms.size()) == 2 * num_layers,
              "decoder_stack: no output norms or two per layer expected");
  TORCH_CHECK(local_rope.empty() || (local_rope.size() == 2 && !windows.empty()),
              "decoder_stack: local rope is (cos, sin), for the windowed layers");
  TORCH_CHECK(routers.empty() || (static_cast<int64_t>(routers.size()) == num_layers &&
                                  moe_chosen.scalar_type() == at::kLong &&
                                  moe_chosen.numel() == num_layers && moe_chosen.is_contiguous()),
              "decoder_stack: no routers, or one per layer and an int64 count per layer");
  const int64_t tokens = x0.size(0);
  const bool lora = lora_slots.defined() && lora_slots.numel() > 0;
  const int64_t lora_stride = 2 * kLoraPartsPerLayer * num_layers;  // tensors per adapter
  std::vector<std::vector<int64_t>> lora_rows;
  if (lora) {
    TORCH_CHECK(lora_slots.size(0) == tokens &&
                    static_cast<int64_t>(lora_weights.size()) % lora_stride == 0,
                "decoder_stack: one LoRA slot per row and 14 tensors per layer per adapter "
                "expected");
    lora_rows = ES_NS::lora_groups(lora_slots,
                                   static_cast<int64_t>(lora_weights.size()) / lora_stride);
  }
  // Adds the LoRA deltas of parts first_part.. of layer l to out, the parts' output columns
  // starting at `offsets`.
  auto add_lora = [&](at::Tensor& out, const at::Tensor& in, int64_t l, int64_t first_part,
                      std::initializer_list<int64_t> offsets) {
    if (!lora) return;
    std::vector<ES_NS::LoraPart> parts;
    int64_t part = first_part;
    for (int64_t offset : offsets)
      parts.push_back({2 * (l * kLoraPartsPerLayer + part++), offset});
    ES_NS::direct_lora_add_(out, in, lora_rows, lora_weights, parts, lora_stride);
  };
  // The residual stream is updated in place by every fused add + norm: a copy, so the
  // caller's tensor is left as it was.
  at::Tensor residual = x0.clone();
  at::Tensor x;
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor* w = weights.data() + l * kWeightsPerLayer;
    const int64_t* fmt = formats.data() + l * kLinearsPerLayer;
    const at::Tensor& key_cache = key_caches[l];
    const at::Tensor& value_cache = value_caches[l];
    const int64_t head_dim = key_cache.size(3);
    const int64_t q_size = num_heads * head_dim;

    at::Tensor h = l == 0 ? ES_NS::direct_rms_norm(residual, w[0], eps)
                          : ES_NS::direct_add_rms_norm_(residual, x, w[0], eps);
    at::Tensor qkv = ES_NS::direct_project(h, w[1], fmt[0], int8_dot);
    add_lora(qkv, h, l, 0, {0, q_size, q_size + num_kv_heads * head_dim});
    if (!qkv_biases.empty()) qkv = qkv.add(qkv_biases[l]);
    if (!qk_norms.empty()) {
      const int64_t kv_size = num_kv_heads * head_dim;
      at::Tensor qn = ES_NS::direct_rms_norm(qkv.narrow(1, 0, q_size).reshape({-1, head_dim}),
                                             qk_norms[2 * l], eps);
      at::Tensor kn = ES_NS::direct_rms_norm(
          qkv.narrow(1, q_size, kv_size).reshape({-1, head_dim}), qk_norms[2 * l + 1], eps);
      qkv = at::cat({qn.view({tokens, q_size}), kn.view({tokens, kv_size}),
                     qkv.narrow(1, q_size + kv_size, kv_size)}, 1);
    }
    const bool local = !local_rope.empty() && windows[l] > 0;
    ES_NS::direct_rope_write_kv_(qkv, local ? local_rope[0] : cos, local ? local_rope[1] : sin,
                                 key_cache, value_cache, slot_mapping, num_heads, num_kv_heads);
    // As CpuKernels.paged_attention: q handed over in fp32, the output cast back.
    at::Tensor q = qkv.narrow(1, 0, q_size).to(at::kFloat).contiguous()
                       .view({tokens, num_heads, head_dim});
    at::Tensor attn = ES_NS::direct_paged_attention_ext(
        q, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, rows_per_item,
        windows.empty() ? 0 : windows[l], softcap);
    attn = attn.to(x0.scalar_type()).reshape({tokens, q_size});
    at::Tensor o = ES_NS::direct_project(attn, w[2], fmt[1], int8_dot);
    add_lora(o, attn, l, 3, {0});
    if (!out_norms.empty()) o = ES_NS::direct_rms_norm(o, out_norms[2 * l], eps);
    h = ES_NS::direct_add_rms_norm_(residual, o, w[3], eps);
    if (!routers.empty() && routers[l].numel() > 0) {  // experts in place of the MLP
      x = ES_NS::direct_moe_block(h, routers[l], w[4], fmt[2], w[5], fmt[3], moe_top_k,
                                  moe_renormalize, int8_dot, moe_chosen.data_ptr<int64_t>() + l);
      if (!out_norms.empty()) x = ES_NS::direct_rms_norm(x, out_norms[2 * l + 1], eps);
      continue;
    }
    at::Tensor gate_up = ES_NS::direct_project(h, w[4], fmt[2], int8_dot);
    add_lora(gate_up, h, l, 4, {0, gate_up.size(1) / 2});
    at::Tensor act;
    if (gelu_tanh) {  // as layers/mlp.py: gelu(gate, tanh) * up, ATen's own ops
      const int64_t inter = gate_up.size(1) / 2;
      act = at::gelu(gate_up.narrow(1, 0, inter), "tanh").mul(gate_up.narrow(1, inter, inter));
    } else {
      act = ES_NS::direct_silu_mul(gate_up);
    }
    x = ES_NS::direct_project(act, w[5], fmt[3], int8_dot);
    add_lora(x, act, l, 6, {0});
    if (!out_norms.empty()) x = ES_NS::direct_rms_norm(x, out_norms[2 * l + 1], eps);
  }
  if (num_layers == 0) return ES_NS::direct_rms_norm(residual, final_norm, eps);
  return ES_NS::direct_add_rms_norm_(residual, x, final_norm, eps);
}

at::Tensor decoder_stack(const at::Tensor& x0, at::TensorList weights, at::IntArrayRef formats,
                         at::TensorList key_caches,
                         at::TensorList value_caches, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                         const at::Tensor& final_norm, double eps, double scale,
                         int64_t num_heads, int64_t num_kv_heads, int64_t rows_per_item,
                         bool int8_dot) {
  return decoder_stack_ext(x0, weights, formats, key_caches, value_caches, cos, sin,
                           slot_mapping, block_tables, query_start_loc, seq_lens, final_norm,
                           eps, scale, num_heads, num_kv_heads, rows_per_item, int8_dot, {}, {},
                           {}, 0.0, {}, false, {}, {}, 0, false, at::Tensor(), at::Tensor(), {});
}

}  // namespace

ES_LIBRARY_FRAGMENT(m) {
  m.def("decoder_stack(Tensor x, Tensor[] weights, int[] formats, Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, "
        "Tensor cos, Tensor sin, Tensor slot_mapping, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, Tensor final_norm, float eps, float scale, "
        "int num_heads, int num_kv_heads, int rows_per_item, bool int8_decode_dot) -> Tensor");
  m.def("decoder_stack_ext(Tensor x, Tensor[] weights, int[] formats, Tensor(a!)[] key_caches, "
        "Tensor(b!)[] value_caches, Tensor cos, Tensor sin, Tensor slot_mapping, "
        "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, Tensor final_norm, "
        "float eps, float scale, int num_heads, int num_kv_heads, int rows_per_item, "
        "bool int8_decode_dot, Tensor[] qkv_biases, Tensor[] qk_norms, int[] windows, "
        "float softcap, Tensor[] out_norms, bool gelu_tanh, Tensor[] local_rope, "
        "Tensor[] routers, int moe_top_k, bool moe_renormalize, Tensor(c!) moe_chosen, "
        "Tensor lora_slots, Tensor[] lora_weights) -> Tensor");
}

ES_LIBRARY_IMPL(m) {
  m.impl("decoder_stack", &decoder_stack);
  m.impl("decoder_stack_ext", &decoder_stack_ext);
}
