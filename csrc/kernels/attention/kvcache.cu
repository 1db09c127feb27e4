// The KV-cache call's work around the forward kernel (kvcache.h): one launch before it (the append, the
// decode form's chunks of the rows, their query rows, the packed sequences' metadata) and one after it (the
// decode form's combine of its split-KV chunks). Both move a few rows per block; neither is near a bandwidth
// or compute limit at the sizes of a decode step, so they are written for one launch each rather than for
// throughput. The decode form's chunks depend on every row's length, which only the device knows: each
// block that needs them works them out itself from cache_seqlens (block-wide passes over the B lengths), so
// the launch needs no order between its blocks. Those passes cost each of the ~B + target_chunks blocks
// O(B), so beyond DECODE_BALANCED_MAX_ROWS rows each row is one chunk (sequence b: row b), with no pass.
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

// Split-KV: about two tasks per SM over all rows' keys (the forward holds one task per SM at a time: two
// rounds), chunks of at least 256 keys (a task's fixed costs: the 2026-11-29 A/B of eight tasks per SM lost
// 40% at B = 1 with 256-1024-key chunks).
constexpr int64_t DECODE_TASKS_PER_SM = 2;
constexpr unsigned DECODE_MIN_CHUNK = 256;
static_assert(DECODE_MIN_CHUNK % KEY_BLOCK_ALIGNMENT == 0);
// Rows beyond which each is one chunk: two tiles of the prepare's passes (kvcache.h), and at least twice the
// target_chunks of a 132-SM H200 (264 at Hkv = 1), where the rows alone fill the two rounds.
constexpr int64_t DECODE_BALANCED_MAX_ROWS = 2 * PREPARE_THREADS;
constexpr int PREPARE_WARPS = PREPARE_THREADS / WARP_THREADS;

// Both element types are 2 bytes: the copies move them as raw 16-bit words, whatever the type.
using word = uint16_t;
static_assert(element_bytes(element_type::bf16) == sizeof(word) && element_bytes(element_type::fp16) == sizeof(word));

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

// The decode form's keys of row b: the prefix every query sees, clamped into the row's capacity.
__device__ int prefix_keys_of(const kvcache_call& c, int64_t b) {
  return int(min(max(keys_of(c, b) - c.tail, int64_t(0)), c.capacity));
}

// The sum of `value` over the block's threads, on every thread (every thread of the block calls it).
__device__ int64_t block_sum(int64_t value) {
  __shared__ int64_t warp_sums[PREPARE_WARPS];
  for (int distance = WARP_THREADS / 2; distance > 0; distance /= 2) {
    value += __shfl_xor_sync(ALL_LANES, value, distance);
  }
  __syncthreads();  // a previous call's reads are done
  if (lane_id() == 0) warp_sums[warp_id()] = value;
  __syncthreads();
  int64_t total = 0;
  for (int w = 0; w < PREPARE_WARPS; ++w) total += warp_sums[w];
  return total;
}

// The sum of `value` over the block's earlier threads, and in `total` over all of them (every thread calls it).
__device__ int64_t block_exclusive_scan(int64_t value, int64_t& total) {
  __shared__ int64_t warp_sums[PREPARE_WARPS];
  int64_t through = value;  // this lane's and the warp's earlier lanes'
  for (int distance = 1; distance < WARP_THREADS; distance *= 2) {
    const int64_t earlier = __shfl_up_sync(ALL_LANES, through, distance);
    if (lane_id() >= distance) through += earlier;
  }
  __syncthreads();  // a previous call's reads are done
  if (lane_id() == WARP_THREADS - 1) warp_sums[warp_id()] = through;
  __syncthreads();
  int64_t before = through - value;
  total = 0;
  for (int w = 0; w < PREPARE_WARPS; ++w) {
    if (w < warp_id()) before += warp_sums[w];
    total += warp_sums[w];
  }
  return before;
}

// A row's chunks: `count` of `length` positions each (a multiple of KEY_BLOCK_ALIGNMENT), the last ending at
// its keys: about keys / chunk of them (no more: the host's bound), none shorter than DECODE_MIN_CHUNK but a
// row's only one. One length per row rather than `chunk`s and a remainder, so that a row's rounding makes
// no short task: full rows split as the capacity-sized chunks did (the same lengths wherever those made at
// most target_chunks). The starts s length are below the keys: count = ceil(keys / length). Unsigned 32-bit
// arithmetic: keys and chunk are below 2^31 (int32 positions), so ceil_div's sums stay below 2^32.
struct row_chunks {
  int count, length;
};
__device__ row_chunks chunks_of(int keys, int chunk) {
  if (keys == 0) return {0, 0};
  const unsigned all = keys, most = max(all / DECODE_MIN_CHUNK, 1u);
  const unsigned wanted = min(max(ceil_div(all, unsigned(chunk)), 1u), most);
  const unsigned length = round_up(ceil_div(all, wanted), unsigned(KEY_BLOCK_ALIGNMENT));
  return {int(ceil_div(all, length)), int(length)};
}

// The chunks every row makes with chunk length `chunk` (block-wide: every thread of the block calls it).
__device__ int64_t chunks_over_rows(const kvcache_call& c, int chunk) {
  int64_t chunks = 0;
  for (int64_t b = threadIdx.x; b < c.batch; b += blockDim.x) chunks += chunks_of(prefix_keys_of(c, b), chunk).count;
  return block_sum(chunks);
}

// The decode form's chunk length (kvcache.h; block-wide): the smallest multiple of KEY_BLOCK_ALIGNMENT, at
// least max(DECODE_MIN_CHUNK, sum of the keys / target_chunks), with which the rows make at most
// target_chunks chunks: the tasks then take two rounds of the SMs, where each row's rounding up would add a
// third (B = 8 rows of 9-56k keys: 36 chunks at the least length, 33 at 8064). The count falls as the
// length grows, so a binary search up to the capacity (each row one chunk) finds it; where even that makes
// more (more rows than target_chunks), the least length.
__device__ int decode_chunk_of(const kvcache_call& c) {
  int64_t keys = 0;
  for (int64_t b = threadIdx.x; b < c.batch; b += blockDim.x) keys += prefix_keys_of(c, b);
  const int64_t per_chunk = ceil_div(block_sum(keys), c.target_chunks);
  // (below 2^31: at most DECODE_BALANCED_MAX_ROWS x the capacity, rounded up)
  const int least = int(max(int64_t(DECODE_MIN_CHUNK), round_up(per_chunk, int64_t(KEY_BLOCK_ALIGNMENT))));
  int low = least, high = int(round_up(c.capacity, int64_t(KEY_BLOCK_ALIGNMENT)));
  if (chunks_over_rows(c, low) <= c.target_chunks || high <= low || chunks_over_rows(c, high) > c.target_chunks) {
    return least;
  }
  while (high - low > KEY_BLOCK_ALIGNMENT) {  // low makes too many chunks, high few enough
    const int middle = low + (high - low) / (2 * KEY_BLOCK_ALIGNMENT) * KEY_BLOCK_ALIGNMENT;
    if (chunks_over_rows(c, middle) <= c.target_chunks) {
      high = middle;
    } else {
      low = middle;
    }
  }
  return high;
}

// The decode form's rows in order, block-wide (every thread of the block calls it), until `wanted` chunks
// are laid out or the rows end: visit(b, first, chunks) on the thread of row b, whose chunks are the
// sequences [first, first + chunks.count). Returns the chunks laid out (all of them: the rows ended).
// Beyond DECODE_BALANCED_MAX_ROWS rows (not balanced): row b is sequence b, one chunk of the capacity.
template <typename Visit>
__device__ int64_t for_each_row(const kvcache_call& c, int64_t wanted, Visit visit) {
  if (!c.balanced) {
    for (int64_t b = threadIdx.x; b < min(wanted, c.batch); b += blockDim.x) visit(b, b, row_chunks{1, int(c.capacity)});
    return min(wanted, c.batch);
  }
  const int chunk = decode_chunk_of(c);
  int64_t first = 0;  // the chunks of the earlier tiles of rows
  for (int64_t tile = 0; tile < c.batch && first < wanted; tile += blockDim.x) {
    const int64_t b = tile + threadIdx.x;
    const row_chunks row = b < c.batch ? chunks_of(prefix_keys_of(c, b), chunk) : row_chunks{0, 0};
    int64_t tile_chunks;
    const int64_t before = block_exclusive_scan(row.count, tile_chunks);
    if (b < c.batch) visit(b, first + before, row);
    first += tile_chunks;
  }
  return first;
}

// The blocks of prepare_kernel, in order: one per appended position (B Nnew); one per decode sequence j
// copying q[b] into its Nq G x Hkv rows when j is a chunk of row b; one per sequence b gathering its tail;
// the last writes the metadata.
struct prepare_blocks {
  int64_t appends, queries, tails;

  __host__ __device__ explicit prepare_blocks(const kvcache_call& c)
      : appends(c.batch * c.new_len), queries(c.decode ? c.sequences : 0), tails(c.tail > 0 ? c.batch : 0) {}
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
    // sequence j's row (i, g) of head kv: q[b, i, kv G + g], where j is a chunk of row b (an empty sequence
    // past the last chunk: none)
    const int64_t sequence = block;
    __shared__ int64_t owner;
    if (threadIdx.x == 0) owner = -1;
    __syncthreads();
    for_each_row(c, sequence + 1, [&](int64_t b, int64_t first, row_chunks row) {
      if (first <= sequence && sequence < first + row.count) owner = b;
    });
    __syncthreads();
    if (owner < 0) return;
    const int64_t b = owner, group = group_of(c), dim = c.q.dim;
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
  if (c.decode) {
    // Row by row, the chunks (cu_seqlens_k is then nondecreasing: each sequence's span reaches the next
    // one's start, past its keys), then the empty sequences up to the host's bound. That bound holds the
    // chunks of any lengths (decode_split_for); the writes are bounded by it all the same. Every row's
    // offset is written, the empty rows' too.
    const int64_t rows_per_sequence = c.q_len * group_of(c), every_row = INT64_MAX;
    const auto write = [&](int64_t b, int64_t first, row_chunks row) {
      c.chunk_offsets[b] = int(min(first, c.sequences));
      const int64_t keys = prefix_keys_of(c, b), length = row.length;
      for (int64_t s = 0; s < row.count && first + s < c.sequences; ++s) {
        c.cu_seqlens_q[first + s] = int((first + s) * rows_per_sequence);
        c.cu_seqlens_k[first + s] = int(b * c.capacity + s * length);
        c.seqused_k[first + s] = int(min(length, keys - s * length));
      }
    };
    const int64_t chunks = for_each_row(c, every_row, write);
    const int64_t used = min(chunks, c.sequences);
    for (int64_t i = used + threadIdx.x; i <= c.sequences; i += blockDim.x) {
      c.cu_seqlens_q[i] = int(used * rows_per_sequence);
      c.cu_seqlens_k[i] = int(c.batch * c.capacity);
      if (i < c.sequences) c.seqused_k[i] = 0;
    }
    if (threadIdx.x == 0) c.chunk_offsets[c.batch] = int(used);
  } else {
    for (int64_t i = threadIdx.x; i <= c.sequences; i += blockDim.x) {
      c.cu_seqlens_q[i] = int(i * c.q_len);
      c.cu_seqlens_k[i] = int(i * c.capacity);
      if (i < c.sequences) c.seqused_k[i] = int(keys_of(c, i));
    }
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
  const int64_t rows = c.sequences * c.q_len * group;
  // row b's chunks, the sequences [first, first + splits)
  const int64_t first = min(max(int64_t(__ldg(c.chunk_offsets + b)), int64_t(0)), c.sequences);
  const int64_t splits = min(max(int64_t(__ldg(c.chunk_offsets + b + 1)), first), c.sequences) - first;
  const auto row = [&](int64_t s) { return ((first + s) * c.q_len + i) * group + g; };
  const float* chunk_lse = c.lse_rows + kv * rows;
  const bool with_tail = c.tail_out != nullptr;
  const float tail_lse = with_tail ? c.tail_lse[head * c.batch * c.q_len + query] : -INFINITY;
  float largest = fmaxf(c.sinks != nullptr ? __ldg(c.sinks + head) : -INFINITY, tail_lse);
  for (int64_t s = 0; s < splits; ++s) largest = fmaxf(largest, chunk_lse[row(s)]);
  const bool nothing_seen = largest == -INFINITY;
  float total = (c.sinks != nullptr ? expf(__ldg(c.sinks + head) - largest) : 0.0f) + expf(tail_lse - largest);
  for (int64_t s = 0; s < splits; ++s) total += expf(chunk_lse[row(s)] - largest);
  const float lse = nothing_seen ? -INFINITY : largest + logf(total);
  const T* out_rows = static_cast<const T*>(c.out_rows);
  const T* tail_out = static_cast<const T*>(c.tail_out) + (query * c.q_heads + head) * c.value_dim;
  T* out = static_cast<T*>(c.out) + (query * c.q_heads + head) * c.value_dim;
  for (int64_t d = threadIdx.x; d < c.value_dim; d += blockDim.x) {
    float sum = 0.0f;
    for (int64_t s = 0; s < splits && !nothing_seen; ++s) {
      sum += expf(chunk_lse[row(s)] - lse) * float(out_rows[(row(s) * c.kv_heads + kv) * c.value_dim + d]);
    }
    if (with_tail && !nothing_seen) sum += expf(tail_lse - lse) * float(tail_out[d]);
    out[d] = T(sum);
  }
  if (threadIdx.x == 0) c.lse[(b * c.q_heads + head) * c.q_len + i] = lse;
}

using kvcache_dtypes = one_of<element_type::bf16, element_type::fp16>;

}  // namespace

// The chunks any lengths make: the chunk is at least sum_b P_b / target_chunks, and each row's ceiling
// adds less than one, so at most target_chunks + B - 1; and no row makes more than C / DECODE_MIN_CHUNK.
decode_split decode_split_for(int64_t batch, int64_t kv_heads, int64_t capacity, int sms) {
  if (batch > DECODE_BALANCED_MAX_ROWS) return {false, 0, batch};
  const int64_t target_chunks = ceil_div(DECODE_TASKS_PER_SM * sms, kv_heads);
  return {true, target_chunks,
          std::min(target_chunks + batch - 1, batch * ceil_div(capacity, int64_t(DECODE_MIN_CHUNK)))};
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
