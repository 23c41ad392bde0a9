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

// Output rows per task: whole layout blocks, at most what fits kTileBytes (at least one
// block), and small enough that every thread gets work: a 576-row projection on 2 threads is
// 5 + 4 blocks, not 7 + 2.
int64_t tile_rows(int64_t k, int64_t n) {
  const int64_t blocks = (n + kBlockN - 1) / kBlockN;
  const int64_t fit = std::max<int64_t>(1, kTileBytes / (k * 2 * kBlockN));
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t tasks = std::max((blocks + fit - 1) / fit, std::min(blocks, threads));
  return std::min(n, (blocks + tasks - 1) / tasks * kBlockN);
}

// A thread's scratch buffer, kept between calls (a fresh zero-filled one per call cost more
// than dequantizing a small projection).
template <typename T>
T* scratch(size_t count) {
  static thread_local std::vector<T> buffer;
  if (buffer.size() < count) buffer.resize(count);
  return buffer.data();
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
// 16-bit lanes [e0 .. e15, o0 .. o15] -> [e0, o0, e1, o1, ...]: two k's of 16 columns as VNNI.
const __m512i kInterleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                             24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                             1, 16, 0);

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
      for (int i = 0; i < 4; ++i) {  // 16 columns' (k, k + 1) pairs, side by side
        const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd[i], even[i]));
        _mm512_storeu_si512(dst + 32 * i, _mm512_permutexvar_epi16(kInterleave, both));
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

// Hands the thread's AMX tile state back when a task ends, also when brgemm throws.
struct BrgemmRelease {
  ~BrgemmRelease() { at::native::cpublas::brgemm_release(true); }
};

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
    const BrgemmRelease release;
    uint16_t* tile = scratch<uint16_t>(static_cast<size_t>(k * tn));
    float* acc = scratch<float>(static_cast<size_t>(kBlockM * tn));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tn, rows = std::min(tn, n_total - n0);
      dequant(n0, rows, tile);
      for (int64_t m0 = 0; m0 < m; m0 += kBlockM) {
        const int64_t mb = std::min(kBlockM, m - m0);
        at::native::cpublas::brgemm(mb, rows, k, k, rows, rows, false, xs + m0 * k,
                                    reinterpret_cast<const c10::BFloat16*>(tile), acc, true);
        for (int64_t i = 0; i < mb; ++i)
          for (int64_t j = 0; j < rows; ++j)
            os[(m0 + i) * n_total + n0 + j] =
                to_bf16_bits(scale ? acc[i * rows + j] * scale[n0 + j] : acc[i * rows + j]);
      }
    }
  });
  return out;
}

void check_x(const at::Tensor& x, int64_t n, int64_t k, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), op,
              ": x must be a contiguous 2-d bfloat16 tensor");
  TORCH_CHECK(x.size(1) == k, op, ": x has ", x.size(1), " columns, the weight ", k);
  TORCH_CHECK(n > 0 && k > 0 && k % 2 == 0, op, ": the weight must have rows and an even, ",
              "nonzero number of columns (the bf16 pairs of the micro-kernel), not [", n, ", ",
              k, "]");
}

bool available() { return at::native::cpublas::could_pack(at::kBFloat16); }

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, int64_t group_size,
                   const at::Tensor& scales_and_zeros) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "int4_mm: packed must be torch's contiguous [N, K / 2] uint8 int4 layout");
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  check_x(x, n, k, "int4_mm");
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
// codes are exact in bfloat16, and a row of them is contiguous, so here the product is
// turned around: out^T = W x^T, with a tile of W's rows (row-major bf16, a plain widening)
// as the micro-kernel's left matrix and x^T as its VNNI right one. x^T in VNNI is x's rows
// cut into 32-bit (k, k + 1) pairs and transposed, made once per call and block of tokens.
// The scale multiplies each fp32 sum before its one rounding to bfloat16.

// Rows [0, rows) of `codes` (row stride k) as bf16, row-major.
void int8_rows(const int8_t* codes, int64_t k, int64_t rows, uint16_t* tile) {
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* src = codes + r * k;
    uint16_t* dst = tile + r * k;
    int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    for (; i + 32 <= k; i += 32) {
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16))));
      _mm512_storeu_si512(dst + i, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
#endif
    for (; i < k; ++i) dst[i] = to_bf16_bits(static_cast<float>(src[i]));
  }
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "int8_mm: codes must be a contiguous [N, K] int8 tensor");
  const int64_t n = codes.size(0), k = codes.size(1), m = x.size(0);
  check_x(x, n, k, "int8_mm");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == n, "int8_mm: scales must be [N]");
  const at::Tensor scale_f = scales.to(at::kFloat).contiguous();
  const float* scale = scale_f.data_ptr<float>();
  std::vector<at::Tensor> xt;  // per block of kBlockM tokens: x^T as VNNI, [K / 2, block]
  for (int64_t m0 = 0; m0 < m; m0 += kBlockM)
    xt.push_back(x.narrow(0, m0, std::min(kBlockM, m - m0)).view(at::kInt).t().contiguous());
  at::Tensor out = at::empty({m, n}, x.options());
  uint16_t* os = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const int8_t* q = codes.data_ptr<int8_t>();
  const int64_t tn = tile_rows(k, n);
  at::parallel_for(0, (n + tn - 1) / tn, 1, [&](int64_t begin, int64_t end) {
    const BrgemmRelease release;
    uint16_t* tile = scratch<uint16_t>(static_cast<size_t>(k * tn));
    float* acc = scratch<float>(static_cast<size_t>(kBlockM * tn));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tn, rows = std::min(tn, n - n0);
      int8_rows(q + n0 * k, k, rows, tile);
      for (size_t b = 0; b < xt.size(); ++b) {
        const int64_t m0 = static_cast<int64_t>(b) * kBlockM, mb = xt[b].size(1);
        at::native::cpublas::brgemm(rows, mb, k, k, mb, mb, false,
                                    reinterpret_cast<const c10::BFloat16*>(tile),
                                    reinterpret_cast<const c10::BFloat16*>(xt[b].data_ptr<int32_t>()),
                                    acc, true);
        for (int64_t i = 0; i < mb; ++i)
          for (int64_t r = 0; r < rows; ++r)
            os[(m0 + i) * n + n0 + r] = to_bf16_bits(acc[r * mb + i] * scale[n0 + r]);
      }
    }
  });
  return out;
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
