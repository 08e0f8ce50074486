// Paged decode attention for XLA's CPU backend, as an XLA FFI custom call.
//
// One new query token per sequence against the keys and values of its pages, read in
// place: from the layer's slice of the stacked pool, through the row's page table. XLA's
// own CPU form (decode_xla.py) copies every row's pages into one contiguous block per
// layer and runs 128 tiny batched dots on them; this reads each cached key and value once.
// Same result as `decode_attention_reference`, to float rounding: logits in float32,
// scaled, soft-capped, masked to the row's length (and sliding window), a softmax that
// attention sinks join as zero-valued keys (computed online), and the probabilities' sum
// of the values.
//
// Buffers (the Python side, decode_cpu.py, checks shapes and dtypes):
//   q       [B, Hq, D]                       float32 or bfloat16 (as the pages)
//   k, v    [layers, Hkv, pages, S, D | Dv]  v may be k itself (a latent cache: values
//                                            are the first `value_dim` entries of a key)
//   layer   int32 [1]; lengths int32 [B]; table int32 [B, n]; sinks float32 [Hq]
//   out     [B, Hq, value_dim]
// Work is split over (row, kv head) pairs on XLA's intra-op thread pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void store(float x, float* out) { *out = x; }
inline void store(float x, uint16_t* out) {  // round to nearest even, NaN kept a NaN
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if (std::isnan(x)) {
    *out = static_cast<uint16_t>((bits >> 16) | 0x40);
    return;
  }
  bits += 0x7fff + ((bits >> 16) & 1);
  *out = static_cast<uint16_t>(bits >> 16);
}

// Sixteen partial sums: the compiler vectorises them (one AVX-512 register, two AVX2).
template <typename T>
inline float dot(const float* q, const T* k, int n) {
  float acc[16] = {0.f};
  int d = 0;
  for (; d + 16 <= n; d += 16)
    for (int j = 0; j < 16; ++j) acc[j] += q[d + j] * to_float(k[d + j]);
  float sum = 0.f;
  for (; d < n; ++d) sum += q[d] * to_float(k[d]);
  for (int j = 0; j < 16; ++j) sum += acc[j];
  return sum;
}

template <typename T>
struct Job {
  const T *q, *k, *v;
  const int32_t *lengths, *table;
  const float* sinks;
  T* out;
  int64_t batch, q_heads, kv_heads, num_pages, page_size, head_dim, v_row, value_dim, pages_per_row;
  int64_t window;  // 0: none
  float scale, soft_cap;  // soft_cap 0: none
  bool has_sinks;
  int64_t total, chunk;
  std::atomic<int64_t> next{0}, done{0};
};

// One (row, kv head) pair: its group of query heads over the row's visible keys.
template <typename T>
void attend(const Job<T>& j, int64_t item, std::vector<float>& scratch) {
  const int64_t row = item / j.kv_heads, head = item % j.kv_heads;
  const int64_t group = j.q_heads / j.kv_heads;
  const int64_t length = std::min<int64_t>(std::max<int32_t>(j.lengths[row], 0), j.pages_per_row * j.page_size);
  const int64_t first = j.window > 0 ? std::max<int64_t>(0, length - j.window) : 0;
  const int64_t keys = length - first;
  const int64_t q_offset = (row * j.q_heads + head * group);
  T* out = j.out + q_offset * j.value_dim;
  std::fill(out, out + group * j.value_dim, T{});
  if (keys <= 0) return;

  const int64_t k_page = j.page_size * j.head_dim, v_page = j.page_size * j.v_row;
  const T* k_head = j.k + head * j.num_pages * k_page;
  const T* v_head = j.v + head * j.num_pages * v_page;
  const int32_t* pages = j.table + row * j.pages_per_row;
  auto page_of = [&](int64_t t) {  // out-of-range entries read page 0 rather than stray memory
    const int64_t p = pages[t / j.page_size];
    return (p >= 0 && p < j.num_pages) ? p : 0;
  };

  scratch.resize(group * (j.head_dim + j.value_dim + 2));
  float* queries = scratch.data();                 // [group, D] as float
  float* acc = queries + group * j.head_dim;       // [group, value_dim]
  float* top = acc + group * j.value_dim;          // [group]: each query's largest logit so far
  float* total = top + group;                      // [group]: its softmax denominator so far
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < j.head_dim; ++d) queries[g * j.head_dim + d] = to_float(j.q[(q_offset + g) * j.head_dim + d]);

  // One pass: each key row and its value row read together (two streams at once: 15% faster
  // from memory than a pass over the keys and then one over the values), with an online
  // softmax: the sum and the values rescaled when a query's largest logit grows.
  for (int64_t g = 0; g < group; ++g) {
    top[g] = j.has_sinks ? j.sinks[head * group + g] : -INFINITY;
    total[g] = j.has_sinks ? 1.f : 0.f;
  }
  std::fill(acc, acc + group * j.value_dim, 0.f);
  for (int64_t i = 0; i < keys; ++i) {
    const int64_t t = first + i;
    const int64_t page = page_of(t);
    const T* key = k_head + page * k_page + (t % j.page_size) * j.head_dim;
    const T* value = v_head + page * v_page + (t % j.page_size) * j.v_row;
    for (int64_t g = 0; g < group; ++g) {
      float logit = dot(queries + g * j.head_dim, key, static_cast<int>(j.head_dim)) * j.scale;
      if (j.soft_cap > 0.f) logit = j.soft_cap * std::tanh(logit / j.soft_cap);
      float* a = acc + g * j.value_dim;
      if (logit > top[g]) {
        const float shrink = std::exp(top[g] - logit);
        total[g] *= shrink;
        for (int64_t d = 0; d < j.value_dim; ++d) a[d] *= shrink;
        top[g] = logit;
      }
      const float p = std::exp(logit - top[g]);
      total[g] += p;
      for (int64_t d = 0; d < j.value_dim; ++d) a[d] += p * to_float(value[d]);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inverse = 1.f / total[g];
    for (int64_t d = 0; d < j.value_dim; ++d) acc[g * j.value_dim + d] *= inverse;
  }
  for (int64_t e = 0; e < group * j.value_dim; ++e) store(acc[e], out + e);
}

// Take chunks of pairs until none are left. The caller runs this too, so the call finishes
// even when no pool thread ever picks up a scheduled copy.
template <typename T>
void drain(Job<T>& j) {
  std::vector<float> scratch;
  int64_t c;
  while ((c = j.next.fetch_add(1)) * j.chunk < j.total) {
    const int64_t end = std::min(j.total, (c + 1) * j.chunk);
    for (int64_t item = c * j.chunk; item < end; ++item) attend(j, item, scratch);
    j.done.fetch_add(end - c * j.chunk, std::memory_order_release);
  }
}

template <typename T>
ffi::Error run(ffi::ThreadPool& pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, int32_t layer,
               const int32_t* lengths, ffi::AnyBuffer table, const float* sinks, ffi::Result<ffi::AnyBuffer> out,
               float scale, int64_t window, float soft_cap, int64_t value_dim, bool has_sinks) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  auto job = std::make_shared<Job<T>>();  // shared: a late pool task may still look at it
  Job<T>& j = *job;
  j.batch = qd[0], j.q_heads = qd[1], j.head_dim = qd[2];
  j.kv_heads = kd[1], j.num_pages = kd[2], j.page_size = kd[3], j.v_row = vd[4];
  j.value_dim = value_dim, j.pages_per_row = table.dimensions()[1];
  j.window = window, j.scale = scale, j.soft_cap = soft_cap, j.has_sinks = has_sinks;
  if (layer < 0 || layer >= kd[0]) return ffi::Error::InvalidArgument("layer index out of range");
  j.q = static_cast<const T*>(q.untyped_data());
  j.k = static_cast<const T*>(k.untyped_data()) + layer * (j.kv_heads * j.num_pages * j.page_size * j.head_dim);
  j.v = static_cast<const T*>(v.untyped_data()) + layer * (j.kv_heads * j.num_pages * j.page_size * j.v_row);
  j.lengths = lengths, j.table = static_cast<const int32_t*>(table.untyped_data()), j.sinks = sinks;
  j.out = static_cast<T*>(out->untyped_data());
  j.total = j.batch * j.kv_heads;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  j.chunk = std::max<int64_t>(1, j.total / (4 * threads));  // small chunks: rows have ragged lengths
  for (int64_t t = 1; t < threads && t * j.chunk < j.total; ++t) pool.Schedule([job] { drain(*job); });
  drain(j);
  while (j.done.load(std::memory_order_acquire) < j.total) std::this_thread::yield();
  return ffi::Error::Success();
}

ffi::Error paged_decode(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer table,
                        ffi::Buffer<ffi::F32> sinks, ffi::Result<ffi::AnyBuffer> out, float scale,
                        int64_t sliding_window, float soft_cap, int64_t value_dim, bool has_sinks) {
  const int32_t index = layer.typed_data()[0];
  const int32_t* lens = lengths.typed_data();
  switch (q.element_type()) {
    case ffi::F32:
      return run<float>(pool, q, k, v, index, lens, table, sinks.typed_data(), out, scale, sliding_window,
                        soft_cap, value_dim, has_sinks);
    case ffi::BF16:
      return run<uint16_t>(pool, q, k, v, index, lens, table, sinks.typed_data(), out, scale, sliding_window,
                           soft_cap, value_dim, has_sinks);
    default:
      return ffi::Error::InvalidArgument("paged decode attention takes float32 or bfloat16");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxparPagedDecodeAttention, paged_decode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // q
                                  .Arg<ffi::AnyBuffer>()          // k pages, stacked
                                  .Arg<ffi::AnyBuffer>()          // v pages, stacked
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // lengths [B]
                                  .Arg<ffi::AnyBuffer>()          // page table [B, n]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sinks [Hq]
                                  .Ret<ffi::AnyBuffer>()          // out [B, Hq, value_dim]
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("value_dim")
                                  .Attr<bool>("has_sinks"));
