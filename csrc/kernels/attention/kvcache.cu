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

// Blocks [0, B Nnew): one appended position each; then (decode) one block per sequence (b, s) copying
// q[b] into its G x Hkv rows; the last block writes the metadata.
__global__ void __launch_bounds__(PREPARE_THREADS) prepare_kernel(const __grid_constant__ kvcache_call c) {
  const int64_t appends = c.batch * c.new_len;
  const int64_t query_blocks = c.decode ? sequences_of(c) : 0;
  const int64_t block = blockIdx.x;
  if (block < appends) {
    const int64_t b = block / c.new_len, n = block % c.new_len;
    const int64_t position = min(max(int64_t(__ldg(c.cache_seqlens + b)) + n, int64_t(0)), c.capacity - 1);
    const int64_t row = cache_row(c, b, position);
    copy_heads(row_of(c.k_cache, 0, row), c.k_cache.head_stride, row_of(c.k, b, n), c.k.head_stride, c.kv_heads, c.k.dim);
    copy_heads(row_of(c.v_cache, 0, row), c.v_cache.head_stride, row_of(c.v, b, n), c.v.head_stride, c.kv_heads, c.v.dim);
    return;
  }
  if (block < appends + query_blocks) {
    // sequence (b, s)'s rows g, heads kv: q[b, 0, kv G + g]
    const int64_t sequence = block - appends, b = sequence / c.splits, group = group_of(c), dim = c.q.dim;
    word* rows = static_cast<word*>(c.q_rows) + sequence * group * c.kv_heads * dim;
    const word* q = row_of(c.q, b, 0);
    for (int64_t i = threadIdx.x; i < c.q_heads * dim; i += blockDim.x) {
      const int64_t head = i / dim, d = i % dim, kv = head / group, g = head % group;
      rows[(g * c.kv_heads + kv) * dim + d] = q[head * c.q.head_stride + d];
    }
    return;
  }
  const int64_t sequences = sequences_of(c);
  for (int64_t i = threadIdx.x; i <= sequences; i += blockDim.x) {
    if (!c.decode) {
      c.cu_seqlens_q[i] = int(i * c.q_len);
      c.cu_seqlens_k[i] = int(i * c.capacity);
      if (i < sequences) c.seqused_k[i] = __ldg(c.cache_seqlens + i) + int(c.new_len);
      continue;
    }
    const int64_t b = i / c.splits, s = i % c.splits;
    c.cu_seqlens_q[i] = int(i * group_of(c));
    c.cu_seqlens_k[i] = int(i < sequences ? b * c.capacity + s * c.chunk : c.batch * c.capacity);
    if (i < sequences) {
      const int64_t keys = int64_t(__ldg(c.cache_seqlens + b)) + c.new_len - s * c.chunk;
      c.seqused_k[i] = int(max(keys, int64_t(0)));
    }
  }
}

// One block per (b, query head): the chunks' lse and outputs of that head's row in each chunk.
template <typename T>
__global__ void __launch_bounds__(COMBINE_THREADS) combine_kernel(const __grid_constant__ kvcache_combine c) {
  const int64_t b = blockIdx.x / c.q_heads, head = blockIdx.x % c.q_heads;
  const int64_t group = c.q_heads / c.kv_heads, kv = head / group, g = head % group;
  const int64_t rows = c.batch * c.splits * group;
  const auto row = [&](int64_t s) { return (b * c.splits + s) * group + g; };
  const float* chunk_lse = c.lse_rows + kv * rows;
  float largest = c.sinks != nullptr ? __ldg(c.sinks + head) : -INFINITY;
  for (int64_t s = 0; s < c.splits; ++s) largest = fmaxf(largest, chunk_lse[row(s)]);
  const bool nothing_seen = largest == -INFINITY;
  float total = c.sinks != nullptr ? expf(__ldg(c.sinks + head) - largest) : 0.0f;
  for (int64_t s = 0; s < c.splits; ++s) total += expf(chunk_lse[row(s)] - largest);
  const float lse = nothing_seen ? -INFINITY : largest + logf(total);
  const T* out_rows = static_cast<const T*>(c.out_rows);
  T* out = static_cast<T*>(c.out) + (b * c.q_heads + head) * c.value_dim;
  for (int64_t d = threadIdx.x; d < c.value_dim; d += blockDim.x) {
    float sum = 0.0f;
    for (int64_t s = 0; s < c.splits && !nothing_seen; ++s) {
      sum += expf(chunk_lse[row(s)] - lse) * float(out_rows[(row(s) * c.kv_heads + kv) * c.value_dim + d]);
    }
    out[d] = T(sum);
  }
  if (threadIdx.x == 0) c.lse[b * c.q_heads + head] = lse;
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
  const int64_t blocks = call.batch * call.new_len + (call.decode ? sequences_of(call) : 0) + 1;
  return pipeline::launch(prepare_kernel, dim3(unsigned(blocks)), dim3(PREPARE_THREADS), 0, stream, call);
}

cudaError_t launch_combine(const kvcache_combine& c, cudaStream_t stream) {
  return dispatch<kvcache_dtypes>(
      [&]<element_type E>() {
        return pipeline::launch(combine_kernel<element_t<E>>, dim3(unsigned(c.batch * c.q_heads)),
                                dim3(COMBINE_THREADS), 0, stream, c);
      },
      c.dtype);
}

}  // namespace tk::attention
