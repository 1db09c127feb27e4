// Gated delta rule forward, the recurrent path (tk::gated_delta_rule on short sequences, as in
// decoding: csrc/torch/gated_delta_rule.cpp takes it when no sequence is longer than RECURRENT_MAX_T).
// Per (sequence, value head) the state S (K x V, fp32) is read once, stepped through the sequence's
// positions and written once; at each position t, with a = exp(g_t):
//
//   kv  = S^T k_t                  what S recalls for k_t (V values)
//   u   = beta_t (v_t - a kv)      the delta rule's correction
//   S   = a S + k_t u^T            = exp(g_t) (I - beta_t k_t k_t^T) S + beta_t k_t v_t^T
//   o_t = scale S^T q_t
//
// Everything in fp32, and only o is rounded, once, to v's dtype. With use_qk_l2norm, q_t and k_t are
// normalised in fp32 by the reference's factor 1 / sqrt(sum x^2 + eps), folded into the products (a
// multiply per column of S^T x, not per row of x).
//
// Plan: a decode step moves 2 K V 4 bytes of state per head against a few hundred bytes of inputs, so
// the kernel is a stream over the state, held in registers between its load and its store. A warp
// owns WARP_COLUMNS = 16 columns of one head's S: lane = COLUMN_LANES x row group + column lane, the
// column lane holding 4 consecutive columns (one float4), the row group D / 8 consecutive rows. One
// load instruction then reads 8 rows x 64 contiguous bytes (whole 32-byte sectors), and each product
// over K is a thread's own D / 8 rows followed by a 3-step butterfly over the row groups (warp
// shuffles: no shared memory, no barrier). The thread's rows of q and k are D / 8 contiguous elements
// (one or two 16-byte loads, the same address for the 4 column lanes of a row group). A block is
// WARPS independent warps, a SLICE of 64 columns; blocks run (sequence, head, slice) in that order, so
// consecutive blocks stream consecutive state. At B = 64, Hv = 32, K = V = 128: 4096 blocks of 128
// threads with 64 state floats a thread, 7.8 waves of 4 blocks an SM on 132 SMs, each thread's 16
// float4 loads of S issued before their first use (8 KiB in flight per warp hide the DRAM latency).
//
// The work per position is 3 K V FMAs per head (plus 24 shuffles a thread): at T = 1 it hides under
// the state's traffic; near T = 16 it is about as long as that traffic, where the chunked kernels'
// tensor cores take over (RECURRENT_MAX_T).
#include <cstdint>

#include "gated_delta_rule_common.cuh"
#include "tk/common.cuh"
#include "tk/dispatch.h"

namespace tk::gdn {
namespace {

using recurrent_dtypes = one_of<element_type::bf16, element_type::fp16>;
using recurrent_head_dims = one_of<64, 128>;  // K = V

constexpr int STATE_VECTOR = 4;                               // fp32 columns of S in one 16-byte load
constexpr int COLUMN_LANES = 4;                               // lanes across a row's WARP_COLUMNS
constexpr int ROW_GROUPS = WARP_THREADS / COLUMN_LANES;       // lanes down K
constexpr int WARP_COLUMNS = COLUMN_LANES * STATE_VECTOR;     // 64 contiguous bytes of a row of S
constexpr int WARPS = 4;
constexpr int THREADS = WARPS * WARP_THREADS;
constexpr int SLICE = WARPS * WARP_COLUMNS;                   // value columns per block
// At most 128 registers a thread (K = 128: 64 of S, 32 of q and k; unbounded, ptxas takes ~150, 3 blocks an
// SM): 16 warps an SM keep 128 KiB of S loads in flight, several times an SM's share of the HBM
// bandwidth-latency product (~4.8 TB/s x ~1 us / 132 SMs = ~36 KB).
constexpr int MIN_BLOCKS_PER_SM = 4;


// The sum over the warp's row groups (the lanes of one column lane), in each of them.
__device__ __forceinline__ float sum_over_row_groups(float x) {
#pragma unroll
  for (int distance = COLUMN_LANES; distance < WARP_THREADS; distance *= 2) {
    x += __shfl_xor_sync(ALL_LANES, x, distance);
  }
  return x;
}

// The thread's ROWS contiguous elements of a q or k row, in fp32.
template <typename T, int ROWS>
__device__ __forceinline__ void load_rows(const T* src, float (&x)[ROWS]) {
  constexpr int PER_VECTOR = ROW_VECTOR_BYTES / int(sizeof(T));
  static_assert(ROWS % PER_VECTOR == 0, "a thread's rows are whole 16-byte vectors");
#pragma unroll
  for (int piece = 0; piece < ROWS / PER_VECTOR; ++piece) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src + piece * PER_VECTOR);
    const T* elements = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int e = 0; e < PER_VECTOR; ++e) x[piece * PER_VECTOR + e] = float(elements[e]);
  }
}

// `multiplier`, divided by the norm of the row of which x holds the thread's rows when normalising
// (1 / sqrt(sum x^2 + eps), the sum over the ROW_GROUPS pieces across the warp). The products fold it
// in instead of scaling x, one multiply a column instead of one a row.
template <int ROWS>
__device__ __forceinline__ float row_factor(const float (&x)[ROWS], bool normalise, float multiplier) {
  if (!normalise) return multiplier;
  float squares = 0.0f;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) squares = fmaf(x[r], x[r], squares);
  return multiplier * rsqrtf(sum_over_row_groups(squares) + L2NORM_EPS);
}

// factor (S^T x) for the thread's columns: its rows' partial sums, then the butterfly over the row groups.
template <int ROWS>
__device__ __forceinline__ void columns_times(const float (&state)[ROWS][STATE_VECTOR], const float (&x)[ROWS],
                                              float factor, float (&out)[STATE_VECTOR]) {
#pragma unroll
  for (int c = 0; c < STATE_VECTOR; ++c) {
    float partial = 0.0f;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) partial = fmaf(state[r][c], x[r], partial);
    out[c] = factor * sum_over_row_groups(partial);
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS_PER_SM)
    recurrent_kernel(const __grid_constant__ forward_problem p) {
  constexpr int ROWS = D / ROW_GROUPS;  // of S, q and k per thread
  constexpr int SLICES = D / SLICE;
  static_assert(D % SLICE == 0, "a head is whole slices");
  const int heads = int(p.v.heads);  // 32-bit divisions: the grid fits an int (run)
  const int slice = int(blockIdx.x) % SLICES;
  const int head = int(blockIdx.x) / SLICES % heads;
  const int n = int(blockIdx.x) / SLICES / heads;
  const int row0 = lane_id() / COLUMN_LANES * ROWS;
  const int column0 = slice * SLICE + warp_id() * WARP_COLUMNS + lane_id() % COLUMN_LANES * STATE_VECTOR;
  const int key_head = head / (heads / int(p.q.heads));
  const sequence_rows seq = rows_of_sequence(p, n);
  const int64_t state_offset = (int64_t(n) * heads + head) * D * D + int64_t(row0) * D + column0;

  float state[ROWS][STATE_VECTOR];
  if (p.initial_state != nullptr) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      *reinterpret_cast<float4*>(state[r]) = *reinterpret_cast<const float4*>(p.initial_state + state_offset + r * D);
    }
  } else {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
      for (int c = 0; c < STATE_VECTOR; ++c) state[r][c] = 0.0f;
    }
  }

#pragma unroll 1
  for (int t = 0; t < seq.length; ++t) {
    const int64_t row = seq.start + t;
    const int64_t gate = (seq.batch * p.q.rows + row) * p.v.heads + head;  // g, beta: (B, T, Hv) contiguous
    const float decay = __expf(p.g[gate]), beta = p.beta[gate];
    const T* values = row_of<T>(p.v, seq.batch, head, row) + column0;
    float keys[ROWS], queries[ROWS];
    load_rows(row_of<T>(p.k, seq.batch, key_head, row) + row0, keys);
    load_rows(row_of<T>(p.q, seq.batch, key_head, row) + row0, queries);
    const float key_factor = row_factor(keys, p.l2norm, 1.0f);

    float recalled[STATE_VECTOR];
    columns_times(state, keys, key_factor, recalled);
#pragma unroll
    for (int c = 0; c < STATE_VECTOR; ++c) {
      const float correction = beta * (float(values[c]) - decay * recalled[c]);
      const float update = key_factor * correction;  // k_t's row factor, folded as in columns_times
#pragma unroll
      for (int r = 0; r < ROWS; ++r) state[r][c] = fmaf(keys[r], update, decay * state[r][c]);
    }

    float out[STATE_VECTOR];
    columns_times(state, queries, row_factor(queries, p.l2norm, p.scale), out);
    if (lane_id() < COLUMN_LANES) {  // every row group holds the sums: the first one stores
      alignas(sizeof(T) * STATE_VECTOR) T rounded[STATE_VECTOR];
#pragma unroll
      for (int c = 0; c < STATE_VECTOR; ++c) rounded[c] = T(out[c]);
      T* o = static_cast<T*>(p.o) + ((seq.batch * p.q.rows + row) * p.v.heads + head) * D + column0;
      *reinterpret_cast<uint2*>(o) = *reinterpret_cast<const uint2*>(rounded);
    }
  }

#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    *reinterpret_cast<float4*>(p.final_state + state_offset + r * D) = *reinterpret_cast<const float4*>(state[r]);
  }
}

template <typename T, int D>
cudaError_t run(const forward_problem& p, cudaStream_t stream) {
  // One grid dimension (up to 2^31 - 1 blocks): B or N alone can pass y's and z's 65535.
  const int64_t blocks = int64_t(p.sequences) * p.v.heads * (D / SLICE);
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  recurrent_kernel<T, D><<<unsigned(blocks), THREADS, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

std::string recurrent_unsupported_reason(const forward_problem& p) {
  if (!recurrent_dtypes::contains(p.dtype)) return "the recurrent kernel takes bf16 and fp16";
  if (!recurrent_head_dims::contains(p.q.dim) || p.v.dim != p.q.dim) {
    return "the recurrent kernel takes K = V in " + recurrent_head_dims::names();
  }
  if (p.q.heads <= 0 || p.v.heads % p.q.heads != 0) return "Hv must be a multiple of Hk";
  if (!aligned_rows(p.q) || !aligned_rows(p.k)) return "q and k rows must be 16-byte aligned (strides multiples of 8)";
  if (reinterpret_cast<uintptr_t>(p.initial_state) % sizeof(float4) != 0) {
    return "initial_state must be 16-byte aligned (the recurrent kernel loads S in float4)";
  }
  return "";
}

cudaError_t launch_recurrent(const forward_problem& p, cudaStream_t stream) {
  if (p.sequences == 0) return cudaSuccess;
  return tk::dispatch<recurrent_dtypes, recurrent_head_dims>(
      [&]<element_type E, int D>() { return run<element_t<E>, D>(p, stream); }, p.dtype, int(p.q.dim));
}

}  // namespace tk::gdn
