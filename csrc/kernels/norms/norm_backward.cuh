// The backward of LayerNorm and RMSNorm (Kind), one templated kernel plus a column reduction:
//   xhat = (h - mean) * rstd  (layer)  or  h * rstd  (rms),   g = grad_out * weight
//   dh   = rstd * (g - mean(g) - xhat * mean(g * xhat)) + grad_h   (rms: without the mean(g) term)
//   grad_residual = dh,  grad_x = dh * keep / (1 - p)  (layer dropout; else dh)
//   grad_weight = sum over rows of grad_out * xhat (rms: round_T(xhat)),  grad_bias = sum of grad_out
// A persistent grid walks the rows; each row is read once (h, grad_out, grad_h kept packed in
// registers), and the parameter gradients are summed in two deterministic stages: every thread
// adds its columns' terms into its own slice of shared memory (registers stay free for the rows
// in flight), each block then writes one fp32 partial row to the workspace, and a small kernel
// sums the partial rows column by column.
#pragma once

#include "norms.cuh"

namespace tk::norms {

template <typename T, typename S>
struct backward_args {
  int64_t rows;
  int hidden;
  int accesses_per_row;
  int threads_per_row;
  float inv_hidden;
  const T* grad_out;
  int64_t grad_out_stride;
  const S* grad_h;  // nullptr: none
  int64_t grad_h_stride;
  const S* h;
  int64_t h_stride;
  const void* weight;
  bool weight_fp32;
  const float* mean;
  const float* rstd;
  const int64_t* dropout_seed;  // nullptr: no dropout
  uint64_t keep_threshold;
  float dropout_scale;
  T* grad_x;          // nullptr: not wanted
  S* grad_residual;   // nullptr: not wanted
  float* partial_weight;  // gridDim.x rows of `hidden`; nullptr: not wanted
  float* partial_bias;
};

// The per-thread sums of the parameter gradients live in shared memory (registers stay free for
// the rows in flight): chunk c of thread t at c * MAX_BLOCK_THREADS + t, so consecutive threads
// touch consecutive addresses (no bank conflicts) and the stride is a compile-time constant.
template <typename T, row_access A>
struct accumulator_layout {
  static constexpr int elements_per_access = access_shape<T, A>::elements_per_access;
  static constexpr int width = elements_per_access >= 4 ? 4 : 1;  // floats per shared-memory access
  static_assert(elements_per_access % width == 0, "an access holds whole chunks");
  static constexpr int chunks_per_access = elements_per_access / width;
  static constexpr int chunks = access_shape<T, A>::accesses_per_thread * chunks_per_access;
  struct alignas(sizeof(float) * width) chunk {
    float v[width];
  };
};

template <norm_kind Kind, typename T, typename S, row_access A>
__global__ void __launch_bounds__(MAX_BLOCK_THREADS, BACKWARD_MIN_BLOCKS_PER_SM) norm_backward_kernel(const __grid_constant__ backward_args<T, S> a) {
  constexpr int N = access_shape<T, A>::elements_per_access;
  constexpr int V = access_shape<T, A>::accesses_per_thread;
  using layout = accumulator_layout<T, A>;
  using chunk = typename layout::chunk;
  constexpr int W = layout::width;
  constexpr int SUMS = 2;  // sum(g), sum(g * xhat)
  extern __shared__ float accumulators[];
  __shared__ float scratch[2][MAX_WARPS_PER_BLOCK * SUMS];  // alternated between rows: one barrier each

  const row_slot place(a.threads_per_row);
  const bool sum_weight = a.partial_weight != nullptr;
  const bool sum_bias = Kind == norm_kind::layer && a.partial_bias != nullptr;
  chunk* weight_sums = reinterpret_cast<chunk*>(accumulators);
  chunk* bias_sums = weight_sums + (sum_weight ? layout::chunks * MAX_BLOCK_THREADS : 0);
#pragma unroll
  for (int c = 0; c < layout::chunks; ++c) {
    if (sum_weight) weight_sums[c * MAX_BLOCK_THREADS + threadIdx.x] = chunk{};
    if (sum_bias) bias_sums[c * MAX_BLOCK_THREADS + threadIdx.x] = chunk{};
  }
  const bool dropout = Kind == norm_kind::layer && a.dropout_seed != nullptr;
  const dropout_mask mask = dropout ? dropout_mask(a.dropout_seed, a.keep_threshold) : dropout_mask();

  int parity = 0;
  for (int64_t group = blockIdx.x; group * place.rows_per_block < a.rows; group += gridDim.x, parity ^= 1) {
    const int64_t row = group * place.rows_per_block + place.slot;
    const bool row_valid = row < a.rows;
    bool active[V];
#pragma unroll
    for (int j = 0; j < V; ++j) active[j] = row_valid && place.access(j) < a.accesses_per_row;

    // Both passes skip inactive accesses (past the row's end, or of a row past the last); their
    // packs are zeroed only so that the launder below reads defined values.
    pack<T, N> grad_out_raw[V];
    pack<S, N> h_raw[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      grad_out_raw[j] = pack<T, N>{};
      h_raw[j] = pack<S, N>{};
      if (!active[j]) continue;
      grad_out_raw[j] =
          load_global(reinterpret_cast<const pack<T, N>*>(a.grad_out + row * a.grad_out_stride) + place.access(j));
      h_raw[j] = load_global(reinterpret_cast<const pack<S, N>*>(a.h + row * a.h_stride) + place.access(j));
    }
    const float mean = Kind == norm_kind::layer && row_valid ? a.mean[row] : 0.f;
    const float rstd = row_valid ? a.rstd[row] : 0.f;
    auto xhat = [&](int j, int e) { return (element(h_raw[j], e) - mean) * rstd; };

    float sums[SUMS] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < V; ++j) {
      // Past the row's end the weight is not ours to read: whatever follows it in memory may be
      // inf or NaN, and grad_out = 0 times that would make the row's sums, so all of dh, NaN.
      if (!active[j]) continue;
      float weight[N], grad_out[N], weighted[N];
      load_parameter<T>(a.weight, a.weight_fp32, place.access(j) * N, 1.f, weight);
#pragma unroll
      for (int e = 0; e < N; ++e) {
        grad_out[e] = element(grad_out_raw[j], e);
        const float normed = xhat(j, e);
        const float g = grad_out[e] * weight[e];
        sums[0] += g;
        sums[1] += g * normed;
        weighted[e] = Kind == norm_kind::layer ? normed : round_to<T>(normed);
      }
#pragma unroll
      for (int c = 0; c < layout::chunks_per_access; ++c) {
        const int at = (j * layout::chunks_per_access + c) * MAX_BLOCK_THREADS + int(threadIdx.x);
        if (sum_weight) {
          chunk s = weight_sums[at];
#pragma unroll
          for (int i = 0; i < W; ++i) s.v[i] += grad_out[c * W + i] * weighted[c * W + i];
          weight_sums[at] = s;
        }
        if (sum_bias) {
          chunk s = bias_sums[at];
#pragma unroll
          for (int i = 0; i < W; ++i) s.v[i] += grad_out[c * W + i];
          bias_sums[at] = s;
        }
      }
    }
    row_allreduce(sums, scratch[parity], a.threads_per_row);
    const float mean_g = Kind == norm_kind::layer ? sums[0] * a.inv_hidden : 0.f;
    const float mean_gx = sums[1] * a.inv_hidden;
    launder(grad_out_raw);
    launder(h_raw);
    // Addresses of the second pass are formed here, not kept in registers across the reduction.
    const int64_t weight_offset = launder_offset(0);
    const int64_t output_offset = launder_offset(row * a.hidden);
    const int64_t grad_h_offset = launder_offset(row * a.grad_h_stride);

#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (!active[j]) continue;
      float weight[N], grad_h[N], dh[N];
      load_parameter<T>(a.weight, a.weight_fp32, int(weight_offset) + place.access(j) * N, 1.f, weight);
      // grad_h is read only now: the registers before the reduction hold h and grad_out alone.
      if (a.grad_h != nullptr) {
        unpack(load_global(reinterpret_cast<const pack<S, N>*>(a.grad_h + grad_h_offset) + place.access(j)), grad_h);
      } else {
#pragma unroll
        for (int e = 0; e < N; ++e) grad_h[e] = 0.f;
      }
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const float g = element(grad_out_raw[j], e) * weight[e];
        dh[e] = rstd * (g - mean_g - xhat(j, e) * mean_gx) + grad_h[e];
      }
      if (a.grad_residual != nullptr) {
        store_global(reinterpret_cast<pack<S, N>*>(a.grad_residual + output_offset) + place.access(j), pack_from<S>(dh));
      }
      if (a.grad_x != nullptr) {
        if (dropout) {
          const uint64_t first = uint64_t(row) * uint64_t(a.hidden) + uint64_t(place.access(j)) * N;
#pragma unroll
          for (int e = 0; e < N; ++e) dh[e] = mask.keep(first + e) ? dh[e] * a.dropout_scale : 0.f;
        }
        store_global(reinterpret_cast<pack<T, N>*>(a.grad_x + output_offset) + place.access(j), pack_from<T>(dh));
      }
    }
  }

  if (!sum_weight && !sum_bias) return;
  __syncthreads();  // the other row groups' sums are read below
  if (place.slot != 0) return;
  float* partials[2] = {sum_weight ? a.partial_weight : nullptr, sum_bias ? a.partial_bias : nullptr};
  const chunk* sums_of[2] = {weight_sums, bias_sums};
#pragma unroll
  for (int which = 0; which < 2; ++which) {
    if (partials[which] == nullptr) continue;
    float* partial_row = partials[which] + int64_t(blockIdx.x) * a.hidden;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (place.access(j) >= a.accesses_per_row) continue;
#pragma unroll
      for (int c = 0; c < layout::chunks_per_access; ++c) {
        chunk total{};
        for (int slot = 0; slot < place.rows_per_block; ++slot) {
          const chunk s = sums_of[which][(j * layout::chunks_per_access + c) * MAX_BLOCK_THREADS +
                                         slot * a.threads_per_row + place.lane];
#pragma unroll
          for (int i = 0; i < W; ++i) total.v[i] += s.v[i];
        }
#pragma unroll
        for (int i = 0; i < W; ++i) partial_row[place.access(j) * N + c * W + i] = total.v[i];
      }
    }
  }
}

// ------------------------------------------------------------------ stage 2: sum the partial rows

constexpr int REDUCE_COLUMNS = WARP_THREADS;  // one coalesced 128-byte line of a partial row
constexpr int REDUCE_STRIPES = 16;            // threads splitting the partial rows of a column
constexpr int REDUCE_UNROLL = 4;              // independent loads in flight per thread

struct column_sum_target {
  const float* partials;
  void* out;  // `hidden` elements
  bool out_fp32;
};

struct column_sum_args {
  column_sum_target target[2];  // blockIdx.y picks one
  int partial_rows;
  int hidden;
};

template <typename T>
__global__ void __launch_bounds__(REDUCE_COLUMNS* REDUCE_STRIPES) sum_partial_rows_kernel(const __grid_constant__ column_sum_args a) {
  __shared__ float stripe_sums[REDUCE_STRIPES][REDUCE_COLUMNS + 1];
  const column_sum_target& t = a.target[blockIdx.y];
  const int column = int(blockIdx.x) * REDUCE_COLUMNS + int(threadIdx.x);
  float sum = 0.f;
  if (column < a.hidden) {
#pragma unroll REDUCE_UNROLL
    for (int r = int(threadIdx.y); r < a.partial_rows; r += REDUCE_STRIPES) sum += t.partials[int64_t(r) * a.hidden + column];
  }
  stripe_sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || column >= a.hidden) return;
  float total = 0.f;
#pragma unroll
  for (int s = 0; s < REDUCE_STRIPES; ++s) total += stripe_sums[s][threadIdx.x];
  if (t.out_fp32) {
    static_cast<float*>(t.out)[column] = total;
  } else {
    static_cast<T*>(t.out)[column] = numeric<T>::from_float(total);
  }
}

// ------------------------------------------------------------------------------------- host side

template <typename T, row_access A>
size_t accumulator_bytes(const backward_problem& p, const row_plan& plan) {
  const int arrays = (p.grad_weight.data != nullptr ? 1 : 0) + (p.grad_bias.data != nullptr ? 1 : 0);
  return size_t(arrays) * accumulator_layout<T, A>::chunks * MAX_BLOCK_THREADS * sizeof(typename accumulator_layout<T, A>::chunk);
}

// The persistent grid: as many blocks as fit on the GPU at once, at most one per row group.
template <norm_kind Kind, typename T, typename S, row_access A>
int64_t backward_blocks(const backward_problem& p, const row_plan& plan, int device) {
  const auto kernel = norm_backward_kernel<Kind, T, S, A>;
  const size_t shared_bytes = accumulator_bytes<T, A>(p, plan);
  if (pipeline::allow_shared_bytes(reinterpret_cast<const void*>(kernel), shared_bytes) != cudaSuccess) return 0;
  int per_sm = 0;
  if (pipeline::resident_blocks_per_sm(&per_sm, kernel, plan.block_threads(), shared_bytes) != cudaSuccess) {
    return 0;
  }
  return std::min<int64_t>(plan.blocks_for(p.rows), int64_t(per_sm) * pipeline::sm_count(device));
}

template <norm_kind Kind, typename T, typename S, row_access A>
cudaError_t run_backward(const backward_problem& p, const row_plan& plan, cudaStream_t stream) {
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  const int64_t blocks = backward_blocks<Kind, T, S, A>(p, plan, device);
  if (blocks < 1) return cudaErrorInvalidConfiguration;
  const bool sum_weight = p.grad_weight.data != nullptr;
  const bool sum_bias = Kind == norm_kind::layer && p.grad_bias.data != nullptr;
  backward_args<T, S> a{};
  a.rows = p.rows;
  a.hidden = int(p.hidden);
  a.accesses_per_row = plan.accesses_per_row;
  a.threads_per_row = plan.threads_per_row;
  a.inv_hidden = float(1.0 / double(p.hidden));
  a.grad_out = static_cast<const T*>(p.grad_out.data);
  a.grad_out_stride = p.grad_out.row_stride;
  a.grad_h = static_cast<const S*>(p.grad_h.data);
  a.grad_h_stride = p.grad_h.row_stride;
  a.h = static_cast<const S*>(p.h.data);
  a.h_stride = p.h.row_stride;
  a.weight = p.weight.data;
  a.weight_fp32 = p.weight.dtype == element_type::fp32;
  a.mean = p.mean;
  a.rstd = p.rstd;
  a.dropout_seed = p.dropout_p > 0 ? p.dropout_seed : nullptr;
  a.keep_threshold = keep_threshold(p.dropout_p);
  a.dropout_scale = dropout_scale(p.dropout_p);
  a.grad_x = static_cast<T*>(p.grad_x.data);
  a.grad_residual = static_cast<S*>(p.grad_residual.data);
  a.partial_weight = sum_weight ? p.workspace : nullptr;
  a.partial_bias = sum_bias ? p.workspace + (sum_weight ? blocks * p.hidden : 0) : nullptr;
  if (const cudaError_t err = pipeline::launch(norm_backward_kernel<Kind, T, S, A>, unsigned(blocks), plan.block_threads(),
                                               accumulator_bytes<T, A>(p, plan), stream, a);
      err != cudaSuccess || (!sum_weight && !sum_bias)) {
    return err;
  }

  column_sum_args sums{};
  int targets = 0;
  if (sum_weight) sums.target[targets++] = {a.partial_weight, p.grad_weight.data, p.grad_weight.dtype == element_type::fp32};
  if (sum_bias) sums.target[targets++] = {a.partial_bias, p.grad_bias.data, p.grad_bias.dtype == element_type::fp32};
  sums.partial_rows = int(blocks);
  sums.hidden = int(p.hidden);
  const dim3 grid(unsigned(ceil_div<int64_t>(p.hidden, REDUCE_COLUMNS)), unsigned(targets));
  return pipeline::launch(sum_partial_rows_kernel<T>, grid, dim3(REDUCE_COLUMNS, REDUCE_STRIPES), 0, stream, sums);
}

template <norm_kind Kind>
cudaError_t launch_backward_of(const backward_problem& p, const row_plan& plan, cudaStream_t stream) {
  return with_variant(p.grad_out.dtype, p.h.dtype, plan.access, [&]<typename T, typename S, row_access A>() {
    return run_backward<Kind, T, S, A>(p, plan, stream);
  });
}

template <norm_kind Kind>
int64_t backward_blocks_of(const backward_problem& p, const row_plan& plan, int device) {
  return with_variant(p.grad_out.dtype, p.h.dtype, plan.access, [&]<typename T, typename S, row_access A>() {
    return backward_blocks<Kind, T, S, A>(p, plan, device);
  });
}

}  // namespace tk::norms
