// Paged decode attention for the CPU: one query token per sequence, reading K and V straight
// from the paged pool. The torch path (engine/attention.py decode_attention) first gathers
// every decode's blocks into a padded [g, kvH, ctx, hd] copy and then runs two bmm calls and
// a masked softmax over it; here each (sequence, kv head) is one task that walks its own
// block table, so nothing is copied, nothing is padded and the scores never leave the cache.
//
// Built at run time by engine/cpu_kernels.py (g++ -O3 -march=native) and registered as
// torch.ops.pagedserve_cpu.paged_decode, and as paged_decode_step: a decode-only step's
// whole layer (the new K/V written into the pool, then the attention) in one call. Each
// task's arithmetic is sequential in a fixed order, so a sequence's result does not depend
// on what else is in the batch. The pool holds the model's dtype (fp32, bf16) or int8 rows
// (the int8 KV cache: codes and a float16 scale per row, engine/attention/kv_int8.py), which
// are quantized as they are written and dequantized into float32 as they are read.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// A row of hd elements as floats: fp32 rows are read in place, bf16 rows are widened into
// `scratch` (bf16 is the high half of an fp32, so widening is a shift the compiler vectorises).
inline const float* as_float(const float* src, float*, int64_t) { return src; }

inline const float* as_float(const c10::BFloat16* src, float* scratch, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(scratch);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
  return scratch;
}

// A block's rows of one kv head are contiguous, but blocks sit anywhere in the pool, so the
// hardware prefetcher loses the stream at every block edge; the next block is asked for
// while this one is computed (measured: 64 decodes x 1024 context went from DRAM-latency
// bound to ~2x faster).
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 3);
}

struct Shape {
  int64_t kv_heads, block_size, head_dim, group;  // group: query heads per kv head
  int64_t block_stride, head_stride;              // elements between blocks / kv heads in a pool
  int64_t row;  // elements of one token's row in the pool: head_dim, or head_dim + 2 in int8
};

// The int8 KV cache (engine/attention/kv_int8.py): a pool row is head_dim int8 codes, then the
// row's float16 scale; x = code * scale.
constexpr int64_t kScaleBytes = 2;
constexpr float kCodeMax = 127.f;
constexpr float kScaleMax = 65504.f;

inline float row_scale(const int8_t* row, int64_t head_dim) {
  c10::Half scale;
  std::memcpy(&scale, row + head_dim, sizeof scale);
  return static_cast<float>(scale);
}

// n int8 rows (row elements apart) of a block, dequantized into n x hd floats.
inline const float* as_float_int8(const int8_t* src, float* scratch, int64_t n, int64_t hd,
                                  int64_t row) {
  for (int64_t t = 0; t < n; ++t) {
    const int8_t* r = src + t * row;
    const float scale = row_scale(r, hd);
#pragma omp simd
    for (int64_t d = 0; d < hd; ++d) scratch[t * hd + d] = static_cast<float>(r[d]) * scale;
  }
  return scratch;
}

// A block's n rows as n x hd floats, whatever the pool holds.
template <typename P>
inline const float* block_as_float(const P* src, float* scratch, int64_t n, int64_t hd,
                                   int64_t row) {
  if constexpr (std::is_same_v<P, int8_t>)
    return as_float_int8(src, scratch, n, hd, row);
  else
    return as_float(src, scratch, n * hd);
}

// One row of hd values into an int8 pool row, as kv_int8.quantize does (the same bytes: the
// scale is rounded to float16 first and the codes use it; x * (1 / scale), half to even).
template <typename T>
inline void quantize_row(const T* x, int8_t* dst, int64_t hd) {
  float amax = 0.f;
  for (int64_t d = 0; d < hd; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
  const float one_over_max = 1.f / kCodeMax;  // float32(1 / 127), as torch's scalar
  // At most float16's largest (kv_int8.SCALE_MAX): the codes then saturate, never an inf scale.
  const c10::Half scale(std::min(amax * one_over_max, kScaleMax));
  const float s = static_cast<float>(scale);
  const float inverse = s > 0.f ? 1.f / s : 0.f;
  for (int64_t d = 0; d < hd; ++d) {
    const float code = std::nearbyint(static_cast<float>(x[d]) * inverse);
    dst[d] = static_cast<int8_t>(std::clamp(code, -kCodeMax, kCodeMax));
  }
  std::memcpy(dst + hd, &scale, sizeof scale);
}

// How a layer shapes its scores before the softmax.
struct ScoreRule {
  int64_t window;  // each query sees only its last `window` positions (0: all): sliding window
  float softcap;   // scores become softcap * tanh(score / softcap) (0: unchanged): Gemma 2
  // gpt-oss's attention sinks: per query head, one more logit in the softmax's sum that
  // attends to nothing ([H] floats; nullptr: none).
  const float* sinks;
};

// scores[t] = q . k[t] for the n rows of one block (k: [n, hd] floats).
template <int64_t HD>
inline void dot_rows(const float* __restrict q, const float* __restrict k, float* __restrict scores,
                     int64_t n, int64_t head_dim) {
  const int64_t hd = HD ? HD : head_dim;
  for (int64_t t = 0; t < n; ++t) {
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < hd; ++d) dot += q[d] * k[t * hd + d];
    scores[t] = dot;
  }
}

// Calls block(G, h) for the query heads [h, h + G) of a group of g, G a compile-time
// constant as large as fits in registers beside a V row (4 at head dim 64, 2 at 128): a PV
// block keeps G heads' sums in registers across its rows.
template <int64_t HD, typename Block>
inline void by_head_groups(int64_t g, Block block) {
  constexpr int64_t most = HD <= 64 ? 4 : 2;
  for (int64_t h = 0; h < g; h += most) {
    switch (std::min(most, g - h)) {
      case 1: block(std::integral_constant<int, 1>{}, h); break;
      case 2: block(std::integral_constant<int, 2>{}, h); break;
      case 3: block(std::integral_constant<int, 3>{}, h); break;
      default: block(std::integral_constant<int, 4>{}, h);
    }
  }
}

#if defined(__AVX512F__)
// r[i] = the sum of v[i]'s 16 lanes, for 16 vectors: a tree of lane shuffles and adds (46
// instructions against ~130 for 16 separate horizontal sums). Each add only ever combines
// lanes of one input vector.
inline __m512 sum16(__m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // 128-bit quarters: v[2i]'s q0+q2, q1+q3, then v[2i+1]'s
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarter k: the 4 partial sums of v[4i + k]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // quarter k: 2 partials of v[8i + k], then of v[8i + 4 + k]
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  // lane 4k + m: the sum of v[4m + k]; the permute puts it at lane 4m + k
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88),
                                 _mm512_shuffle_ps(c[0], c[1], 0xDD));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, d);
}

#endif

#if defined(__AVX512BF16__)
// The QK of one bf16 block with the BF16 dot-product instruction (vdpbf16ps: each pair of bf16
// products summed exactly into fp32 lanes), K read as stored, never widened:
// scores[h * ctx + t] = scale * (q_h . k[t]) for its n rows and the g query heads (q_h at
// q + h * q_head_stride). HD: a multiple of 32.
constexpr bool kBf16Dot = true;

template <int64_t HD>
inline void qk_block_bf16(const c10::BFloat16* q, int64_t q_head_stride, int64_t g,
                          const c10::BFloat16* k, float* scores, int64_t ctx, int64_t n,
                          float scale) {
  constexpr int64_t W = HD / 32;
  for (int64_t t = 0; t < n; ++t) {
    __m512bh kr[W];
    for (int64_t j = 0; j < W; ++j) kr[j] = (__m512bh)_mm512_loadu_si512(k + t * HD + j * 32);
    for (int64_t h = 0; h < g; ++h) {
      const c10::BFloat16* qh = q + h * q_head_stride;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t j = 0; j < W; ++j)
        acc = _mm512_dpbf16_ps(acc, kr[j], (__m512bh)_mm512_loadu_si512(qh + j * 32));
      scores[h * ctx + t] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
}

// qk_block_bf16 for a block of 16 rows (the default block size): the 16 rows' dot products
// are summed across lanes together (sum16). Rows past n (a last block's unwritten slots) are
// computed too, from memory inside the block, and not stored.
template <int64_t HD>
inline void qk_block16_bf16(const c10::BFloat16* q, int64_t q_head_stride, int64_t g,
                            const c10::BFloat16* k, float* scores, int64_t ctx, int64_t n,
                            float scale) {
  constexpr int64_t W = HD / 32;
  const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
  for (int64_t h = 0; h < g; ++h) {
    __m512bh qv[W];
    for (int64_t j = 0; j < W; ++j)
      qv[j] = (__m512bh)_mm512_loadu_si512(q + h * q_head_stride + j * 32);
    __m512 dots[16];
    for (int64_t t = 0; t < 16; ++t) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t j = 0; j < W; ++j)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(k + t * HD + j * 32), qv[j]);
      dots[t] = acc;
    }
    const __m512 row = _mm512_mul_ps(sum16(dots), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(scores + h * ctx, keep, row);
  }
}

// The PV of one bf16 block for G query heads at once: each V row is widened to fp32 once (a
// shift) and added, weighted, into all G heads' sums, which stay in registers across the
// block's rows (G * HD / 16 zmm: G is at most 4 at head dim 64, 2 at 128). p: the first
// head's scores at this block (the next head's are ctx further on); acc: [G, HD].
template <int64_t HD, int G>
inline void pv_block_bf16(const float* p, int64_t ctx, const c10::BFloat16* v, int64_t n,
                          float* acc) {
  constexpr int64_t W = HD / 16;
  __m512 a[G][W];
  for (int h = 0; h < G; ++h)
    for (int64_t j = 0; j < W; ++j) a[h][j] = _mm512_loadu_ps(acc + h * HD + j * 16);
  for (int64_t t = 0; t < n; ++t) {
    __m512 row[W];
    for (int64_t j = 0; j < W; ++j) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + t * HD + j * 16));
      row[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    }
    for (int h = 0; h < G; ++h) {
      const __m512 w = _mm512_set1_ps(p[h * ctx + t]);
      for (int64_t j = 0; j < W; ++j) a[h][j] = _mm512_fmadd_ps(w, row[j], a[h][j]);
    }
  }
  for (int h = 0; h < G; ++h)
    for (int64_t j = 0; j < W; ++j) _mm512_storeu_ps(acc + h * HD + j * 16, a[h][j]);
}

#else
constexpr bool kBf16Dot = false;
#endif

#if defined(__AVX512F__)
// The int8 pool's blocks with AVX-512 (head dims of 16s): each row's codes widened to fp32
// once (sign-extend, convert) and used by every query head of the group.
constexpr bool kInt8Simd = true;

template <int64_t HD>
inline void widen_codes(const int8_t* r, __m512* out) {
  for (int64_t j = 0; j < HD / 16; ++j)
    out[j] = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + j * 16))));
}

// The QK of one int8 block of at most 16 rows for the g query heads: qf [g, HD] the scaled
// queries; scores[h * ctx + t] = (qf_h . codes[t]) * scale[t]. The block's codes are widened
// into `rows` once; each head then sums its 16 dot products across lanes together (sum16).
template <int64_t HD>
inline void qk_block_int8(const float* qf, int64_t g, const int8_t* k, int64_t row, float* rows,
                          float* scores, int64_t ctx, int64_t n) {
  constexpr int64_t W = HD / 16;
  alignas(64) float scale[16] = {};
  for (int64_t t = 0; t < n; ++t) {
    __m512 r[W];
    widen_codes<HD>(k + t * row, r);
    for (int64_t j = 0; j < W; ++j) _mm512_storeu_ps(rows + t * HD + j * 16, r[j]);
    scale[t] = row_scale(k + t * row, HD);
  }
  const __m512 scales = _mm512_load_ps(scale);
  const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
  for (int64_t h = 0; h < g; ++h) {
    __m512 qv[W];
    for (int64_t j = 0; j < W; ++j) qv[j] = _mm512_loadu_ps(qf + h * HD + j * 16);
    __m512 dots[16];
    for (int64_t t = 0; t < 16; ++t) {
      __m512 acc = _mm512_setzero_ps();
      if (t < n)
        for (int64_t j = 0; j < W; ++j)
          acc = _mm512_fmadd_ps(_mm512_loadu_ps(rows + t * HD + j * 16), qv[j], acc);
      dots[t] = acc;
    }
    _mm512_mask_storeu_ps(scores + h * ctx, keep, _mm512_mul_ps(sum16(dots), scales));
  }
}

// The PV of one int8 block for G query heads at once, as pv_block_bf16: each V row widened
// once, its scale folded into the heads' weights. p: the first head's probabilities at this
// block (the next head's ctx further on); acc: [G, HD].
template <int64_t HD, int G>
inline void pv_block_int8(const float* p, int64_t ctx, const int8_t* v, int64_t row, int64_t n,
                          float* acc) {
  constexpr int64_t W = HD / 16;
  __m512 a[G][W];
  for (int h = 0; h < G; ++h)
    for (int64_t j = 0; j < W; ++j) a[h][j] = _mm512_loadu_ps(acc + h * HD + j * 16);
  for (int64_t t = 0; t < n; ++t) {
    __m512 r[W];
    widen_codes<HD>(v + t * row, r);
    const float scale = row_scale(v + t * row, HD);
    for (int h = 0; h < G; ++h) {
      const __m512 w = _mm512_set1_ps(p[h * ctx + t] * scale);
      for (int64_t j = 0; j < W; ++j) a[h][j] = _mm512_fmadd_ps(w, r[j], a[h][j]);
    }
  }
  for (int h = 0; h < G; ++h)
    for (int64_t j = 0; j < W; ++j) _mm512_storeu_ps(acc + h * HD + j * 16, a[h][j]);
}

#else
constexpr bool kInt8Simd = false;
#endif

// acc += sum_t p[t] * v[t] over the n rows of one block (v: [n, hd] floats). With the head dim
// known the sum stays in registers across the rows instead of going through memory per row.
template <int64_t HD>
inline void axpy_rows(float* __restrict acc, const float* __restrict p, const float* __restrict v,
                      int64_t n, int64_t head_dim) {
  if constexpr (HD > 0) {
    float a[HD];
    for (int64_t d = 0; d < HD; ++d) a[d] = acc[d];
    for (int64_t t = 0; t < n; ++t)
#pragma omp simd
      for (int64_t d = 0; d < HD; ++d) a[d] += p[t] * v[t * HD + d];
    for (int64_t d = 0; d < HD; ++d) acc[d] = a[d];
  } else {
    for (int64_t t = 0; t < n; ++t)
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) acc[d] += p[t] * v[t * head_dim + d];
  }
}

// One (sequence, kv head): its `group` query heads attend over `ctx` tokens of its blocks.
// q points at the first of those heads, the next ones q_head_stride elements apart (a [1, H,
// T, hd] query of the fused step is read in place, whatever its layout); out points at their
// [group, head_dim] output rows; buf is the task's scratch.
// HD: the head dim as a compile-time constant (0: read it from s), so the row loops unroll.
// rule: the layer's sliding window, soft cap and sinks (ScoreRule). Whole blocks from the window's
// first one are scored (the kernels read blocks); the rows of that block before the window
// get weight 0 in the softmax.
// Block by block: the block's rows are widened to fp32 once, then each query head goes over
// them (its query, or its running sum, held in registers).
// P: what the pool holds, T (the model's dtype) or int8 (codes and a scale per row).
template <typename T, typename P, int64_t HD>
void attend_one(const T* q, int64_t q_head_stride, const P* k_pool, const P* v_pool,
                const int64_t* table, int64_t ctx, int64_t kv_head, const Shape& s, float scale,
                const ScoreRule& rule, T* out, std::vector<float>& buf) {
  const int64_t g = s.group, hd = HD ? HD : s.head_dim, bs = s.block_size;
  buf.resize(static_cast<size_t>(2 * g * hd + bs * hd + g * ctx + g));
  float* qf = buf.data();             // [g, hd] scaled queries
  float* acc = qf + g * hd;           // [g, hd] weighted sums of V
  float* rows = acc + g * hd;         // [bs, hd] one block's K or V rows, widened
  float* scores = rows + bs * hd;     // [g, ctx]
  float* inv_sum = scores + g * ctx;  // [g]

  constexpr bool bf16_dot = kBf16Dot && std::is_same_v<T, c10::BFloat16> &&
                            std::is_same_v<P, T> && HD > 0 && HD % 32 == 0;
  constexpr bool int8_simd = kInt8Simd && std::is_same_v<P, int8_t> && HD > 0 && HD % 16 == 0;
  if constexpr (!bf16_dot)
    for (int64_t h = 0; h < g; ++h) {
      const float* qrow = as_float(q + h * q_head_stride, qf + h * hd, hd);
      for (int64_t d = 0; d < hd; ++d) qf[h * hd + d] = qrow[d] * scale;
    }

  const int64_t num_blocks = (ctx + bs - 1) / bs, block_bytes = bs * s.row * sizeof(P);
  const int64_t head_offset = kv_head * s.head_stride;
  const int64_t window = rule.window;
  const int64_t lo = window > 0 && ctx > window ? ctx - window : 0;  // first position seen
  const int64_t b0 = lo / bs;                                         // its block
  auto block = [&](const P* pool, int64_t b) { return pool + table[b] * s.block_stride + head_offset; };
  prefetch(block(k_pool, b0), block_bytes);
  for (int64_t t0 = b0 * bs, b = b0; t0 < ctx; t0 += bs, ++b) {
    prefetch(b + 1 < num_blocks ? block(k_pool, b + 1) : block(v_pool, b0), block_bytes);
    const int64_t n = std::min(bs, ctx - t0);
#if defined(__AVX512BF16__)
    if constexpr (bf16_dot) {
      if (bs == 16)
        qk_block16_bf16<HD>(q, q_head_stride, g, block(k_pool, b), scores + t0, ctx, n, scale);
      else
        qk_block_bf16<HD>(q, q_head_stride, g, block(k_pool, b), scores + t0, ctx, n, scale);
      continue;
    }
#endif
#if defined(__AVX512F__)
    if constexpr (int8_simd) {  // 16 rows at a time (a block of another size too)
      const P* kb = block(k_pool, b);
      for (int64_t t = 0; t < n; t += 16)
        qk_block_int8<HD>(qf, g, kb + t * s.row, s.row, rows, scores + t0 + t, ctx,
                          std::min<int64_t>(16, n - t));
      continue;
    }
#endif
    const float* k = block_as_float<P>(block(k_pool, b), rows, n, hd, s.row);
    for (int64_t h = 0; h < g; ++h) dot_rows<HD>(qf + h * hd, k, scores + h * ctx + t0, n, hd);
  }

  for (int64_t h = 0; h < g; ++h) {  // softmax over the seen tokens only: no mask, no -inf
    float* sc = scores + h * ctx;
    if (rule.softcap > 0.f)
      for (int64_t t = lo; t < ctx; ++t) sc[t] = rule.softcap * std::tanh(sc[t] / rule.softcap);
    const float* sink = rule.sinks ? rule.sinks + kv_head * g + h : nullptr;
    float peak = sink ? std::max(sc[lo], *sink) : sc[lo];
    for (int64_t t = lo + 1; t < ctx; ++t) peak = std::max(peak, sc[t]);
    float sum = sink ? std::exp(*sink - peak) : 0.f;
    for (int64_t t = lo; t < ctx; ++t) {
      sc[t] = std::exp(sc[t] - peak);
      sum += sc[t];
    }
    std::fill(sc + b0 * bs, sc + lo, 0.f);  // the window's first block, before the window
    inv_sum[h] = 1.f / sum;
  }

  std::fill(acc, acc + g * hd, 0.f);
  for (int64_t t0 = b0 * bs, b = b0; t0 < ctx; t0 += bs, ++b) {
    if (b + 1 < num_blocks) prefetch(block(v_pool, b + 1), block_bytes);
    const int64_t n = std::min(bs, ctx - t0);
#if defined(__AVX512BF16__)
    if constexpr (bf16_dot) {
      by_head_groups<HD>(g, [&](auto G, int64_t h) {
        pv_block_bf16<HD, decltype(G)::value>(scores + t0 + h * ctx, ctx, block(v_pool, b), n,
                                              acc + h * HD);
      });
      continue;
    }
#endif
#if defined(__AVX512F__)
    if constexpr (int8_simd) {
      by_head_groups<HD>(g, [&](auto G, int64_t h) {
        pv_block_int8<HD, decltype(G)::value>(scores + t0 + h * ctx, ctx, block(v_pool, b),
                                              s.row, n, acc + h * HD);
      });
      continue;
    }
#endif
    const float* v = block_as_float<P>(block(v_pool, b), rows, n, hd, s.row);
    for (int64_t h = 0; h < g; ++h) axpy_rows<HD>(acc + h * hd, scores + h * ctx + t0, v, n, hd);
  }
  for (int64_t h = 0; h < g; ++h)
    for (int64_t d = 0; d < hd; ++d) out[h * hd + d] = static_cast<T>(acc[h * hd + d] * inv_sum[h]);
}

// Where run() reads the queries and writes the output: query head h of sequence i is at
// q + i * q_seq_stride + h * q_head_stride (its head_dim elements contiguous); the output is
// [D, H, hd] contiguous from out.
template <typename T>
struct Io {
  const T* q;
  int64_t q_seq_stride, q_head_stride;
  T* out;
};

template <typename T, typename P, int64_t HD>
void run(const Io<T>& io, int64_t num_seqs, int64_t heads, const P* kp, const P* vp,
         const Shape& s, const at::Tensor& tables, const at::Tensor& lens, float scale,
         const ScoreRule& rule) {
  const int64_t width = tables.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t i = 0; i < num_seqs; ++i) total += rule.window > 0 ? std::min(lp[i], rule.window) : lp[i];
  // Small steps run inline: an OpenMP region costs more than a few thousand token rows.
  const int64_t tasks = num_seqs * s.kv_heads;
  const int64_t grain = std::max<int64_t>(1, tasks * 4096 / std::max<int64_t>(1, total * s.kv_heads));
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / s.kv_heads, kv_head = task % s.kv_heads;
      const T* q = io.q + seq * io.q_seq_stride + kv_head * s.group * io.q_head_stride;
      T* out = io.out + (seq * heads + kv_head * s.group) * s.head_dim;
      attend_one<T, P, HD>(q, io.q_head_stride, kp, vp, tp + seq * width, lp[seq], kv_head, s,
                        scale, rule, out, buf);
    }
  });
}

// Checks what the tables make the kernel read (D x W integers): a bad table would read
// outside the pool.
void check_tables(const at::Tensor& block_tables, const at::Tensor& context_lens,
                  int64_t num_seqs, int64_t block_size, int64_t num_blocks) {
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous(),
              "paged_decode: contiguous block tables and lengths");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode: int64 block tables and lengths");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs &&
                  context_lens.dim() == 1 && context_lens.size(0) == num_seqs,
              "paged_decode: one table row and one length per sequence");
  const int64_t width = block_tables.size(1), bs = block_size;
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  const int64_t* lp = context_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_seqs; ++i) {
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= width * bs, "paged_decode: context length out of range");
    for (int64_t b = 0; b < (lp[i] + bs - 1) / bs; ++b)
      TORCH_CHECK(tp[i * width + b] >= 0 && tp[i * width + b] < num_blocks,
                  "paged_decode: block index out of range");
  }
}

// The ScoreRule of the ops' arguments; sinks, if given, are [H] float32.
ScoreRule score_rule(int64_t window, double softcap, const std::optional<at::Tensor>& sinks,
                     int64_t heads) {
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_decode: window, softcap >= 0");
  if (sinks.has_value())
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                    sinks->dim() == 1 && sinks->size(0) == heads,
                "paged_decode: sinks are [heads] contiguous float32");
  return ScoreRule{window, static_cast<float>(softcap),
                   sinks.has_value() ? sinks->data_ptr<float>() : nullptr};
}

// run() with the head dim's template picked: the common head dims get unrolled loops.
template <typename T, typename P>
void dispatch(const Io<T>& io, int64_t num_seqs, int64_t heads, const P* kp, const P* vp,
              const Shape& s, const at::Tensor& tables, const at::Tensor& lens, float scale,
              const ScoreRule& rule) {
  switch (s.head_dim) {
    case 64: run<T, P, 64>(io, num_seqs, heads, kp, vp, s, tables, lens, scale, rule); break;
    case 128: run<T, P, 128>(io, num_seqs, heads, kp, vp, s, tables, lens, scale, rule); break;
    default: run<T, P, 0>(io, num_seqs, heads, kp, vp, s, tables, lens, scale, rule);
  }
}

// The pool's row width for q's head dim: head_dim, or head_dim + 2 in an int8 pool.
int64_t pool_row(const at::Tensor& pool, int64_t head_dim) {
  return pool.scalar_type() == at::kChar ? head_dim + kScaleBytes : head_dim;
}

// dispatch() with the pool's element type picked: q's dtype, or int8.
template <typename T>
void dispatch_pool(const Io<T>& io, int64_t num_seqs, int64_t heads, const at::Tensor& k_pool,
                   const void* kp, const void* vp, const Shape& s, const at::Tensor& tables,
                   const at::Tensor& lens, float scale, const ScoreRule& rule) {
  if (k_pool.scalar_type() == at::kChar)
    dispatch<T, int8_t>(io, num_seqs, heads, static_cast<const int8_t*>(kp),
                        static_cast<const int8_t*>(vp), s, tables, lens, scale, rule);
  else
    dispatch<T, T>(io, num_seqs, heads, static_cast<const T*>(kp), static_cast<const T*>(vp), s,
                   tables, lens, scale, rule);
}

// q [D, H, hd]; k_pool, v_pool [blocks, kvH, block_size, hd] in q's dtype, or int8 [blocks,
// kvH, block_size, hd + 2] (the int8 KV cache); block_tables [D, W] int64
// (padded rows are never read past a sequence's length); context_lens [D] int64, each in
// [1, W * block_size]; window, softcap and sinks: the layer's ScoreRule.
// Returns [D, H, hd] in q's dtype.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                        double scale, int64_t window, double softcap,
                        const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(),
              "paged_decode: q [D, H, hd] and two pools [blocks, kvH, block_size, hd]");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(),
              "paged_decode: contiguous inputs");
  TORCH_CHECK((q.scalar_type() == k_pool.scalar_type() || k_pool.scalar_type() == at::kChar) &&
                  k_pool.scalar_type() == v_pool.scalar_type(),
              "paged_decode: pools in q's dtype or int8");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_decode: float32 or bfloat16 only");
  const int64_t num_seqs = q.size(0), heads = q.size(1), kv_heads = k_pool.size(1);
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(k_pool.size(3) == pool_row(k_pool, head_dim) && heads % kv_heads == 0,
              "paged_decode: head_dim and GQA grouping");
  check_tables(block_tables, context_lens, num_seqs, k_pool.size(2), k_pool.size(0));
  const ScoreRule rule = score_rule(window, softcap, sinks, heads);
  const Shape s{kv_heads, k_pool.size(2), head_dim, heads / kv_heads, k_pool.stride(0),
                k_pool.stride(1), k_pool.size(3)};
  at::Tensor out = at::empty_like(q);
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    const Io<float> io{q.data_ptr<float>(), heads * head_dim, head_dim, out.data_ptr<float>()};
    dispatch_pool<float>(io, num_seqs, heads, k_pool, k_pool.data_ptr(), v_pool.data_ptr(), s,
                         block_tables, context_lens, sc, rule);
  } else {
    using B = c10::BFloat16;
    const Io<B> io{q.data_ptr<B>(), heads * head_dim, head_dim, out.data_ptr<B>()};
    dispatch_pool<B>(io, num_seqs, heads, k_pool, k_pool.data_ptr(), v_pool.data_ptr(), s,
                     block_tables, context_lens, sc, rule);
  }
  return out;
}

// The fused step's K/V writes: row i of key/value (each kv head) into slot i of the pool
// (copied, or quantized into an int8 pool).
template <typename T, typename P>
void write_new_kv(const at::Tensor& key, const at::Tensor& value, P* kp, P* vp, const Shape& s,
                  const int64_t* blocks, const int64_t* offsets, int64_t num_tokens) {
  const T* kn = key.data_ptr<T>();
  const T* vn = value.data_ptr<T>();
  const size_t row = static_cast<size_t>(s.head_dim) * sizeof(T);
  for (int64_t i = 0; i < num_tokens; ++i)
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      const int64_t slot = blocks[i] * s.block_stride + h * s.head_stride + offsets[i] * s.row;
      const T* k = kn + h * key.stride(1) + i * key.stride(2);
      const T* v = vn + h * value.stride(1) + i * value.stride(2);
      if constexpr (std::is_same_v<P, int8_t>) {
        quantize_row(k, kp + slot, s.head_dim);
        quantize_row(v, vp + slot, s.head_dim);
      } else {
        std::memcpy(kp + slot, k, row);
        std::memcpy(vp + slot, v, row);
      }
    }
}

template <typename T, typename P>
void decode_step(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                 const at::Tensor& kv_cache, int64_t layer, const at::Tensor& write_blocks,
                 const at::Tensor& write_offsets, const std::optional<at::Tensor>& tables,
                 const std::optional<at::Tensor>& lens, float scale, const ScoreRule& rule,
                 at::Tensor& out) {
  const int64_t heads = query.size(1), kv_heads = kv_cache.size(3);
  const Shape s{kv_heads, kv_cache.size(4), query.size(3), heads / kv_heads,
                kv_cache.stride(2), kv_cache.stride(3), kv_cache.size(5)};
  P* kp = static_cast<P*>(kv_cache.data_ptr()) + layer * kv_cache.stride(0);
  P* vp = kp + kv_cache.stride(1);
  write_new_kv<T, P>(key, value, kp, vp, s, write_blocks.data_ptr<int64_t>(),
                     write_offsets.data_ptr<int64_t>(), write_blocks.size(0));
  if (!tables.has_value()) return;
  const Io<T> io{query.data_ptr<T>(), query.stride(2), query.stride(1), out.data_ptr<T>()};
  dispatch<T, P>(io, tables->size(0), heads, kp, vp, s, *tables, *lens, scale, rule);
}

// One layer of a step through the pool, fused: the W new tokens' K/V go into their pool
// slots, then the first D of them (the decodes, one query per sequence) attend over their
// contexts. One call instead of the Python path's ~15 tensor ops per layer (the index_put
// writes, the output's allocation, the query's copy): at one stream that was most of the
// attention's cost. Reads the query and writes K/V in their [1, heads, T, hd] layouts,
// whatever their strides; returns [1, T, H, hd] with rows from D on zero: the caller writes
// the prefill rows [D, W) there (SDPA), rows past W are a compiled bucket's padding.
// kv_cache [layers, 2, blocks, kvH, block_size, hd] contiguous, in the query's dtype or int8
// (rows of hd + 2: the int8 KV cache); write_blocks/offsets [W];
// block_tables [D, width] and context_lens [D], both absent when the step has no decodes;
// window, softcap and sinks: the layer's ScoreRule.
at::Tensor paged_decode_step(const at::Tensor& query_in, const at::Tensor& key_in,
                             const at::Tensor& value_in, at::Tensor& kv_cache, int64_t layer,
                             const at::Tensor& write_blocks, const at::Tensor& write_offsets,
                             const std::optional<at::Tensor>& block_tables,
                             const std::optional<at::Tensor>& context_lens, double scale,
                             int64_t window, double softcap,
                             const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query_in.dim() == 4 && key_in.dim() == 4 && value_in.dim() == 4 &&
                  query_in.size(0) == 1 && key_in.sizes() == value_in.sizes(),
              "paged_decode_step: query [1, H, T, hd], key and value [1, kvH, T, hd]");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == 2 && kv_cache.is_contiguous(),
              "paged_decode_step: a contiguous pool [layers, 2, blocks, kvH, block_size, hd]");
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(0), "paged_decode_step: layer out of range");
  const auto dtype = query_in.scalar_type();
  const bool int8_pool = kv_cache.scalar_type() == at::kChar;
  TORCH_CHECK(dtype == key_in.scalar_type() && dtype == value_in.scalar_type() &&
                  (dtype == kv_cache.scalar_type() || int8_pool),
              "paged_decode_step: query, key and value share a dtype; the pool has it or int8");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "paged_decode_step: float32 or bfloat16 only");
  // Rows are copied and read as head_dim contiguous elements; any other layout is copied once.
  const at::Tensor query = query_in.stride(3) == 1 ? query_in : query_in.contiguous();
  const at::Tensor key = key_in.stride(3) == 1 ? key_in : key_in.contiguous();
  const at::Tensor value = value_in.stride(3) == 1 ? value_in : value_in.contiguous();
  const int64_t heads = query.size(1), tokens = query.size(2), head_dim = query.size(3);
  const int64_t kv_heads = kv_cache.size(3), block_size = kv_cache.size(4);
  TORCH_CHECK(key.size(1) == kv_heads && key.size(2) == tokens && key.size(3) == head_dim &&
                  kv_cache.size(5) == pool_row(kv_cache, head_dim) && heads % kv_heads == 0,
              "paged_decode_step: heads, head_dim and GQA grouping");
  TORCH_CHECK(write_blocks.is_contiguous() && write_offsets.is_contiguous() &&
                  write_blocks.scalar_type() == at::kLong &&
                  write_offsets.scalar_type() == at::kLong && write_blocks.dim() == 1 &&
                  write_offsets.sizes() == write_blocks.sizes(),
              "paged_decode_step: int64 write blocks and offsets, one per new token");
  const int64_t num_writes = write_blocks.size(0);
  TORCH_CHECK(num_writes >= 1 && num_writes <= tokens, "paged_decode_step: 1..T new tokens");
  TORCH_CHECK(block_tables.has_value() == context_lens.has_value(),
              "paged_decode_step: block tables and context lengths come together");
  const int64_t num_seqs = block_tables.has_value() ? block_tables->size(0) : 0;
  TORCH_CHECK(num_seqs <= num_writes, "paged_decode_step: more decodes than new tokens");
  const int64_t* wb = write_blocks.data_ptr<int64_t>();
  const int64_t* wo = write_offsets.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_writes; ++i)
    TORCH_CHECK(wb[i] >= 0 && wb[i] < kv_cache.size(2) && wo[i] >= 0 && wo[i] < block_size,
                "paged_decode_step: write slot out of range");
  if (block_tables.has_value())
    check_tables(*block_tables, *context_lens, num_seqs, block_size, kv_cache.size(2));
  const ScoreRule rule = score_rule(window, softcap, sinks, heads);
  at::Tensor out = at::empty({1, tokens, heads, head_dim}, query.options());
  if (tokens > num_seqs) out.narrow(1, num_seqs, tokens - num_seqs).zero_();
  const float sc = static_cast<float>(scale);
  using B = c10::BFloat16;
  if (dtype == at::kFloat && int8_pool)
    decode_step<float, int8_t>(query, key, value, kv_cache, layer, write_blocks, write_offsets,
                               block_tables, context_lens, sc, rule, out);
  else if (dtype == at::kFloat)
    decode_step<float, float>(query, key, value, kv_cache, layer, write_blocks, write_offsets,
                              block_tables, context_lens, sc, rule, out);
  else if (int8_pool)
    decode_step<B, int8_t>(query, key, value, kv_cache, layer, write_blocks, write_offsets,
                           block_tables, context_lens, sc, rule, out);
  else
    decode_step<B, B>(query, key, value, kv_cache, layer, write_blocks, write_offsets,
                      block_tables, context_lens, sc, rule, out);
  return out;
}

}  // namespace

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, "
        "Tensor context_lens, float scale, int window=0, float softcap=0, Tensor? sinks=None) "
        "-> Tensor");
  m.def("paged_decode_step(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, "
        "int layer, Tensor write_blocks, Tensor write_offsets, Tensor? block_tables, "
        "Tensor? context_lens, float scale, int window=0, float softcap=0, Tensor? sinks=None) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_decode_step", &paged_decode_step);
}
