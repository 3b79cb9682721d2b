// Block weights interleaved 16 output rows at a time (layers/quant.py's *_x16 formats), and the
// decode GEMV with int8 activations on them (csrc/quant_linear.cpp).
//
// Each group of 16 weight rows (16 output columns) is stored block by block; a block of the
// group holds its 16 rows' scales side by side, then their quants a dword at a time:
//
//   [16 x fp16 d] [16 x fp16 m: q4_1 only] [dword 0 of rows 0..15] [dword 1 of rows 0..15] ...
//
// Dword j of a row holds the bytes 4j..4j+3 of the standard block's quants: for q4_0/q4_1 its
// low nibbles are values 4j..4j+3 and its high nibbles values 16+4j..16+4j+3 (4 dwords); for
// q8_0 values 4j..4j+3 as unsigned bytes w + 128 (8 dwords). The sizes are the standard ones,
// so the tensor keeps its [n, row_bytes] shape. One 64-byte load is then dword j of 16
// columns, and one vpdpbusd against x's dword j broadcast adds 4 products into each of the 16
// columns' sums: no per-column horizontal sum, ~30 instructions per 512 multiply-adds where a
// standard block takes ~12 per 32.
//
// Every output lane's arithmetic is the same whatever the vector width, the dot instruction
// (integer sums are exact) and the number of rows: per block, acc = fma(float(isum), d * dx,
// acc), then for q4_1 acc = fma(m, dx * sum(qx), acc). So the AVX2 and AVX-512 builds, every
// dot path and every row count give bit-identical columns.
#pragma once

#include <cstdint>
#include <cstring>

#include "int_dots.h"
#include "simd.h"

namespace {

constexpr int64_t kX16 = 16;  // rows per interleaved group

// Per block of a group: the scales' bytes before the quants, and the quants' dwords per row.
constexpr int64_t x16_header(bool q4_1) { return q4_1 ? 64 : 32; }

// Row c (0..15) of a group's block `g` (standard block size `bytes`) back in the standard
// layout, into dst[bytes].
inline void x16_unpack_block(const uint8_t* g, int64_t bytes, int64_t c, uint8_t* dst) {
  const bool q8 = bytes == 34, q4_1 = bytes == 20;
  std::memcpy(dst, g + 2 * c, 2);
  if (q4_1) std::memcpy(dst + 2, g + 32 + 2 * c, 2);
  const int64_t off = q4_1 ? 4 : 2, dwords = q8 ? 8 : 4, hdr = x16_header(q4_1);
  for (int64_t j = 0; j < dwords; ++j) {
    const uint8_t* src = g + hdr + 64 * j + 4 * c;
    for (int t = 0; t < 4; ++t) dst[off + 4 * j + t] = q8 ? src[t] ^ 0x80 : src[t];
  }
}

// Weight row `row` of an interleaved weight (w: the whole tensor) as standard blocks.
inline void x16_unpack_row(const uint8_t* w, int64_t row_bytes, int64_t bytes, int64_t row,
                           uint8_t* dst) {
  const uint8_t* group = w + (row / kX16) * kX16 * row_bytes;
  const int64_t nb = row_bytes / bytes;
  for (int64_t b = 0; b < nb; ++b)
    x16_unpack_block(group + b * kX16 * bytes, bytes, row % kX16, dst + b * bytes);
}

#if defined(__AVX2__)

// x rounded to int8 per block (quant_linear.cpp's quantize_rows), from row r0 on.
struct XRows {
  const int8_t* q;      // [rows, k]
  const float* d;       // [rows, nb] scale
  const float* s;       // [rows, nb] d * sum(q)
  const int32_t* sum;   // [rows, nb] sum(q)
};

inline const int32_t* x_dwords(const XRows& x, int64_t k, int64_t row, int64_t b) {
  return reinterpret_cast<const int32_t*>(x.q + row * k + b * 32);
}

// The int32 a column's block dot starts from: q4_0 takes its nibbles as q - 8 and q8_0 its
// bytes as (w + 128) - 128.
template <int Bytes>
inline int32_t x16_start(const XRows& x, int64_t i) {
  if constexpr (Bytes == 18) return -8 * x.sum[i];
  if constexpr (Bytes == 34) return -128 * x.sum[i];
  return 0;
}

// 8 columns (one half of a group) at a time in 256-bit registers, for every dot path: Dot is
// quant_linear.cpp's DotMaddubs, DotAvxVnni or DotAvx512Vnni. vpmaddubsw saturates at 16 bits,
// which q8_0's unsigned bytes (up to 255) could reach, so that path takes q8_0 as |w| against
// sign(x, w) from 0 (the same exact integer sum).
template <typename Dot, int Bytes, int R>
void x16_columns_256(const XRows& x, int64_t k, const uint8_t* w, int64_t row_bytes,
                     int64_t n_begin, int64_t n_end, float* out, int64_t out_stride) {
  constexpr bool q8 = Bytes == 34, q4_1 = Bytes == 20;
  constexpr int64_t H = x16_header(q4_1), D = q8 ? 8 : 4;
  const int64_t nb = k / 32;
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  for (int64_t n = n_begin; n < n_end; n += kX16) {
    const uint8_t* group = w + n * row_bytes;
    for (int64_t h = 0; h < 2; ++h) {
      __m256 acc[R];
      for (int m = 0; m < R; ++m) acc[m] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = group + b * kX16 * Bytes;
        __m256i isum[R];
        for (int m = 0; m < R; ++m)
          isum[m] = _mm256_set1_epi32(Dot::kSigned8 && q8 ? 0 : x16_start<Bytes>(x, m * nb + b));
        for (int64_t j = 0; j < D; ++j) {
          const __m256i v =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + H + 64 * j + 32 * h));
          if constexpr (q8) {
            if constexpr (Dot::kSigned8) {
              const __m256i s = _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80)));
              const __m256i a = _mm256_sign_epi8(s, s);
              for (int m = 0; m < R; ++m)
                isum[m] = Dot::dot(isum[m], a,
                                   _mm256_sign_epi8(_mm256_set1_epi32(x_dwords(x, k, m, b)[j]), s));
            } else {
              for (int m = 0; m < R; ++m)
                isum[m] = Dot::dot(isum[m], v, _mm256_set1_epi32(x_dwords(x, k, m, b)[j]));
            }
          } else {
            const __m256i lo = _mm256_and_si256(v, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            for (int m = 0; m < R; ++m) {
              const int32_t* xd = x_dwords(x, k, m, b);
              isum[m] = Dot::dot(isum[m], lo, _mm256_set1_epi32(xd[j]));
              isum[m] = Dot::dot(isum[m], hi, _mm256_set1_epi32(xd[4 + j]));
            }
          }
        }
        const __m256 dw =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * h)));
        __m256 mw = _mm256_setzero_ps();
        if constexpr (q4_1)
          mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * h)));
        for (int m = 0; m < R; ++m) {
          const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[m * nb + b]));
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), scale, acc[m]);
          if constexpr (q4_1) acc[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.s[m * nb + b]), acc[m]);
        }
      }
      for (int m = 0; m < R; ++m) _mm256_storeu_ps(out + m * out_stride + n + 8 * h, acc[m]);
    }
  }
}

#if defined(__AVX512F__)
// vpdpbusd with x's dword broadcast from memory to all 16 lanes (AVX512-VNNI; the caller
// checks the flag). Inline assembly, as int_dots.h's dots.
inline __m512i vpdpbusd_bcast(__m512i acc, __m512i u, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*x));
  return acc;
}

// 16 columns (a whole group) per register; G groups side by side where few rows leave the
// dot chains short.
template <int Bytes, int R, int G>
void x16_columns_512(const XRows& x, int64_t k, const uint8_t* w, int64_t row_bytes,
                     int64_t n_begin, int64_t n_end, float* out, int64_t out_stride) {
  constexpr bool q8 = Bytes == 34, q4_1 = Bytes == 20;
  constexpr int64_t H = x16_header(q4_1), D = q8 ? 8 : 4;
  const int64_t nb = k / 32;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  int64_t n = n_begin;
  for (; n + G * kX16 <= n_end; n += G * kX16) {
    __m512 acc[R][G];
    for (int m = 0; m < R; ++m)
      for (int g = 0; g < G; ++g) acc[m][g] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      for (int g = 0; g < G; ++g) {
        const uint8_t* blk = w + (n + g * kX16) * row_bytes + b * kX16 * Bytes;
        __m512i isum[R];
        for (int m = 0; m < R; ++m) isum[m] = _mm512_set1_epi32(x16_start<Bytes>(x, m * nb + b));
        for (int64_t j = 0; j < D; ++j) {
          const __m512i v = _mm512_loadu_si512(blk + H + 64 * j);
          if constexpr (q8) {
            for (int m = 0; m < R; ++m) isum[m] = vpdpbusd_bcast(isum[m], v, x_dwords(x, k, m, b) + j);
          } else {
            const __m512i lo = _mm512_and_si512(v, low4);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            for (int m = 0; m < R; ++m) {
              const int32_t* xd = x_dwords(x, k, m, b);
              isum[m] = vpdpbusd_bcast(isum[m], lo, xd + j);
              isum[m] = vpdpbusd_bcast(isum[m], hi, xd + 4 + j);
            }
          }
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
        __m512 mw = _mm512_setzero_ps();
        if constexpr (q4_1)
          mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
        for (int m = 0; m < R; ++m) {
          const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[m * nb + b]));
          acc[m][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), scale, acc[m][g]);
          if constexpr (q4_1)
            acc[m][g] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.s[m * nb + b]), acc[m][g]);
        }
      }
    }
    for (int m = 0; m < R; ++m)
      for (int g = 0; g < G; ++g) _mm512_storeu_ps(out + m * out_stride + n + g * kX16, acc[m][g]);
  }
  if constexpr (G > 1) {
    if (n < n_end) x16_columns_512<Bytes, R, 1>(x, k, w, row_bytes, n, n_end, out, out_stride);
  }
}
#endif  // __AVX512F__

#endif  // __AVX2__

}  // namespace
