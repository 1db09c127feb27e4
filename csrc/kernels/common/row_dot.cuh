// The per-row dot product g . o that the backward statistics kernels compute (attention's delta, the
// causal linear attentions' grad_out . out): LANES lanes share a row, each reads 16-byte chunks of
// 8 elements and sums their products in fp32, and a butterfly of shuffles gives every lane the sum.
#pragma once

#include "tk/tk.cuh"

namespace tk {

constexpr int ROW_DOT_CHUNK_ELEMENTS = 8;  // one 16-byte load of 16-bit elements

// sum_e a[e] * b[e] over one 16-byte chunk, in fp32.
template <typename T>
__device__ __forceinline__ float chunk_dot(const T* a, const T* b) {
  const uint4 x = *reinterpret_cast<const uint4*>(a);
  const uint4 y = *reinterpret_cast<const uint4*>(b);
  const uint32_t xs[4] = {x.x, x.y, x.z, x.w};
  const uint32_t ys[4] = {y.x, y.y, y.z, y.w};
  float dot = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 u = to_float2(pair_from_bits<packed_pair_t<T>>(xs[i]));
    const float2 w = to_float2(pair_from_bits<packed_pair_t<T>>(ys[i]));
    dot = fmaf(u.x, w.x, fmaf(u.y, w.y, dot));
  }
  return dot;
}

// This lane's share of a . b over `dim` elements (a multiple of 8, rows 16-byte aligned): chunks
// lane_in_row, lane_in_row + LANES, ...
template <int LANES, typename T>
__device__ __forceinline__ float lane_dot(const T* a, const T* b, int dim, int lane_in_row) {
  float dot = 0.0f;
  for (int c = lane_in_row * ROW_DOT_CHUNK_ELEMENTS; c < dim; c += LANES * ROW_DOT_CHUNK_ELEMENTS) {
    dot += chunk_dot(a + c, b + c);
  }
  return dot;
}

// The row's sum of the LANES lanes' shares, on each of them (LANES adjacent lanes, a power of two).
template <int LANES>
__device__ __forceinline__ float sum_row_lanes(float dot) {
#pragma unroll
  for (int mask = 1; mask < LANES; mask *= 2) dot += __shfl_xor_sync(ALL_LANES, dot, mask);
  return dot;
}

// Where a (batch, head)'s rows lie: the tensors' batch coordinate, its first row and its length
// (a dense batch: batch b from row 0, every sequence as long; packed sequences: batch 0, each its own).
struct row_span {
  int64_t batch;
  int first;
  int rows;
};

// A statistics thread's row: LANES lanes a row, THREADS a block, over B * H heads of `padded`
// rows each (whole chunks; rows at or past the span's length are padding), and the row's g . o on
// every lane.
struct statistics_row {
  int64_t row;       // the padded row: (batch * H + head) * padded + i
  int64_t head_row;  // batch * H + head
  row_span span;     // where the row's sequence lies (span_of(batch, i))
  int64_t head;
  int i;             // the position in the sequence
  int lane_in_row;
  bool real;         // a position of the sequence (not padding, not past the last head)
  float dot;         // out_i . grad_out_i (0 when not real)
};

// span_of(batch, i) -> row_span: where the sequence of position i of `batch`'s padded rows lies (its
// first row `first + i` in the tensors when i < rows).
template <int LANES, int THREADS, typename T, typename SpanOf>
__device__ __forceinline__ statistics_row statistics_row_dot(const T* out, const int64_t (&out_strides)[3],
                                                             const T* grad_out, const int64_t (&grad_out_strides)[3],
                                                             int heads, int padded, int64_t total_rows, int dim,
                                                             SpanOf&& span_of) {
  statistics_row r;
  r.row = int64_t(blockIdx.x) * (THREADS / LANES) + threadIdx.x / LANES;
  r.lane_in_row = threadIdx.x % LANES;
  r.head_row = r.row / padded;
  r.head = r.head_row % heads;
  r.i = int(r.row % padded);
  r.span = r.row < total_rows ? span_of(r.head_row / heads, r.i) : row_span{0, 0, 0};
  r.real = r.row < total_rows && r.i < r.span.rows;
  float dot = 0.0f;
  if (r.real) {
    const int64_t at = r.span.first + r.i;
    const T* o = out + r.span.batch * out_strides[0] + r.head * out_strides[1] + at * out_strides[2];
    const T* g = grad_out + r.span.batch * grad_out_strides[0] + r.head * grad_out_strides[1] + at * grad_out_strides[2];
    dot = lane_dot<LANES>(o, g, dim, r.lane_in_row);
  }
  r.dot = sum_row_lanes<LANES>(dot);
  return r;
}

// A dense batch of `rows` rows a sequence.
template <int LANES, int THREADS, typename T>
__device__ __forceinline__ statistics_row statistics_row_dot(const T* out, const int64_t (&out_strides)[3],
                                                             const T* grad_out, const int64_t (&grad_out_strides)[3],
                                                             int heads, int rows, int padded, int64_t total_rows,
                                                             int dim) {
  return statistics_row_dot<LANES, THREADS>(out, out_strides, grad_out, grad_out_strides, heads, padded, total_rows, dim,
                                            [rows](int64_t batch, int) { return row_span{batch, 0, rows}; });
}

}  // namespace tk
