// The causal conv1d forward, out = act(bias + sum_s weight[:, s] * x[t - (W - 1) + s]), on both
// layouts (causal_conv1d.cuh has the plans), and its launcher.
#include "causal_conv1d.cuh"

namespace tk::causal_conv1d {

template <typename T, int W, bool SILU, bool VECTORISED>
__global__ void __launch_bounds__(channel_first_plan::block_threads, channel_first_plan::forward_min_blocks)
    channel_first_forward_kernel(const __grid_constant__ forward_params<T> p) {
  using plan = channel_first_plan;
  constexpr int N = plan::elements<T>;
  constexpr int HALO = W - 1;
  constexpr access A = VECTORISED ? access::vectors_and_tails : access::elements;
  const int64_t item_index = int64_t(blockIdx.x) * plan::warps + warp_id();
  if (item_index >= p.grid.items) return;  // the whole warp: no shuffle is left with missing lanes
  const channel_first_item<T> item(p.grid, item_index, p.dim);
  const int lane = lane_id();
  const T* x = p.x.at(item.b, item.d, 0);
  T* out = p.out.at(item.b, item.d, 0);

  elements<T, N> raw[plan::steps];
#pragma unroll
  for (int k = 0; k < plan::steps; ++k) {
    const int64_t t0 = item.position(k, lane);
    raw[k] = load<A, T, N>(x + t0, valid_count<N>(t0, p.seq_len));
  }
  float before[HALO];
  load_run(before, x, item.start - HALO, p.seq_len);
  float taps[W];
#pragma unroll
  for (int s = 0; s < W; ++s) taps[s] = parameter_at<T>(p.params.weight, p.params.weight_fp32, item.d * W + s);
  const float bias = p.params.bias != nullptr ? parameter_at<T>(p.params.bias, p.params.bias_fp32, item.d) : 0.0f;

#pragma unroll
  for (int k = 0; k < plan::steps; ++k) {
    float halo[HALO];
    halo_before<W>(halo, raw, before, k);
    float window[HALO + N];  // x[t0 - (W - 1) + i]
#pragma unroll
    for (int i = 0; i < HALO; ++i) window[i] = halo[i];
#pragma unroll
    for (int e = 0; e < N; ++e) window[HALO + e] = raw[k][e];
    float y[N];
#pragma unroll
    for (int e = 0; e < N; ++e) {
      float pre = bias;
#pragma unroll
      for (int s = 0; s < W; ++s) pre = fmaf(taps[s], window[e + s], pre);
      y[e] = SILU ? silu(pre) : pre;
    }
    const int64_t t0 = item.position(k, lane);
    store<A>(out + t0, rounded<T>(y), valid_count<N>(t0, p.seq_len));
  }
}

template <typename T, int W, bool SILU, bool VECTORISED>
__global__ void __launch_bounds__(channel_last_plan::block_threads, channel_last_plan::forward_min_blocks)
    channel_last_forward_kernel(const __grid_constant__ forward_params<T> p) {
  using plan = channel_last_plan;
  constexpr int N = plan::channels;
  constexpr int HALO = W - 1;
  constexpr int IN_FLIGHT = plan::steps_for<T>(plan::forward_in_flight_bytes);
  constexpr access A = VECTORISED ? access::vectors : access::elements;
  const int lane = lane_id();
  for_each_tile_share(p.grid.ranges, [&](int64_t tile, int64_t first, int64_t last) {
    const int64_t c0 = tile * plan::tile_channels + lane * N;
    const int count = valid_count<N>(c0, p.dim);
    float taps[N][W], bias[N];
    load_channel_parameters<T>(p.params, c0, count, taps, bias);
    for_each_walk(p.grid.ranges, tile, first, last, p.seq_len, [&](int64_t b, int64_t t_begin, int64_t t_end) {
      const T* x = p.x.at(b, 0, 0) + c0;
      T* out = p.out.at(b, 0, 0) + c0;
      float history[HALO][N];  // x[t - (W - 1) + s] for s < W - 1, before step t
#pragma unroll
      for (int s = 0; s < HALO; ++s) {
        const int64_t t = t_begin - HALO + s;
        const elements<T, N> raw = t >= 0 ? load<A, T, N>(x + t * p.x.time_stride, count) : elements<T, N>{};
#pragma unroll
        for (int e = 0; e < N; ++e) history[s][e] = raw[e];
      }
      for (int64_t t = t_begin; t < t_end; t += IN_FLIGHT) {
        elements<T, N> raw[IN_FLIGHT];
#pragma unroll
        for (int u = 0; u < IN_FLIGHT; ++u) {
          raw[u] = t + u < t_end ? load<A, T, N>(x + (t + u) * p.x.time_stride, count) : elements<T, N>{};
        }
#pragma unroll
        for (int u = 0; u < IN_FLIGHT; ++u) {
          if (t + u >= t_end) continue;  // the walk's last positions
          float current[N], y[N];
#pragma unroll
          for (int e = 0; e < N; ++e) {
            current[e] = raw[u][e];
            float pre = fmaf(taps[e][HALO], current[e], bias[e]);
#pragma unroll
            for (int s = 0; s < HALO; ++s) pre = fmaf(taps[e][s], history[s][e], pre);
            y[e] = SILU ? silu(pre) : pre;
          }
          push<W>(history, current);
          store<A>(out + (t + u) * p.out.time_stride, rounded<T>(y), count);
        }
      }
    });
  });
}

namespace {

template <typename T, int W, bool SILU, bool VECTORISED, layout KIND>
cudaError_t run_forward(const forward_problem& problem, cudaStream_t stream) {
  forward_params<T> p{};
  p.dim = problem.size.dim;
  p.seq_len = problem.size.seq_len;
  p.x = input_of<T>(problem.x);
  p.out = output_of<T>(problem.out);
  p.params = parameters_of(problem.weight, problem.bias);
  if constexpr (KIND == layout::channel_first) {
    p.grid = channel_first_work(problem.size, problem.dtype);
    const auto kernel = channel_first_forward_kernel<T, W, SILU, VECTORISED>;
    const int64_t blocks = ceil_div<int64_t>(p.grid.items, channel_first_plan::warps);
    return pipeline::launch(kernel, unsigned(blocks), channel_first_plan::block_threads, 0, stream, p);
  } else {
    const auto kernel = channel_last_forward_kernel<T, W, SILU, VECTORISED>;
    if (const cudaError_t err = channel_last_ranges(kernel, problem.size, p.grid.ranges); err != cudaSuccess) return err;
    return pipeline::launch(kernel, unsigned(p.grid.ranges.blocks), channel_last_plan::block_threads, 0, stream, p);
  }
}

}  // namespace

std::string unsupported_reason(const forward_problem& p) {
  return common_reason(p.dtype, p.size, p.weight, p.bias, p.x, p.out);
}

cudaError_t launch_forward(const forward_problem& p, cudaStream_t stream) {
  if (!unsupported_reason(p).empty()) return cudaErrorInvalidValue;
  const launch_plan plan = plan_launch(p.dtype, p.size, p.x, p.out);
  return dispatch<dtypes, widths, flags, flags, flags>(
      [&]<element_type E, int W, bool SILU, bool VECTORISED, bool CHANNEL_LAST>() {
        constexpr layout kind = CHANNEL_LAST ? layout::channel_last : layout::channel_first;
        return run_forward<element_t<E>, W, SILU, VECTORISED, kind>(p, stream);
      },
      p.dtype, p.size.width, p.silu, plan.vectorised, plan.kind == layout::channel_last);
}

}  // namespace tk::causal_conv1d
