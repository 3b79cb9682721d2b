// The grouped LoRA delta kernel's interface (csrc/lora_delta.cpp), shared by the decoder
// stack (csrc/decoder_stack.cpp), which adds each projection's deltas in the same way.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <vector>

#include "simd.h"

namespace ES_NS {

// One output part of a linear (q, k or v of [q; k; v]): where adapter 0's A sits in the
// weights list, and the part's first output column.
struct LoraPart {
  int64_t first;
  int64_t col_offset;
};

// Rows of a pass by adapter: groups[k] = the rows whose slot is k (slots < 0: base rows).
std::vector<std::vector<int64_t>> lora_groups(const at::Tensor& slots, int64_t num_adapters);

// out += each row's delta, in place, for each part: adapter k's pair is
// weights[part.first + k * stride] (A) and the tensor after it (B), its delta landing in out's
// columns from part.col_offset.
void direct_lora_add_(at::Tensor& out, const at::Tensor& x,
                      const std::vector<std::vector<int64_t>>& groups, at::TensorList weights,
                      const std::vector<LoraPart>& parts, int64_t stride);

}  // namespace ES_NS
