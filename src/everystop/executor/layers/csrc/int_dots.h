// The pieces of the integer block dots (int8 activations against Q8_0/Q4_0/Q4_1 weights) that
// the decode GEMV (csrc/quant_linear.cpp) and the expert kernel (csrc/moe_experts.cpp) both
// use. One copy, because the two kernels' outputs must match bit for bit: an expert's columns
// end in the same 8-lane sum as a projection's.
#pragma once

#include <strings.h>

#include <cstdint>
#include <cstdlib>

#include "simd.h"

#if defined(__AVX2__)

// Internal linkage: each ISA's library is loaded into the same process, and these names are the
// same in every build.
namespace {

// Whether the dots may take AVX512-VNNI: the CPU has it and the environment does not cap the
// ISA at AVX2 (ATEN_CPU_CAPABILITY=avx2 or ONEDNN_MAX_CPU_ISA=AVX2: an AVX2 machine reproduced
// on a wider one, as cpu_kernels.cpu_flags reads it), so the reproduction takes the dot path an
// AVX2 machine has.
inline bool avx512_vnni_allowed() {
  static const bool allowed = [] {
    if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512vl")) return false;
    const char* aten = std::getenv("ATEN_CPU_CAPABILITY");
    const char* onednn = std::getenv("ONEDNN_MAX_CPU_ISA");
    return !(aten != nullptr && strcasecmp(aten, "avx2") == 0) &&
           !(onednn != nullptr && strcasecmp(onednn, "avx2") == 0);
  }();
  return allowed;
}

// The 8 lanes of v summed as ((0+4) + (2+6)) + ((1+5) + (3+7)): every integer-dot output ends
// in this order.
inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// A nibble-packed block's 16 bytes as its 32 values in [0, 15]: the low nibbles (values 0..15)
// in the low 16 bytes, the high nibbles (values 16..31) in the high 16.
inline __m256i nibbles_u8(const uint8_t* qs) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

// acc + the dot of unsigned bytes u and signed bytes s, each int32 lane summing 4 products
// (vpdpbusd). NOTE: inline assembly, not intrinsics: an intrinsic needs its target enabled in
// every function it is inlined into, so a loop body shared by several dot paths could not be
// inlined into each path's entry point. Callers check the CPU flag first.
inline __m256i vpdpbusd_vex(__m256i acc, __m256i u, __m256i s) {  // AVX-VNNI
  asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(s));
  return acc;
}

inline __m256i vpdpbusd_evex(__m256i acc, __m256i u, __m256i s) {  // AVX512-VNNI, 256 bits
  asm("%{evex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(s));
  return acc;
}

#if defined(__AVX512F__)
inline __m512i vpdpbusd_512(__m512i acc, __m512i u, __m512i s) {  // AVX512-VNNI, 512 bits
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}
#endif

}  // namespace

#endif  // __AVX2__
