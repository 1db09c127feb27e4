// The KV-cache call's work around the forward kernel (kvcache.h): one launch before it (the append, the
// decode form's query rows, the packed sequences' metadata) and one after it (the decode form's combine
// of its split-KV chunks). Both move a few rows per block; neither is near a bandwidth or compute limit at
// the sizes of a decode step, so they are written for one launch each rather than for throughput.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/attention/attention.h"
#include "kernels/attention/kvcache.h"
#include "tk/common.cuh"
#include "tk/dispatch.h"
#include "tk/pipeline/block.cuh"

namespace tk::attention {
namespace {

constexpr int PREPARE_THREADS = 256;
constexpr int COMBINE_THREADS = 128;

// Split-KV: about two tasks per SM, chunks of at least 256 keys.
constexpr int64_t DECODE_TASKS_PER_SM = 2;
constexpr int64_t DECODE_MIN_CHUNK = 256;

// Both element types are 2 bytes: the copies move them as raw 16-bit words, whatever the type.
using word = uint16_t;
static_assert(element_bytes(element_type::bf16) == sizeof(word) && element_bytes(element_type::fp16) == sizeof(word));

__host__ __device__ int64_t sequences_of(const kvcache_call& c) { return c.decode ? c.batch * c.splits : c.batch; }
__host__ __device__ int64_t group_of(const kvcache_call& c) { return c.q_heads / c.kv_heads; }

// heads x dim elements of one row: to[h * to_head_stride + d] = from[h * from_head_stride + d].
__device__ void copy_heads(word* to, int64_t to_head_stride, const word* from, int64_t from_head_stride, int64_t heads,
                           int64_t dim) {
  for (int64_t i = threadIdx.x; i < heads * dim; i += blockDim.x) {
    const int64_t head = i / dim, d = i % dim;
    to[head * to_head_stride + d] = from[head * from_head_stride + d];
  }
}

__device__ word* row_of(const heads_view& view, int64_t batch, int64_t row) {
  return static_cast<word*>(const_cast<void*>(view.data)) + batch * view.batch_stride + row * view.row_stride;
}

// The cache row of position `position` of sequence b: its dense row's slot, or the page its table names
// (clamped into the pool).
__device__ int64_t cache_row(const kvcache_call& c, int64_t b, int64_t position) {
  if (c.page_table == nullptr) return b * c.capacity + position;
  const int page = __ldg(c.page_table + b * c.pages_per_row + position / c.page_rows);
  return min(max(int64_t(page), int64_t(0)), c.pages - 1) * c.page_rows + position % c.page_rows;
}

// The keys of sequence b: the cached ones and the appended ones.
__device__ int64_t keys_of(const kvcache_call& c, int64_t b) { return int64_t(__ldg(c.cache_seqlens + b)) + c.new_len; }

// The tail's keys of sequence b: its last min(tail, L_b) (none if L_b is not positive).
__device__ int64_t tail_keys_of(const kvcache_call& c, int64_t b) {
  return min(c.tail, max(keys_of(c, b), int64_t(0)));
}

// The blocks of prepare_kernel, in order: one per appended position (B Nnew); one per decode sequence (b, s)
// copying q[b] into its Nq G x Hkv rows; one per sequence b gathering its tail; the last writes the metadata.
struct prepare_blocks {
  int64_t appends, queries, tails;

  __host__ __device__ explicit prepare_blocks(const kvcache_call& c)
      : appends(c.batch * c.new_len), queries(c.decode ? sequences_of(c) : 0), tails(c.tail > 0 ? c.batch : 0) {}
  __host__ __device__ int64_t count() const { return appends + queries + tails + 1; }
};

// Position `position` of sequence b's keys as prepare_kernel's blocks see them: the appended k, v where it
// is new (the cache's copy is written by another block of the same launch), else the cache's row.
__device__ void copy_key_and_value(const kvcache_call& c, int64_t b, int64_t position, word* key, word* value) {
  const int64_t cached = __ldg(c.cache_seqlens + b), head_dim = c.k.dim, value_dim = c.v.dim;
  if (position >= cached && c.new_len > 0) {
    const int64_t n = position - cached;
    copy_heads(key, head_dim, row_of(c.k, b, n), c.k.head_stride, c.kv_heads, head_dim);
    copy_heads(value, value_dim, row_of(c.v, b, n), c.v.head_stride, c.kv_heads, value_dim);
    return;
  }
  const int64_t row = cache_row(c, b, min(max(position, int64_t(0)), c.capacity - 1));
  copy_heads(key, head_dim, row_of(c.k_cache, 0, row), c.k_cache.head_stride, c.kv_heads, head_dim);
  copy_heads(value, value_dim, row_of(c.v_cache, 0, row), c.v_cache.head_stride, c.kv_heads, value_dim);
}

__global__ void __launch_bounds__(PREPARE_THREADS) prepare_kernel(const __grid_constant__ kvcache_call c) {
  const prepare_blocks blocks(c);
  int64_t block = blockIdx.x;
  if (block < blocks.appends) {
    const int64_t b = block / c.new_len, n = block % c.new_len;
    const int64_t position = min(max(int64_t(__ldg(c.cache_seqlens + b)) + n, int64_t(0)), c.capacity - 1);
    const int64_t row = cache_row(c, b, position);
    copy_heads(row_of(c.k_cache, 0, row), c.k_cache.head_stride, row_of(c.k, b, n), c.k.head_stride, c.kv_heads, c.k.dim);
    copy_heads(row_of(c.v_cache, 0, row), c.v_cache.head_stride, row_of(c.v, b, n), c.v.head_stride, c.kv_heads, c.v.dim);
    return;
  }
  block -= blocks.appends;
  if (block < blocks.queries) {
    // sequence (b, s)'s row (i, g) of head kv: q[b, i, kv G + g]
    const int64_t sequence = block, b = sequence / c.splits, group = group_of(c), dim = c.q.dim;
    word* rows = static_cast<word*>(c.q_rows) + sequence * c.q_len * group * c.kv_heads * dim;
    for (int64_t i = 0; i < c.q_len; ++i) {
      const word* q = row_of(c.q, b, i);
      word* query_rows = rows + i * group * c.kv_heads * dim;
      for (int64_t e = threadIdx.x; e < c.q_heads * dim; e += blockDim.x) {
        const int64_t head = e / dim, d = e % dim, kv = head / group, g = head % group;
        query_rows[(g * c.kv_heads + kv) * dim + d] = q[head * c.q.head_stride + d];
      }
    }
    return;
  }
  block -= blocks.queries;
  if (block < blocks.tails) {
    const int64_t b = block, count = tail_keys_of(c, b), first = keys_of(c, b) - count;
    for (int64_t j = 0; j < count; ++j) {
      const int64_t row = b * c.tail + j;
      copy_key_and_value(c, b, first + j, static_cast<word*>(c.k_tail) + row * c.kv_heads * c.k.dim,
                         static_cast<word*>(c.v_tail) + row * c.kv_heads * c.v.dim);
    }
    return;
  }
  const int64_t sequences = sequences_of(c), group = group_of(c);
  for (int64_t i = threadIdx.x; i <= sequences; i += blockDim.x) {
    if (!c.decode) {
      c.cu_seqlens_q[i] = int(i * c.q_len);
      c.cu_seqlens_k[i] = int(i * c.capacity);
      if (i < sequences) c.seqused_k[i] = int(keys_of(c, i));
      continue;
    }
    const int64_t b = i / c.splits, s = i % c.splits;
    c.cu_seqlens_q[i] = int(i * c.q_len * group);
    c.cu_seqlens_k[i] = int(i < sequences ? b * c.capacity + s * c.chunk : c.batch * c.capacity);
    if (i < sequences) c.seqused_k[i] = int(max(keys_of(c, b) - c.tail - s * c.chunk, int64_t(0)));
  }
  for (int64_t b = threadIdx.x; c.tail > 0 && b <= c.batch; b += blockDim.x) {
    c.tail_cu_seqlens_q[b] = int(b * c.q_len);
    c.tail_cu_seqlens_k[b] = int(b * c.tail);
    if (b < c.batch) c.tail_seqused_k[b] = int(tail_keys_of(c, b));
  }
}

// One block per (b, query i, query head): the lse and outputs of that row in each chunk (and the tail).
template <typename T>
__global__ void __launch_bounds__(COMBINE_THREADS) combine_kernel(const __grid_constant__ kvcache_combine c) {
  const int64_t head = blockIdx.x % c.q_heads, query = blockIdx.x / c.q_heads;  // query = b Nq + i
  const int64_t b = query / c.q_len, i = query % c.q_len;
  const int64_t group = c.q_heads / c.kv_heads, kv = head / group, g = head % group;
  const int64_t rows = c.batch * c.splits * c.q_len * group;
  const auto row = [&](int64_t s) { return ((b * c.splits + s) * c.q_len + i) * group + g; };
  const float* chunk_lse = c.lse_rows + kv * rows;
  const bool with_tail = c.tail_out != nullptr;
  const float tail_lse = with_tail ? c.tail_lse[head * c.batch * c.q_len + query] : -INFINITY;
  float largest = fmaxf(c.sinks != nullptr ? __ldg(c.sinks + head) : -INFINITY, tail_lse);
  for (int64_t s = 0; s < c.splits; ++s) largest = fmaxf(largest, chunk_lse[row(s)]);
  const bool nothing_seen = largest == -INFINITY;
  float total = (c.sinks != nullptr ? expf(__ldg(c.sinks + head) - largest) : 0.0f) + expf(tail_lse - largest);
  for (int64_t s = 0; s < c.splits; ++s) total += expf(chunk_lse[row(s)] - largest);
  const float lse = nothing_seen ? -INFINITY : largest + logf(total);
  const T* out_rows = static_cast<const T*>(c.out_rows);
  const T* tail_out = static_cast<const T*>(c.tail_out) + (query * c.q_heads + head) * c.value_dim;
  T* out = static_cast<T*>(c.out) + (query * c.q_heads + head) * c.value_dim;
  for (int64_t d = threadIdx.x; d < c.value_dim; d += blockDim.x) {
    float sum = 0.0f;
    for (int64_t s = 0; s < c.splits && !nothing_seen; ++s) {
      sum += expf(chunk_lse[row(s)] - lse) * float(out_rows[(row(s) * c.kv_heads + kv) * c.value_dim + d]);
    }
    if (with_tail && !nothing_seen) sum += expf(tail_lse - lse) * float(tail_out[d]);
    out[d] = T(sum);
  }
  if (threadIdx.x == 0) c.lse[(b * c.q_heads + head) * c.q_len + i] = lse;
}

using kvcache_dtypes = one_of<element_type::bf16, element_type::fp16>;

}  // namespace

decode_split decode_split_for(int64_t batch, int64_t kv_heads, int64_t capacity, int sms) {
  const int64_t tasks = batch * kv_heads;
  const int64_t wanted = ceil_div(DECODE_TASKS_PER_SM * sms, tasks);
  const int64_t splits = std::clamp<int64_t>(wanted, 1, std::max<int64_t>(1, capacity / DECODE_MIN_CHUNK));
  const int64_t chunk = round_up<int64_t>(ceil_div(capacity, splits), KEY_BLOCK_ALIGNMENT);
  return {ceil_div(capacity, chunk), chunk};
}

cudaError_t launch_prepare(const kvcache_call& call, cudaStream_t stream) {
  return pipeline::launch(prepare_kernel, dim3(unsigned(prepare_blocks(call).count())), dim3(PREPARE_THREADS), 0,
                          stream, call);
}

cudaError_t launch_combine(const kvcache_combine& c, cudaStream_t stream) {
  return dispatch<kvcache_dtypes>(
      [&]<element_type E>() {
        return pipeline::launch(combine_kernel<element_t<E>>, dim3(unsigned(c.batch * c.q_len * c.q_heads)),
                                dim3(COMBINE_THREADS), 0, stream, c);
      },
      c.dtype);
}

}  // namespace tk::attention
