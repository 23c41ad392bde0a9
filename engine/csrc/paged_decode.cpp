// Paged decode attention for the CPU: one query token per sequence, reading K and V straight
// from the paged pool. The torch path (engine/attention.py decode_attention) first gathers
// every decode's blocks into a padded [g, kvH, ctx, hd] copy and then runs two bmm calls and
// a masked softmax over it; here each (sequence, kv head) is one task that walks its own
// block table, so nothing is copied, nothing is padded and the scores never leave the cache.
//
// Built at run time by engine/cpu_kernels.py (g++ -O3 -march=native) and registered as
// torch.ops.pagedserve_cpu.paged_decode. Each task's arithmetic is sequential in a fixed
// order, so a sequence's result does not depend on what else is in the batch.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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
// q and out point at those heads' [group, head_dim] rows; buf is the task's scratch.
// HD: the head dim as a compile-time constant (0: read it from s), so the row loops unroll.
// Block by block: the block's rows are widened to fp32 once, then each query head goes over
// them (its query, or its running sum, held in registers).
template <typename T, int64_t HD>
void attend_one(const T* q, const T* k_pool, const T* v_pool, const int64_t* table,
                int64_t ctx, int64_t kv_head, const Shape& s, float scale, T* out,
                std::vector<float>& buf) {
  const int64_t g = s.group, hd = HD ? HD : s.head_dim, bs = s.block_size;
  buf.resize(static_cast<size_t>(2 * g * hd + bs * hd + g * ctx + g));
  float* qf = buf.data();             // [g, hd] scaled queries
  float* acc = qf + g * hd;           // [g, hd] weighted sums of V
  float* rows = acc + g * hd;         // [bs, hd] one block's K or V rows, widened
  float* scores = rows + bs * hd;     // [g, ctx]
  float* inv_sum = scores + g * ctx;  // [g]

  const float* qrow = as_float(q, qf, g * hd);
  for (int64_t i = 0; i < g * hd; ++i) qf[i] = qrow[i] * scale;

  const int64_t num_blocks = (ctx + bs - 1) / bs, block_bytes = bs * hd * sizeof(T);
  const int64_t head_offset = kv_head * s.head_stride;
  auto block = [&](const T* pool, int64_t b) { return pool + table[b] * s.block_stride + head_offset; };
  prefetch(block(k_pool, 0), block_bytes);
  for (int64_t t0 = 0, b = 0; t0 < ctx; t0 += bs, ++b) {
    prefetch(b + 1 < num_blocks ? block(k_pool, b + 1) : block(v_pool, 0), block_bytes);
    const int64_t n = std::min(bs, ctx - t0);
    const float* k = as_float(block(k_pool, b), rows, n * hd);
    for (int64_t h = 0; h < g; ++h) dot_rows<HD>(qf + h * hd, k, scores + h * ctx + t0, n, hd);
  }

  for (int64_t h = 0; h < g; ++h) {  // softmax over the real tokens only: no mask, no -inf
    float* sc = scores + h * ctx;
    float peak = sc[0];
    for (int64_t t = 1; t < ctx; ++t) peak = std::max(peak, sc[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < ctx; ++t) {
      sc[t] = std::exp(sc[t] - peak);
      sum += sc[t];
    }
    inv_sum[h] = 1.f / sum;
  }

  std::fill(acc, acc + g * hd, 0.f);
  for (int64_t t0 = 0, b = 0; t0 < ctx; t0 += bs, ++b) {
    if (b + 1 < num_blocks) prefetch(block(v_pool, b + 1), block_bytes);
    const int64_t n = std::min(bs, ctx - t0);
    const float* v = as_float(block(v_pool, b), rows, n * hd);
    for (int64_t h = 0; h < g; ++h) axpy_rows<HD>(acc + h * hd, scores + h * ctx + t0, v, n, hd);
  }
  for (int64_t h = 0; h < g; ++h)
    for (int64_t d = 0; d < hd; ++d) out[h * hd + d] = static_cast<T>(acc[h * hd + d] * inv_sum[h]);
}

template <typename T, int64_t HD>
void run(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
         const at::Tensor& tables, const at::Tensor& lens, float scale, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), heads = q.size(1);
  const Shape s{k_pool.size(1), k_pool.size(2), k_pool.size(3), heads / k_pool.size(1),
                k_pool.stride(0), k_pool.stride(1)};
  const int64_t width = tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  int64_t total = 0;
  for (int64_t i = 0; i < num_seqs; ++i) total += lp[i];
  // Small steps run inline: an OpenMP region costs more than a few thousand token rows.
  const int64_t tasks = num_seqs * s.kv_heads;
  const int64_t grain = std::max<int64_t>(1, tasks * 4096 / std::max<int64_t>(1, total * s.kv_heads));
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / s.kv_heads, kv_head = task % s.kv_heads;
      const int64_t first = (seq * heads + kv_head * s.group) * s.head_dim;
      attend_one<T, HD>(qp + first, kp, vp, tp + seq * width, lp[seq], kv_head, s, scale,
                    op + first, buf);
    }
  });
}

// q [D, H, hd]; k_pool, v_pool [blocks, kvH, block_size, hd]; block_tables [D, W] int64
// (padded rows are never read past a sequence's length); context_lens [D] int64, each in
// [1, W * block_size]. Returns [D, H, hd] in q's dtype.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                        double scale) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(),
              "paged_decode: q [D, H, hd] and two pools [blocks, kvH, block_size, hd]");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  block_tables.is_contiguous() && context_lens.is_contiguous(),
              "paged_decode: contiguous inputs");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(),
              "paged_decode: q and the pools share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode: int64 block tables and lengths");
  const int64_t num_seqs = q.size(0), kv_heads = k_pool.size(1);
  TORCH_CHECK(q.size(2) == k_pool.size(3) && q.size(1) % kv_heads == 0,
              "paged_decode: head_dim and GQA grouping");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs &&
                  context_lens.dim() == 1 && context_lens.size(0) == num_seqs,
              "paged_decode: one table row and one length per sequence");
  // A bad table would read outside the pool: check what will be read (D x W integers).
  const int64_t width = block_tables.size(1), bs = k_pool.size(2), blocks = k_pool.size(0);
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  const int64_t* lp = context_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_seqs; ++i) {
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= width * bs, "paged_decode: context length out of range");
    for (int64_t b = 0; b < (lp[i] + bs - 1) / bs; ++b)
      TORCH_CHECK(tp[i * width + b] >= 0 && tp[i * width + b] < blocks,
                  "paged_decode: block index out of range");
  }
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_decode: float32 or bfloat16 only");
  at::Tensor out = at::empty_like(q);
  const float sc = static_cast<float>(scale);
  const bool fp32 = q.scalar_type() == at::kFloat;
  switch (q.size(2)) {  // the common head dims get unrolled loops
    case 64:
      fp32 ? run<float, 64>(q, k_pool, v_pool, block_tables, context_lens, sc, out)
           : run<c10::BFloat16, 64>(q, k_pool, v_pool, block_tables, context_lens, sc, out);
      break;
    case 128:
      fp32 ? run<float, 128>(q, k_pool, v_pool, block_tables, context_lens, sc, out)
           : run<c10::BFloat16, 128>(q, k_pool, v_pool, block_tables, context_lens, sc, out);
      break;
    default:
      fp32 ? run<float, 0>(q, k_pool, v_pool, block_tables, context_lens, sc, out)
           : run<c10::BFloat16, 0>(q, k_pool, v_pool, block_tables, context_lens, sc, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
