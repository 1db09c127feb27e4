// Attention on the tile core: the tile plans and the pieces the forward and backward kernels share.
//
// Every kernel is warp-specialised: warpgroup 0 is the producer (one thread issues TMA), the
// consumer warpgroups each own 64 rows of a wgmma (WGMMA_M) and compute from shared memory.
//
//   forward   (attention_fwd.cu)  a block owns 128 query rows; K/V blocks of 128 keys stream through
//                                 a ring of stages; S = Q K^T (SS), online softmax in registers,
//                                 O += P V (P from registers, RS).
//   backward  (attention_bwd.cu)  1. per-row statistics: lse in base 2, delta = rowsum(dO * O) - dlse
//                                 2. dK, dV: a block owns 128 keys of one K/V head and streams the
//                                    64-row query tiles of every query head of its group, so GQA
//                                    sums stay in registers (no atomics, deterministic)
//                                 3. dQ: a block owns 128 query rows and streams K/V blocks, so dQ
//                                    is summed in registers too (deterministic, no fp32 workspace)
//
// Scores live in the log2 domain: s2 = scale * log2(e) * q.k, p = exp2(s2 - max2), so the softmax
// scale folds into one multiply and exponentials are single ex2 instructions.
#pragma once

#include <cmath>
#include <string>

#include "attention.h"
#include "tk/tk.cuh"
#include "tk/types/register_numeric.cuh"

namespace tk::attention {

using warpgroup::accumulator;
using warpgroup::operand_major;

constexpr int CONSUMER_ROWS = 64;  // rows of one wgmma: a consumer warpgroup's share of a tile
constexpr float LOG2_E = 1.4426950408889634f;
constexpr float LN_2 = 0.6931471805599453f;
constexpr float NEG_INF = -INFINITY;

// Tile plans. Shared memory and registers are the binding limits: 2 consumers x 240 registers plus
// a 24-register producer fill the 64K register file; the stage counts fill about 160 KB of shared memory.
template <int D>
struct forward_plan {
  static constexpr int consumer_warpgroups = 2;
  static constexpr int block_q = consumer_warpgroups * CONSUMER_ROWS;
  static constexpr int block_kv = 128;
  static constexpr int stages = D == 128 ? 2 : 3;
  static constexpr int producer_registers = 24;
  static constexpr int consumer_registers = 240;
};

template <int D>
struct dkdv_plan {
  static constexpr int consumer_warpgroups = 2;
  static constexpr int block_kv = consumer_warpgroups * CONSUMER_ROWS;
  static constexpr int block_q = 64;
  static constexpr int stages = D == 128 ? 2 : 3;
  static constexpr int producer_registers = 24;
  static constexpr int consumer_registers = 240;
};

template <int D>
struct dq_plan {
  static constexpr int consumer_warpgroups = 2;
  static constexpr int block_q = consumer_warpgroups * CONSUMER_ROWS;
  static constexpr int block_kv = 128;
  static constexpr int stages = 2;
  static constexpr int producer_registers = 24;
  static constexpr int consumer_registers = 240;
};

// The backward's per-row statistics are padded to whole query blocks of every kernel.
constexpr int STATISTICS_ROW_MULTIPLE = 128;
static_assert(STATISTICS_ROW_MULTIPLE % dq_plan<128>::block_q == 0 && STATISTICS_ROW_MULTIPLE % dkdv_plan<128>::block_q == 0);

template <int PRODUCERS_AND_CONSUMERS>
constexpr int block_threads = PRODUCERS_AND_CONSUMERS * WARPGROUP_THREADS;

template <typename Plan>
constexpr bool fits_register_file() {
  return Plan::producer_registers * WARPGROUP_THREADS +
             Plan::consumer_registers * Plan::consumer_warpgroups * WARPGROUP_THREADS <=
         warpgroup::REGISTER_FILE;
}

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// ------------------------------------------------------------------------------------ masking

// Which keys a query sees: key j < Nk, and under the bottom-right causal mask j <= i + Nk - Nq.
struct visibility {
  int q_rows;
  int k_rows;
  bool causal;

  __device__ int diagonal() const { return k_rows - q_rows; }
  __device__ bool visible(int query, int key) const { return key < k_rows && (!causal || key <= query + diagonal()); }
  // Whether some (query, key) of the rectangle [q0, q0 + q_count) x [k0, k0 + k_count) is hidden.
  __device__ bool needs_mask(int q0, int k0, int k_count) const {
    return k0 + k_count > k_rows || (causal && k0 + k_count - 1 > q0 + diagonal());
  }
  // Key blocks of `block_kv` keys that queries [q0, q0 + q_count) see (clipped to Nq): a prefix.
  __device__ int key_blocks(int q0, int q_count, int block_kv) const {
    const int all = ceil_div(k_rows, block_kv);
    if (!causal) return all;
    const int last_key = min(q0 + q_count, q_rows) - 1 + diagonal();
    return last_key < 0 ? 0 : min(all, last_key / block_kv + 1);
  }
  // The first query tile of `block_q` rows that sees any key of [k0, ...).
  __device__ int first_query_tile(int k0, int block_q) const {
    return causal ? max(0, k0 - diagonal()) / block_q : 0;
  }
};

// --------------------------------------------------------------- accumulator rows and columns
//
// In a wgmma accumulator (wgmma.cuh), register k of a lane is at row first_row() + 8 * half(k) and
// column 8 * (k / 4) + first_col() + k % 2: each lane holds two rows (halves) of its warp's 16.

__device__ __forceinline__ int row_half(int k) { return (k / 2) % 2; }

template <int N>
__device__ __forceinline__ int accumulator_row(int k) { return accumulator<N>::first_row() + 8 * row_half(k); }

template <int N>
__device__ __forceinline__ int accumulator_col(int k) { return 8 * (k / 4) + accumulator<N>::first_col() + k % 2; }

// The 4 lanes that hold one row exchange partial results over these xor distances.
__device__ __forceinline__ float reduce_row_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float reduce_row_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The register A operand (64 x N, K = N) of an RS wgmma from an fp32 accumulator of the same
// shape, converted to T: k16 step kk takes registers 8 kk .. 8 kk + 7 as pairs (wgmma.cuh's mma).
template <typename T, int N>
struct a_fragments {
  uint32_t steps[N / 16][4];

  __device__ void pack(const accumulator<N>& acc) {
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 pair{acc.data[8 * kk + 2 * q], acc.data[8 * kk + 2 * q + 1]};
        steps[kk][q] = pair_bits(numeric<T>::pair_from_float2(pair));
      }
    }
  }
  // The registers are read by wgmmas in flight: keep the compiler from reusing them before the wait.
  __device__ void pin() {
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
#pragma unroll
      for (int q = 0; q < 4; ++q) asm volatile("" : "+r"(steps[kk][q])::"memory");
    }
  }
};

// acc (+)= A * B over the whole K of B, A from registers (64 x K), B a K x N tile read MN-major
// (its rows are K, as V (keys x D) is for O += P V).
template <typename T, int N, int K, typename TileB>
__device__ __forceinline__ void mma_rs(accumulator<N>& acc, const a_fragments<T, K>& a, const TileB& b) {
  static_assert(TileB::rows == K && TileB::cols == N, "B must be K x N");
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) warpgroup::mma<operand_major::mn>(acc, a.steps[kk], b, 0, 16 * kk, true);
}

template <int N>
__device__ __forceinline__ void fill(accumulator<N>& acc, float value) {
#pragma unroll
  for (int k = 0; k < accumulator<N>::registers; ++k) acc.data[k] = value;
}

// --------------------------------------------------------------------------- host: layouts

template <typename T>
global_layout<T, 4> heads_layout(const heads_view& t) {
  // A dimension of extent 1 is never stepped over, so any stride TMA accepts describes it.
  constexpr int64_t elements_per_16_bytes = 16 / int64_t(sizeof(T));
  const auto round_up = [](int64_t x) { return (x + elements_per_16_bytes - 1) / elements_per_16_bytes * elements_per_16_bytes; };
  const int64_t row_stride = t.rows == 1 ? round_up(t.dim) : t.row_stride;
  const int64_t head_stride = t.heads == 1 ? round_up(t.rows * row_stride) : t.head_stride;
  const int64_t batch_stride = t.batch == 1 ? round_up(t.heads * head_stride) : t.batch_stride;
  return {static_cast<T*>(const_cast<void*>(t.data)), {t.batch, t.heads, t.rows, t.dim}, {batch_stride, head_stride, row_stride}};
}

inline heads_view contiguous_view(const void* data, int64_t batch, int64_t heads, int64_t rows, int64_t dim) {
  return {data, batch, heads, rows, dim, heads * rows * dim, rows * dim, dim};
}

inline int64_t padded_statistics_rows(int64_t q_rows) {
  return (q_rows + STATISTICS_ROW_MULTIPLE - 1) / STATISTICS_ROW_MULTIPLE * STATISTICS_ROW_MULTIPLE;
}

// Shape rules shared by both directions; layout rules are checked per kernel with its tiles.
inline std::string shape_reason(const heads_view& q, const heads_view& k, const heads_view& v) {
  if (q.dim != 64 && q.dim != 128) return "the head dim must be 64 or 128";
  if (k.dim != q.dim || v.dim != q.dim) return "q, k and v must share the head dim";
  if (q.batch != k.batch || v.batch != k.batch || v.heads != k.heads || v.rows != k.rows) return "k and v must match";
  if (k.heads < 1 || q.heads % k.heads != 0) return "Hq must be a multiple of Hkv";
  if (q.batch < 1 || q.rows < 1 || k.rows < 1) return "every size must be at least 1";
  if (q.batch > 65535 || q.heads > 65535) return "B and Hq must fit a grid dimension";
  if (q.rows > (int64_t(1) << 30) || k.rows > (int64_t(1) << 30)) return "sequence lengths must fit TMA coordinates";
  return {};
}

template <typename Tile, typename T>
std::string layout_reason(const char* name, const heads_view& t) {
  const std::string r = tma_unsupported_reason<Tile>(heads_layout<T>(t));
  return r.empty() ? r : std::string(name) + ": " + r;
}

// Dynamic shared memory for Storage: the struct plus room to align its start to a swizzle period.
template <typename Storage>
constexpr size_t shared_bytes = sizeof(Storage) + SWIZZLE_PERIOD_BYTES;

template <typename Storage>
__device__ __forceinline__ Storage& aligned_storage(uint8_t* raw) {
  const uintptr_t aligned = (reinterpret_cast<uintptr_t>(raw) + SWIZZLE_PERIOD_BYTES - 1) & ~uintptr_t(SWIZZLE_PERIOD_BYTES - 1);
  return *reinterpret_cast<Storage*>(aligned);
}

template <typename Kernel, typename Params>
cudaError_t launch_kernel(Kernel kernel, size_t smem, dim3 grid, int threads, const Params& params, cudaStream_t stream) {
  if (const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
      err != cudaSuccess) {
    return err;
  }
  kernel<<<grid, threads, smem, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace tk::attention
