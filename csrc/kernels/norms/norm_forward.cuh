// The forward of LayerNorm and RMSNorm (Kind), one templated kernel:
//   h   = dropout(x) + residual          rounded to h's dtype S (x's, or fp32 with an fp32 residual)
//   out = (h - mean) * rstd * weight + bias                       (layer)
//   out = round_T(round_T(h * rstd) * weight)                     (rms)
// Each row is read once into registers (x and the residual), normalised from there with fp32
// statistics (mean first, then the variance about it), and written once (out, and h when asked).
#pragma once

#include "norms.cuh"

namespace tk::norms {

template <typename T, typename S>
struct forward_args {
  int64_t rows;
  int hidden;
  int accesses_per_row;
  int threads_per_row;
  float inv_hidden;
  float eps;
  const T* x;
  int64_t x_stride;
  const S* residual;  // nullptr: none
  int64_t residual_stride;
  const void* weight;
  bool weight_fp32;
  const void* bias;
  bool bias_fp32;
  const int64_t* dropout_seed;  // nullptr: no dropout
  uint64_t keep_threshold;
  float dropout_scale;
  T* out;
  S* h;  // nullptr: not materialised
  float* mean;
  float* rstd;
};

template <norm_kind Kind, typename T, typename S, row_access A>
__global__ void __launch_bounds__(MAX_BLOCK_THREADS, FORWARD_MIN_BLOCKS_PER_SM) norm_forward_kernel(const __grid_constant__ forward_args<T, S> a) {
  constexpr int N = access_shape<T, A>::elements_per_access;
  constexpr int V = access_shape<T, A>::accesses_per_thread;
  constexpr int SUMS_PER_ROW = Kind == norm_kind::layer ? 2 : 1;  // layer: mean, then the variance
  __shared__ float scratch[SUMS_PER_ROW][MAX_WARPS_PER_BLOCK];

  const row_slot place(a.threads_per_row);
  const int64_t row = int64_t(blockIdx.x) * place.rows_per_block + place.slot;
  const bool row_valid = row < a.rows;
  bool active[V];
#pragma unroll
  for (int j = 0; j < V; ++j) active[j] = row_valid && place.access(j) < a.accesses_per_row;

  // Every load of the row is issued before the first use.
  pack<T, N> x_raw[V];
  pack<S, N> residual_raw[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    if (active[j]) x_raw[j] = load_global(reinterpret_cast<const pack<T, N>*>(a.x + row * a.x_stride) + place.access(j));
  }
  if (a.residual != nullptr) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (active[j]) {
        residual_raw[j] =
            load_global(reinterpret_cast<const pack<S, N>*>(a.residual + row * a.residual_stride) + place.access(j));
      }
    }
  }

  // h is kept rounded to S and packed (half the registers of floats for 16-bit streams).
  pack<S, N> h[V];
  const bool dropout = Kind == norm_kind::layer && a.dropout_seed != nullptr;
  const dropout_mask mask = dropout ? dropout_mask(a.dropout_seed, a.keep_threshold) : dropout_mask();
#pragma unroll
  for (int j = 0; j < V; ++j) {
    h[j] = pack<S, N>{};
    if (!active[j]) continue;
    float v[N];
    unpack(x_raw[j], v);
    if constexpr (Kind == norm_kind::layer) {
      if (dropout) {
        const uint64_t first = uint64_t(row) * uint64_t(a.hidden) + uint64_t(place.access(j)) * N;
        // Multiply and add rounded separately (no FMA), as the reference does.
#pragma unroll
        for (int e = 0; e < N; ++e) v[e] = mask.keep(first + e) ? __fmul_rn(v[e], a.dropout_scale) : 0.f;
      }
    }
    if (a.residual != nullptr) {
      float r[N];
      unpack(residual_raw[j], r);
#pragma unroll
      for (int e = 0; e < N; ++e) v[e] = __fadd_rn(v[e], r[e]);
    }
    // The norm reads h as stored (rounded to S), so out is exactly the norm of the h returned.
    h[j] = pack_from<S>(v);
    if (a.h != nullptr) store_global(reinterpret_cast<pack<S, N>*>(a.h + row * a.hidden) + place.access(j), h[j]);
  }

  float mean = 0.f;
  if constexpr (Kind == norm_kind::layer) {
    float sum[1] = {0.f};
#pragma unroll
    for (int j = 0; j < V; ++j) {
      float v[N];
      unpack(h[j], v);
#pragma unroll
      for (int e = 0; e < N; ++e) sum[0] += v[e];
    }
    row_allreduce(sum, scratch[0], a.threads_per_row);
    mean = sum[0] * a.inv_hidden;
    launder(h);
  }
  float squares[1] = {0.f};
#pragma unroll
  for (int j = 0; j < V; ++j) {
    if (!active[j]) continue;  // zeros would add mean^2
    float v[N];
    unpack(h[j], v);
#pragma unroll
    for (int e = 0; e < N; ++e) squares[0] += (v[e] - mean) * (v[e] - mean);
  }
  row_allreduce(squares, scratch[SUMS_PER_ROW - 1], a.threads_per_row);
  const float rstd = rsqrtf(squares[0] * a.inv_hidden + a.eps);
  launder(h);

  if (!row_valid) return;
  if (place.lane == 0) {
    if constexpr (Kind == norm_kind::layer) a.mean[row] = mean;
    a.rstd[row] = rstd;
  }
  // Parameter addresses are formed here, not hoisted above the reductions.
  const int parameter_offset = int(launder_offset(0));
#pragma unroll
  for (int j = 0; j < V; ++j) {
    if (!active[j]) continue;
    const int offset = parameter_offset + place.access(j) * N;
    float v[N], weight[N], y[N];
    unpack(h[j], v);
    load_parameter<T>(a.weight, a.weight_fp32, offset, 1.f, weight);
    if constexpr (Kind == norm_kind::layer) {
      float bias[N];
      load_parameter<T>(a.bias, a.bias_fp32, offset, 0.f, bias);
#pragma unroll
      for (int e = 0; e < N; ++e) y[e] = (v[e] - mean) * rstd * weight[e] + bias[e];
    } else {
      // Llama order: normalise, round to x's dtype, then weight (rounded again on the store).
#pragma unroll
      for (int e = 0; e < N; ++e) y[e] = round_to<T>(v[e] * rstd) * weight[e];
    }
    store_global(reinterpret_cast<pack<T, N>*>(a.out + row * a.hidden) + place.access(j), pack_from<T>(y));
  }
}

template <norm_kind Kind, typename T, typename S, row_access A>
cudaError_t run_forward(const forward_problem& p, const row_plan& plan, cudaStream_t stream) {
  forward_args<T, S> a{};
  a.rows = p.rows;
  a.hidden = int(p.hidden);
  a.accesses_per_row = plan.accesses_per_row;
  a.threads_per_row = plan.threads_per_row;
  a.inv_hidden = float(1.0 / double(p.hidden));
  a.eps = p.eps;
  a.x = static_cast<const T*>(p.x.data);
  a.x_stride = p.x.row_stride;
  a.residual = static_cast<const S*>(p.residual.data);
  a.residual_stride = p.residual.row_stride;
  a.weight = p.weight.data;
  a.weight_fp32 = p.weight.dtype == element_type::fp32;
  a.bias = p.bias.data;
  a.bias_fp32 = p.bias.dtype == element_type::fp32;
  a.dropout_seed = p.dropout_p > 0 ? p.dropout_seed : nullptr;
  a.keep_threshold = keep_threshold(p.dropout_p);
  a.dropout_scale = dropout_scale(p.dropout_p);
  a.out = static_cast<T*>(p.out.data);
  a.h = static_cast<S*>(p.h.data);
  a.mean = p.mean;
  a.rstd = p.rstd;
  return pipeline::launch(norm_forward_kernel<Kind, T, S, A>, unsigned(plan.blocks_for(p.rows)), plan.block_threads(), 0,
                          stream, a);
}

template <norm_kind Kind>
cudaError_t launch_forward_of(const forward_problem& p, const row_plan& plan, cudaStream_t stream) {
  const element_type stream_dtype = p.residual.data != nullptr ? p.residual.dtype : p.x.dtype;
  return with_variant(p.x.dtype, stream_dtype, plan.access, [&]<typename T, typename S, row_access A>() {
    return run_forward<Kind, T, S, A>(p, plan, stream);
  });
}

}  // namespace tk::norms
