// Weight-only quantized matmuls for steps of many token rows: each tile of the weights is
// dequantized to bfloat16 once and then multiplied by every row, where torch's own CPU
// kernels (aten._weight_int4pack_mm_for_cpu, aten._weight_int8pack_mm) unpack the weights
// again for every few rows, so their time grows with the rows (37 ms at 1 row, 834 ms at 64
// for a 1B model's linears, docs/memory.md). The weights stay in those kernels' own layouts,
// so one resident copy serves both: torch's kernel for a few rows, this one above.
//
// A task dequantizes a tile of output rows into a bfloat16 buffer of its own, sized to stay
// in the core's L2 cache and laid out as the CPU's bf16 dot-product instructions read it
// (VNNI: [K / 2, rows, 2], pairs of k side by side), and multiplies the step's rows by it 32
// at a time with torch's batch-reduce GEMM micro-kernel (at::native::cpublas::brgemm:
// oneDNN's, on AMX where the CPU has it). Splitting the rows into fixed blocks bounds the
// kernel shapes it generates, and each output element is one dot product over K whatever
// the number of rows, so a row's result does not depend on the others.
//
// Built at run time by engine/attention/cpu_kernels.py (g++ -O3 -march=native) and
// registered as torch.ops.pagedserve_quant.int4_mm / int8_mm; `available()` says whether
// this CPU has the micro-kernel (engine/layers/quantization/linear.py asks before using them).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlockN = 64;            // rows per block of torch's int4 CPU layout
constexpr int64_t kTileBytes = 512 << 10;  // one task's dequantized tile: half an L2 cache
constexpr int64_t kBlockM = 32;            // token rows per micro-kernel call

// Output rows per task: whole layout blocks, as many as fit kTileBytes (at least one).
int64_t tile_rows(int64_t k, int64_t n) {
  const int64_t blocks = std::max<int64_t>(1, kTileBytes / (k * 2 * kBlockN));
  return std::min(n, blocks * kBlockN);
}

inline uint16_t to_bf16_bits(float f) {  // round to nearest even, as c10::BFloat16 does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float from_bf16(c10::BFloat16 v) { return static_cast<float>(v); }

// Where weight (k, column c) of a VNNI tile with `ld` columns lives.
inline int64_t vnni(int64_t k, int64_t c, int64_t ld) { return ((k >> 1) * ld + c) * 2 + (k & 1); }

// ------------------------------------------------------------------------------- int4
//
// torch 2.13's _convert_weight_to_int4pack_for_cpu layout, [N, K / 2] bytes: output rows in
// blocks of 64; in block b, byte (b * 64 * K / 2 + k * 32 + d) holds row 64b + d in its low
// nibble and row 64b + 32 + d in its high one. The last N % 64 rows (a multiple of 16, T of
// them) form one block where byte (k * T / 2 + d) holds rows 2d (low) and 2d + 1 (high).
// Dequantization: w = (q - 8) * scale + zero, with (scale, zero) at sz[k / group][n].
// tests/engine/test_quant_mm.py checks this reading against torch's own kernel.

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// One k of a 64-row block as four vectors of 16 floats: rows 0-15, 16-31, 32-47, 48-63.
inline void int4_k64(const uint8_t* src, const float* scale, const float* zero, __m512 w[4]) {
  const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m512i hi = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16)));
  const __m512i mask = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
  const __m512i q[4] = {_mm512_and_si512(lo, mask), _mm512_and_si512(hi, mask),
                        _mm512_srli_epi32(lo, 4), _mm512_srli_epi32(hi, 4)};
  for (int i = 0; i < 4; ++i)
    w[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q[i], eight)),
                           _mm512_load_ps(scale + 16 * i), _mm512_load_ps(zero + 16 * i));
}
#endif

// Dequantize one full 64-row block (codes of rows [n0, n0 + 64)) into columns [c0, c0 + 64)
// of the VNNI tile.
void int4_block64(const uint8_t* codes, const c10::BFloat16* sz, int64_t n_total, int64_t n0,
                  int64_t k_total, int64_t group, uint16_t* tile, int64_t ld, int64_t c0) {
  alignas(64) float scale[kBlockN], zero[kBlockN];
  for (int64_t g = 0; g < k_total / group; ++g) {
    const c10::BFloat16* pair = sz + (g * n_total + n0) * 2;
    for (int64_t r = 0; r < kBlockN; ++r) {
      scale[r] = from_bf16(pair[2 * r]);
      zero[r] = from_bf16(pair[2 * r + 1]);
    }
    for (int64_t k = g * group; k < (g + 1) * group; k += 2) {  // groups are even
      uint16_t* dst = tile + vnni(k, c0, ld);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
      __m512 even[4], odd[4];
      int4_k64(codes + k * 32, scale, zero, even);
      int4_k64(codes + (k + 1) * 32, scale, zero, odd);
      for (int i = 0; i < 4; ++i) {  // 16 columns' (k, k + 1) pairs: 16 bits each, side by side
        const __m512i e = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(even[i])));
        const __m512i o = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(odd[i])));
        _mm512_storeu_si512(dst + 32 * i, _mm512_or_si512(e, _mm512_slli_epi32(o, 16)));
      }
#else
      for (int64_t j = 0; j < 2; ++j) {
        const uint8_t* src = codes + (k + j) * 32;
        for (int64_t d = 0; d < 32; ++d) {
          const int lo = src[d] & 15, hi = src[d] >> 4;
          dst[2 * d + j] = to_bf16_bits(std::fma(static_cast<float>(lo - 8), scale[d], zero[d]));
          dst[2 * (d + 32) + j] =
              to_bf16_bits(std::fma(static_cast<float>(hi - 8), scale[d + 32], zero[d + 32]));
        }
      }
#endif
    }
  }
}

// The tail block of T = N % 64 rows (rows 2d and 2d + 1 share a byte); scalar, it is small.
void int4_tail(const uint8_t* codes, const c10::BFloat16* sz, int64_t n_total, int64_t n0,
               int64_t rows, int64_t k_total, int64_t group, uint16_t* tile, int64_t ld,
               int64_t c0) {
  for (int64_t k = 0; k < k_total; ++k) {
    const c10::BFloat16* pair = sz + ((k / group) * n_total + n0) * 2;
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t byte = codes[k * rows / 2 + r / 2];
      const int q = ((r & 1) ? byte >> 4 : byte & 15) - 8;
      tile[vnni(k, c0 + r, ld)] = to_bf16_bits(
          std::fma(static_cast<float>(q), from_bf16(pair[2 * r]), from_bf16(pair[2 * r + 1])));
    }
  }
}

// Dequantize output rows [n0, n0 + rows) (whole blocks, or the tail) into a VNNI tile.
void int4_tile(const uint8_t* packed, const c10::BFloat16* sz, int64_t n_total, int64_t k_total,
               int64_t group, int64_t n0, int64_t rows, uint16_t* tile) {
  const int64_t full = n_total / kBlockN * kBlockN;
  for (int64_t c = 0; c < rows;) {
    const int64_t n = n0 + c;
    if (n < full) {
      int4_block64(packed + n * k_total / 2, sz, n_total, n, k_total, group, tile, rows, c);
      c += kBlockN;
    } else {
      int4_tail(packed + full * k_total / 2, sz, n_total, n, n_total - n, k_total, group, tile,
                rows, c);
      c = rows;
    }
  }
}

// ------------------------------------------------------------------------------- shared

// Dequantize-and-multiply: `dequant(n0, rows, tile)` fills a VNNI tile of output rows
// [n0, n0 + rows); `scale` (or nullptr) multiplies each output column afterwards.
template <typename Dequant>
at::Tensor tiled_mm(const at::Tensor& x, int64_t n_total, const float* scale, Dequant dequant) {
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor out = at::empty({m, n_total}, x.options());
  const int64_t tn = tile_rows(k, n_total);
  const int64_t tasks = (n_total + tn - 1) / tn;
  const auto* xs = x.data_ptr<c10::BFloat16>();
  uint16_t* os = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> tile(static_cast<size_t>(k * tn));
    std::vector<float> acc(static_cast<size_t>(kBlockM * tn));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tn, rows = std::min(tn, n_total - n0);
      dequant(n0, rows, tile.data());
      for (int64_t m0 = 0; m0 < m; m0 += kBlockM) {
        const int64_t mb = std::min(kBlockM, m - m0);
        at::native::cpublas::brgemm(mb, rows, k, k, rows, rows, false, xs + m0 * k,
                                    reinterpret_cast<const c10::BFloat16*>(tile.data()),
                                    acc.data(), true);
        for (int64_t i = 0; i < mb; ++i)
          for (int64_t j = 0; j < rows; ++j)
            os[(m0 + i) * n_total + n0 + j] =
                to_bf16_bits(scale ? acc[i * rows + j] * scale[n0 + j] : acc[i * rows + j]);
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
  return out;
}

void check_x(const at::Tensor& x, int64_t k, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), op,
              ": x must be a contiguous 2-d bfloat16 tensor");
  TORCH_CHECK(x.size(1) == k && k % 2 == 0, op, ": x has ", x.size(1), " columns, the weight ", k);
}

bool available() { return at::native::cpublas::could_pack(at::kBFloat16); }

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, int64_t group_size,
                   const at::Tensor& scales_and_zeros) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "int4_mm: packed must be torch's contiguous [N, K / 2] uint8 int4 layout");
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  check_x(x, k, "int4_mm");
  TORCH_CHECK(n % 16 == 0 && group_size > 0 && group_size % 2 == 0 && k % group_size == 0,
              "int4_mm: bad shape");
  TORCH_CHECK(scales_and_zeros.scalar_type() == at::kBFloat16 && scales_and_zeros.is_contiguous() &&
                  scales_and_zeros.dim() == 3 && scales_and_zeros.size(0) == k / group_size &&
                  scales_and_zeros.size(1) == n && scales_and_zeros.size(2) == 2,
              "int4_mm: scales_and_zeros must be contiguous bfloat16 [K / group, N, 2]");
  const uint8_t* codes = packed.data_ptr<uint8_t>();
  const c10::BFloat16* sz = scales_and_zeros.data_ptr<c10::BFloat16>();
  return tiled_mm(x, n, nullptr, [&](int64_t n0, int64_t rows, uint16_t* tile) {
    int4_tile(codes, sz, n, k, group_size, n0, rows, tile);
  });
}

// ------------------------------------------------------------------------------- int8
//
// aten._weight_int8pack_mm's layout: codes [N, K] int8 and one scale per output row. The
// codes are exact in bfloat16, so the tile holds them as they are and the scale multiplies
// the result's columns (in fp32, before the one rounding to bfloat16).

// Output rows [0, rows) of `codes` (row stride k) into a VNNI tile.
void int8_tile(const int8_t* codes, int64_t k, int64_t rows, uint16_t* tile) {
  int64_t r0 = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  // 16 rows at a time: a gather takes 4 codes (k .. k + 3) of each, which become the VNNI
  // pairs (k, k + 1) and (k + 2, k + 3) of 16 columns.
  const __m512i offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                              6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(static_cast<int>(k)));
  auto bits = [](__m512i v, int shift) {  // byte `shift / 8` from the top, as bf16 bits
    const __m512i byte = _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - shift), 24);
    return _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_cvtepi32_ps(byte))));
  };
  if (k % 4 == 0 && k * 16 < (int64_t{1} << 31))
    for (; r0 + 16 <= rows; r0 += 16)
      for (int64_t kk = 0; kk < k; kk += 4) {
        const __m512i v = _mm512_i32gather_epi32(offsets, codes + r0 * k + kk, 1);
        _mm512_storeu_si512(tile + vnni(kk, r0, rows),
                            _mm512_or_si512(bits(v, 0), _mm512_slli_epi32(bits(v, 8), 16)));
        _mm512_storeu_si512(tile + vnni(kk + 2, r0, rows),
                            _mm512_or_si512(bits(v, 16), _mm512_slli_epi32(bits(v, 24), 16)));
      }
#endif
  for (int64_t r = r0; r < rows; ++r)
    for (int64_t kk = 0; kk < k; ++kk)
      tile[vnni(kk, r, rows)] = to_bf16_bits(static_cast<float>(codes[r * k + kk]));
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "int8_mm: codes must be a contiguous [N, K] int8 tensor");
  const int64_t n = codes.size(0), k = codes.size(1);
  check_x(x, k, "int8_mm");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == n, "int8_mm: scales must be [N]");
  const at::Tensor scale = scales.to(at::kFloat).contiguous();
  const int8_t* q = codes.data_ptr<int8_t>();
  return tiled_mm(x, n, scale.data_ptr<float>(), [&](int64_t n0, int64_t rows, uint16_t* tile) {
    int8_tile(q + n0 * k, k, rows, tile);
  });
}

}  // namespace

TORCH_LIBRARY(pagedserve_quant, m) {
  m.def("available() -> bool", &available);
  m.def("int4_mm(Tensor x, Tensor packed, int group_size, Tensor scales_and_zeros) -> Tensor");
  m.def("int8_mm(Tensor x, Tensor codes, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_quant, CPU, m) {
  m.impl("int4_mm", &int4_mm);
  m.impl("int8_mm", &int8_mm);
}
