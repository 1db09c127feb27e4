// What the chunked causal linear attention backward kernels (Based, generic linear attention) share:
// the per-row statistics kernel, the per-value-block fp32 partials of grad_q / grad_k and the
// kernel that reduces them, the workspace that holds both, and the host-side checks.
//
// Both backwards split v into value-block tasks like their forwards (a family picks the block's
// columns). grad_q and grad_k contract over all of Dv, so with several value blocks each task
// writes its fp32 partial (rows padded to whole chunks) and reduce_kernel sums them over the value
// blocks in a fixed order and converts them to the input dtype: no atomics, bitwise reproducible.
// When one block covers Dv the gradient kernels store grad_q and grad_k themselves: no partials,
// no reduction (their fp32 round trip through HBM cost as much as the gradient kernels). Normalising, statistics_kernel first writes per row
// 1 / d_i and c_i = -(g_i . out_i) / d_i (d_i = denominator_i + eps; zeros on padding rows).
#pragma once

#include <string>
#include <utility>

#include "kernels/common/causal_problem.h"
#include "kernels/common/chunked_causal.cuh"
#include "kernels/common/heads_layout.cuh"
#include "kernels/common/row_dot.cuh"
#include "tk/tk.cuh"

namespace tk::causal_backward {

constexpr int CHUNK = warpgroup::WGMMA_M;  // positions per chunk: the rows of one wgmma
constexpr int VALUE_BLOCK = 32;            // value columns per task, at the least (Dv is a multiple)

// Rows of the workspace's per-row arrays: whole chunks, so kernels read and write them unbounded.
__host__ __device__ inline int64_t padded_rows(int64_t rows) { return round_up<int64_t>(rows, CHUNK); }

// What both gradient kernels of a family read: the partial gradients' and statistics' places in
// the workspace.
template <int FEATURES>
struct gradient_shape {
  int rows, heads, batch, value_blocks;
  int padded;  // padded_rows(rows)
  int gradient_stride;  // elements between rows of grad_q / grad_k: F, or more when F is a column slice
  bool normalize;
  float* partial_q;            // [value block][batch * heads][padded][F]; none with one value block
  float* partial_k;
  const float* inverse_denominator;  // [batch * heads][padded]: 1 / d_i (0 past N); normalised only
  const float* denominator_grad;     // [batch * heads][padded]: c_i (0 past N); normalised only

  __device__ int64_t row_offset(const pipeline::head_block& task) const {
    return (int64_t(task.batch) * heads + task.head) * padded;
  }
  __device__ float* partial(float* base, const pipeline::head_block& task, int row) const {
    return base + ((int64_t(task.block) * batch * heads) * padded + row_offset(task) + row) * FEATURES;
  }

  // The chunk's statistics from `first_row` on: 1 / d and c (1 and 0 unnormalised or, for c, outside
  // value block 0).
  template <typename V>
  __device__ void load_statistics(V& inverse_denominator_rows, V& denominator_grad_rows,
                                  const pipeline::head_block& task, int first_row, bool carries_delta) const {
    if (normalize) {
      warp::load(inverse_denominator_rows, inverse_denominator + row_offset(task) + first_row);
    } else {
      warp::fill(inverse_denominator_rows, 1.0f);
    }
    if (carries_delta) {
      warp::load(denominator_grad_rows, denominator_grad + row_offset(task) + first_row);
    } else {
      warp::zero(denominator_grad_rows);
    }
  }

  // A warp's rows [row, row + 16) of a grad_q / grad_k piece starting at feature `col`: the
  // gradient itself (rows past N dropped) when one value block covers Dv, else this block's partial.
  template <typename T, typename Piece>
  __device__ void store_gradient(float* partials, T* gradient, const pipeline::head_block& task, int row, int col,
                                 const Piece& piece) const {
    if (value_blocks == 1) {
      const int64_t first = (int64_t(task.batch) * heads + task.head) * rows + row;
      warp::store(gradient + first * gradient_stride + col, gradient_stride, piece, rows - row);
    } else {
      warp::store(partial(partials, task, row) + col, FEATURES, piece);
    }
  }
};

// --------------------------------------------------------------------------------- statistics

constexpr int STATISTICS_THREADS = 256;
constexpr int STATISTICS_LANES_PER_ROW = 8;

template <typename T>
struct statistics_params {
  const T* out;
  const T* grad_out;
  int64_t out_strides[3];  // batch, head, row (elements)
  int64_t grad_out_strides[3];
  const float* denominator;  // (B, H, N)
  float* inverse_denominator;
  float* denominator_grad;
  float eps;
  int rows, heads, dim, padded;
  int64_t total_rows;  // B * H * padded
};

// Per row: 1 / d and c = -(g . out) / d; zeros on the padding rows.
template <typename T>
__global__ void __launch_bounds__(STATISTICS_THREADS) statistics_kernel(const statistics_params<T> p) {
  const statistics_row r = statistics_row_dot<STATISTICS_LANES_PER_ROW, STATISTICS_THREADS>(
      p.out, p.out_strides, p.grad_out, p.grad_out_strides, p.heads, p.rows, p.padded, p.total_rows, p.dim);
  if (r.lane_in_row != 0 || r.row >= p.total_rows) return;
  float inverse = 0.0f;
  if (r.real) inverse = 1.0f / (p.denominator[r.head_row * p.rows + r.i] + p.eps);
  p.inverse_denominator[r.row] = inverse;
  p.denominator_grad[r.row] = -r.dot * inverse;
}

// ------------------------------------------------------------------------------------- reduce

// grad_q and grad_k are summed over the value blocks (grad_v is not): their fp32 partials, and the
// per-row statistics 1/d and -(g . out)/d, are what the workspace holds.
constexpr int SUMMED_GRADIENTS = 2;
constexpr int ROW_STATISTICS = 2;
constexpr int REDUCE_THREADS = 256;
constexpr int REDUCE_FEATURES_PER_THREAD = 4;  // one float4 of a partial row

template <typename T>
struct reduce_params {
  const float* partial_q;  // [value block][B * H][padded][F]
  const float* partial_k;
  T* grad_q;  // (B * H * N, F)
  T* grad_k;
  int rows, padded, value_blocks;
  int64_t head_rows;  // B * H
};

// grad_q and grad_k: the sum over value blocks of the partials, in the input dtype.
template <typename T, int FEATURES>
__global__ void __launch_bounds__(REDUCE_THREADS) reduce_kernel(const reduce_params<T> p) {
  constexpr int REDUCE_THREADS_PER_ROW = FEATURES / REDUCE_FEATURES_PER_THREAD;
  const int64_t item = int64_t(blockIdx.x) * REDUCE_THREADS + threadIdx.x;
  const int64_t per_gradient = p.head_rows * p.rows * REDUCE_THREADS_PER_ROW;
  if (item >= SUMMED_GRADIENTS * per_gradient) return;
  const bool is_k = item >= per_gradient;
  const int64_t within = is_k ? item - per_gradient : item;
  const int64_t out_row = within / REDUCE_THREADS_PER_ROW;  // (batch * H + head) * N + i
  const int part = int(within % REDUCE_THREADS_PER_ROW);
  const int64_t head_row = out_row / p.rows;
  const int64_t padded_row = head_row * p.padded + out_row % p.rows;
  const int64_t block_stride = p.head_rows * p.padded * FEATURES;
  const float* src = (is_k ? p.partial_k : p.partial_q) + padded_row * FEATURES + part * REDUCE_FEATURES_PER_THREAD;
  float4 sum = *reinterpret_cast<const float4*>(src);
  for (int b = 1; b < p.value_blocks; ++b) {
    const float4 x = *reinterpret_cast<const float4*>(src + b * block_stride);
    sum.x += x.x;
    sum.y += x.y;
    sum.z += x.z;
    sum.w += x.w;
  }
  using pair = packed_pair_t<T>;
  pair* dst = reinterpret_cast<pair*>((is_k ? p.grad_k : p.grad_q) + out_row * FEATURES + part * REDUCE_FEATURES_PER_THREAD);
  dst[0] = numeric<T>::pair_from_float2({sum.x, sum.y});
  dst[1] = numeric<T>::pair_from_float2({sum.z, sum.w});
}

// ----------------------------------------------------------------------------------- host

struct workspace_view {
  float* partial_q;
  float* partial_k;
  float* inverse_denominator;  // normalised only
  float* denominator_grad;
};

inline int64_t value_blocks(int64_t value_dim, int value_block) { return ceil_div<int64_t>(value_dim, value_block); }

// One gradient's partials: none when one value block covers Dv.
inline int64_t partial_floats(int64_t head_rows, int64_t rows, int64_t value_dim, int features, int value_block) {
  const int64_t blocks = value_blocks(value_dim, value_block);
  return blocks == 1 ? 0 : blocks * head_rows * padded_rows(rows) * features;
}

// Floats of workspace a backward with this feature dim and value block needs.
inline int64_t workspace_floats(int64_t batch, int64_t heads, int64_t rows, int64_t value_dim, int features,
                                bool normalize, int value_block) {
  const int64_t head_rows = batch * heads;
  const int64_t statistics = normalize ? ROW_STATISTICS * head_rows * padded_rows(rows) : 0;
  return SUMMED_GRADIENTS * partial_floats(head_rows, rows, value_dim, features, value_block) + statistics;
}

inline workspace_view split_workspace(const causal_backward_problem& pr, int value_block) {
  const int64_t head_rows = pr.q.batch * pr.q.heads;
  const int64_t partial = partial_floats(head_rows, pr.q.rows, pr.v.dim, int(pr.q.dim), value_block);
  const int64_t statistics = head_rows * padded_rows(pr.q.rows);
  float* w = pr.workspace;
  float* statistics_start = w + SUMMED_GRADIENTS * partial;
  return {w, w + partial, pr.normalize ? statistics_start : nullptr,
          pr.normalize ? statistics_start + statistics : nullptr};
}

template <int FEATURES>
gradient_shape<FEATURES> shape_of(const causal_backward_problem& pr, const workspace_view& w, int value_block) {
  gradient_shape<FEATURES> s;
  s.rows = int(pr.q.rows);
  s.heads = int(pr.q.heads);
  s.batch = int(pr.q.batch);
  s.value_blocks = int(value_blocks(pr.v.dim, value_block));
  s.padded = int(padded_rows(pr.q.rows));
  s.gradient_stride = FEATURES;
  s.normalize = pr.normalize;
  s.partial_q = w.partial_q;
  s.partial_k = w.partial_k;
  s.inverse_denominator = w.inverse_denominator;
  s.denominator_grad = w.denominator_grad;
  return s;
}

// Why the backward cannot take grad_out, out and the denominator (q, k, v are the family's check).
inline std::string inputs_reason(const causal_backward_problem& p) {
  for (const heads_view* t : {&p.grad_out, &p.out}) {
    if (t == &p.out && !p.normalize) continue;
    if (t->batch != p.v.batch || t->heads != p.v.heads || t->rows != p.v.rows || t->dim != p.v.dim) {
      return "grad_out and out must have v's shape";
    }
  }
  if (p.normalize && p.denominator == nullptr) return "the normalised backward needs the denominator";
  return {};
}

inline heads_view grad_v_view(const causal_backward_problem& pr) {
  return contiguous_view(pr.grad_v, pr.v.batch, pr.v.heads, pr.v.rows, pr.v.dim);
}

// Why TMA cannot move the tiles (QkTile of q and k, ValueTile of v, grad_out, grad_v and, read
// with 16-byte loads when normalising, out: the same alignment rules).
template <typename QkTile, typename ValueTile, typename T>
std::string layout_reasons(const causal_backward_problem& pr) {
  for (const auto& [name, view] : {std::pair{"q", pr.q}, std::pair{"k", pr.k}}) {
    if (std::string r = layout_reason<QkTile, T>(name, view); !r.empty()) return r;
  }
  for (const auto& [name, view] :
       {std::pair{"v", pr.v}, std::pair{"grad_out", pr.grad_out}, std::pair{"grad_v", grad_v_view(pr)}}) {
    if (std::string r = layout_reason<ValueTile, T>(name, view); !r.empty()) return r;
  }
  if (pr.normalize) return layout_reason<ValueTile, T>("out", pr.out);
  return {};
}

template <typename T>
cudaError_t run_statistics(const causal_backward_problem& pr, const workspace_view& w, cudaStream_t stream) {
  statistics_params<T> p;
  p.out = static_cast<const T*>(pr.out.data);
  p.grad_out = static_cast<const T*>(pr.grad_out.data);
  copy_strides(p.out_strides, pr.out);
  copy_strides(p.grad_out_strides, pr.grad_out);
  p.denominator = pr.denominator;
  p.inverse_denominator = w.inverse_denominator;
  p.denominator_grad = w.denominator_grad;
  p.eps = pr.eps;
  p.rows = int(pr.q.rows);
  p.heads = int(pr.q.heads);
  p.dim = int(pr.v.dim);
  p.padded = int(padded_rows(pr.q.rows));
  p.total_rows = pr.q.batch * pr.q.heads * p.padded;
  constexpr int64_t rows_per_block = STATISTICS_THREADS / STATISTICS_LANES_PER_ROW;
  const unsigned blocks = unsigned(ceil_div(p.total_rows, rows_per_block));
  return pipeline::launch(statistics_kernel<T>, blocks, STATISTICS_THREADS, 0, stream, p);
}

template <typename T, int FEATURES>
cudaError_t run_reduce(const causal_backward_problem& pr, const workspace_view& w, int value_block,
                       cudaStream_t stream) {
  reduce_params<T> p;
  p.partial_q = w.partial_q;
  p.partial_k = w.partial_k;
  p.grad_q = static_cast<T*>(pr.grad_q);
  p.grad_k = static_cast<T*>(pr.grad_k);
  p.rows = int(pr.q.rows);
  p.padded = int(padded_rows(pr.q.rows));
  p.value_blocks = int(value_blocks(pr.v.dim, value_block));
  p.head_rows = pr.q.batch * pr.q.heads;
  const int64_t items = SUMMED_GRADIENTS * p.head_rows * p.rows * (FEATURES / REDUCE_FEATURES_PER_THREAD);
  const unsigned blocks = unsigned(ceil_div<int64_t>(items, REDUCE_THREADS));
  return pipeline::launch(reduce_kernel<T, FEATURES>, blocks, REDUCE_THREADS, 0, stream, p);
}

// The whole backward: statistics (normalised only), the two gradient kernels (RunGradients
// launches them), then the reduction (with several value blocks).
template <typename T, int FEATURES, typename RunGradients>
cudaError_t run(const causal_backward_problem& pr, int value_block, cudaStream_t stream,
                RunGradients&& run_gradients) {
  const workspace_view w = split_workspace(pr, value_block);
  if (pr.normalize) {
    if (const cudaError_t err = run_statistics<T>(pr, w, stream); err != cudaSuccess) return err;
  }
  if (const cudaError_t err = run_gradients(w); err != cudaSuccess) return err;
  if (value_blocks(pr.v.dim, value_block) == 1) return cudaSuccess;
  return run_reduce<T, FEATURES>(pr, w, value_block, stream);
}

}  // namespace tk::causal_backward
