// The causal conv1d backward on both layouts (causal_conv1d.cuh has the plans), the deterministic sum
// of its partial parameter gradients, and the launcher:
//   g = grad * silu'(pre), pre recomputed from x (or g = grad without the SiLU)
//   grad_x[u] = sum_s weight[s] * g[u + (W - 1) - s]        (g = 0 at t >= L)
//   grad_weight[s] += g[t] * x[t - (W - 1) + s],  grad_bias += g[t]
#include "causal_conv1d.cuh"

namespace tk::causal_conv1d {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = WARP_THREADS / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(ALL_LANES, v, offset);
  return v;
}

template <typename T, int W, bool SILU, bool VECTORISED>
__global__ void __launch_bounds__(channel_first_plan::block_threads, channel_first_plan::backward_min_blocks)
    channel_first_backward_kernel(const __grid_constant__ backward_params<T> p) {
  using plan = channel_first_plan;
  constexpr int N = plan::elements<T>;
  constexpr int HALO = W - 1;
  constexpr access A = VECTORISED ? access::vectors_and_tails : access::elements;
  const int64_t item_index = int64_t(blockIdx.x) * plan::warps + warp_id();
  if (item_index >= p.grid.items) return;  // the whole warp: no shuffle is left with missing lanes
  const channel_first_item<T> item(p.grid, item_index, p.dim);
  const int lane = lane_id();
  const T* x = p.x.at(item.b, item.d, 0);
  const T* grad = p.grad.at(item.b, item.d, 0);
  T* grad_x = p.grad_x.at(item.b, item.d, 0);

  elements<T, N> raw_x[plan::steps], raw_grad[plan::steps];
#pragma unroll
  for (int k = 0; k < plan::steps; ++k) {
    const int64_t t0 = item.position(k, lane);
    const int count = valid_count<N>(t0, p.seq_len);
    raw_x[k] = load<A, T, N>(x + t0, count);
    raw_grad[k] = load<A, T, N>(grad + t0, count);
  }
  const int64_t end = item.start + plan::segment<T>;
  float x_before[HALO], x_after[HALO], grad_after[HALO];
  load_run(x_before, x, item.start - HALO, p.seq_len);
  load_run(x_after, x, end, p.seq_len);
  load_run(grad_after, grad, end, p.seq_len);
  float taps[W];
#pragma unroll
  for (int s = 0; s < W; ++s) taps[s] = parameter_at<T>(p.params.weight, p.params.weight_fp32, item.d * W + s);
  const float bias = p.params.bias != nullptr ? parameter_at<T>(p.params.bias, p.params.bias_fp32, item.d) : 0.0f;

  float weight_sums[W] = {}, bias_sum = 0.0f;
#pragma unroll
  for (int k = 0; k < plan::steps; ++k) {
    // x[t0 - (W - 1) + i] and grad[t0 + i], each with the halos of the lanes around.
    float before[HALO], x_next[HALO], grad_next[HALO];
    halo_before<W>(before, raw_x, x_before, k);
    halo_after<W>(x_next, raw_x, x_after, k);
    halo_after<W>(grad_next, raw_grad, grad_after, k);
    float xs[HALO + N + HALO], gs[N + HALO];
#pragma unroll
    for (int i = 0; i < HALO; ++i) {
      xs[i] = before[i];
      xs[HALO + N + i] = x_next[i];
      gs[N + i] = grad_next[i];
    }
#pragma unroll
    for (int e = 0; e < N; ++e) {
      xs[HALO + e] = raw_x[k][e];
      gs[e] = raw_grad[k][e];
    }
    // g[t0 + i], the W - 1 after the vector too (grad_x of its last positions needs them).
    float g[N + HALO];
#pragma unroll
    for (int i = 0; i < N + HALO; ++i) {
      if constexpr (SILU) {
        float pre = bias;
#pragma unroll
        for (int s = 0; s < W; ++s) pre = fmaf(taps[s], xs[i + s], pre);
        g[i] = gs[i] * silu_grad(pre);
      } else {
        g[i] = gs[i];
      }
    }
    float dx[N];
#pragma unroll
    for (int e = 0; e < N; ++e) {
      float sum = 0.0f;
#pragma unroll
      for (int s = 0; s < W; ++s) sum = fmaf(taps[s], g[e + HALO - s], sum);
      dx[e] = sum;
      bias_sum += g[e];
#pragma unroll
      for (int s = 0; s < W; ++s) weight_sums[s] = fmaf(g[e], xs[e + s], weight_sums[s]);
    }
    const int64_t t0 = item.position(k, lane);
    store<A>(grad_x + t0, rounded<T>(dx), valid_count<N>(t0, p.seq_len));
  }

  // One row of partial sums per (b, segment): this warp's is the only write to its columns.
#pragma unroll
  for (int s = 0; s < W; ++s) weight_sums[s] = warp_sum(weight_sums[s]);
  bias_sum = warp_sum(bias_sum);
  if (lane != 0) return;
  float* row = p.partials + (item.b * p.grid.segments + item.segment) * p.columns;
#pragma unroll
  for (int s = 0; s < W; ++s) row[item.d * W + s] = weight_sums[s];
  if (p.params.bias != nullptr) row[p.dim * W + item.d] = bias_sum;
}

// A block's sums of one tile, lane by lane, before they are added over its warps: lane l's sums
// at [warp][l][k], k = e * W + s for the weight (channel e of the lane, tap s), then W N + e for
// the bias. The pitch is odd, so the lanes of a warp writing one k hit 32 different banks.
template <int W>
struct tile_sums {
  static constexpr int per_lane = channel_last_plan::channels * (W + 1);
  static constexpr int weight_per_lane = channel_last_plan::channels * W;
  static constexpr int pitch = per_lane % 2 == 0 ? per_lane + 1 : per_lane;
  float values[channel_last_plan::warps][WARP_THREADS][pitch];
};

template <typename T, int W, bool SILU, bool VECTORISED>
__global__ void __launch_bounds__(channel_last_plan::block_threads, channel_last_plan::backward_min_blocks)
    channel_last_backward_kernel(const __grid_constant__ backward_params<T> p) {
  using plan = channel_last_plan;
  constexpr int N = plan::channels;
  constexpr int HALO = W - 1;
  constexpr int IN_FLIGHT = plan::steps_for<T>(plan::backward_in_flight_bytes);
  constexpr access A = VECTORISED ? access::vectors : access::elements;
  using sums = tile_sums<W>;
  __shared__ sums block_sums;
  const int lane = lane_id();
  const int warp = warp_id();
  const position_ranges& ranges = p.grid.ranges;

  for_each_tile_share(ranges, [&](int64_t tile, int64_t first, int64_t last) {
    const int64_t c0 = tile * plan::tile_channels + lane * N;
    const int count = valid_count<N>(c0, p.dim);
    float taps[N][W], bias[N];
    load_channel_parameters<T>(p.params, c0, count, taps, bias);
    float weight_sums[N][W] = {}, bias_sums[N] = {};

    for_each_walk(ranges, tile, first, last, p.seq_len, [&](int64_t b, int64_t t_begin, int64_t t_end) {
      const T* x = p.x.at(b, 0, 0) + c0;
      const T* grad = p.grad.at(b, 0, 0) + c0;
      T* grad_x = p.grad_x.at(b, 0, 0) + c0;
      float x_history[HALO][N];  // x[t - (W - 1) + s] for s < W - 1, before step t
      float g_history[HALO][N] = {};  // g likewise; read only once the walk has made all W - 1
#pragma unroll
      for (int s = 0; s < HALO; ++s) {
        const int64_t t = t_begin - HALO + s;
        const elements<T, N> raw = t >= 0 ? load<A, T, N>(x + t * p.x.time_stride, count) : elements<T, N>{};
#pragma unroll
        for (int e = 0; e < N; ++e) x_history[s][e] = raw[e];
      }
      // Steps past the walk (at most W - 1, to L) give g for grad_x of its last positions.
      const int64_t t_stop = t_end + HALO;
      const int64_t t_loaded = min(t_stop, p.seq_len);
      for (int64_t t = t_begin; t < t_stop; t += IN_FLIGHT) {
        elements<T, N> raw_x[IN_FLIGHT], raw_grad[IN_FLIGHT];
#pragma unroll
        for (int u = 0; u < IN_FLIGHT; ++u) {
          const bool loaded = t + u < t_loaded;
          raw_x[u] = loaded ? load<A, T, N>(x + (t + u) * p.x.time_stride, count) : elements<T, N>{};
          raw_grad[u] = loaded ? load<A, T, N>(grad + (t + u) * p.grad.time_stride, count) : elements<T, N>{};
        }
#pragma unroll
        for (int u = 0; u < IN_FLIGHT; ++u) {
          const int64_t step = t + u;
          if (step >= t_stop) continue;
          float current[N], g[N], dx[N];
#pragma unroll
          for (int e = 0; e < N; ++e) {
            current[e] = raw_x[u][e];
            g[e] = raw_grad[u][e];
            if constexpr (SILU) {
              float pre = fmaf(taps[e][HALO], current[e], bias[e]);
#pragma unroll
              for (int s = 0; s < HALO; ++s) pre = fmaf(taps[e][s], x_history[s][e], pre);
              g[e] *= silu_grad(pre);
            }
            if (step < t_end) {
#pragma unroll
              for (int s = 0; s < HALO; ++s) weight_sums[e][s] = fmaf(g[e], x_history[s][e], weight_sums[e][s]);
              weight_sums[e][HALO] = fmaf(g[e], current[e], weight_sums[e][HALO]);
              bias_sums[e] += g[e];
            }
            // grad_x[step - (W - 1)] = sum_s weight[s] * g[step - s]
            float sum = taps[e][0] * g[e];
#pragma unroll
            for (int s = 1; s < W; ++s) sum = fmaf(taps[e][s], g_history[HALO - s][e], sum);
            dx[e] = sum;
          }
          push<W>(x_history, current);
          push<W>(g_history, g);
          if (step >= t_begin + HALO) store<A>(grad_x + (step - HALO) * p.grad_x.time_stride, rounded<T>(dx), count);
        }
      }
    });

    // The block's row of partial sums of this tile: its warps' sums added in warp order.
#pragma unroll
    for (int e = 0; e < N; ++e) {
#pragma unroll
      for (int s = 0; s < W; ++s) block_sums.values[warp][lane][e * W + s] = weight_sums[e][s];
      block_sums.values[warp][lane][sums::weight_per_lane + e] = bias_sums[e];
    }
    __syncthreads();
    float* row = p.partials + (int64_t(blockIdx.x) - ranges.first_block(tile)) * p.columns;
    const int64_t tile_channel = tile * plan::tile_channels;
    // Weight column (c W + s) of channel c = tile_channel + l N + e is tile_channel W + i, i = l N W + e W + s.
    for (int i = threadIdx.x; i < WARP_THREADS * sums::weight_per_lane; i += plan::block_threads) {
      const int l = i / sums::weight_per_lane, k = i % sums::weight_per_lane;
      if (tile_channel + l * N + k / W >= p.dim) continue;
      float total = 0.0f;
#pragma unroll
      for (int w = 0; w < plan::warps; ++w) total += block_sums.values[w][l][k];
      row[tile_channel * W + i] = total;
    }
    if (p.params.bias != nullptr) {
      for (int i = threadIdx.x; i < plan::tile_channels; i += plan::block_threads) {
        if (tile_channel + i >= p.dim) continue;
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < plan::warps; ++w) total += block_sums.values[w][i / N][sums::weight_per_lane + i % N];
        row[p.dim * W + tile_channel + i] = total;
      }
    }
    __syncthreads();  // block_sums is written again for the next tile
  });
}

// ------------------------------------------------------------------ the sums of the partial rows

struct sum_plan {
  static constexpr int columns = WARP_THREADS;  // one coalesced 128-byte line of a row
  static constexpr int stripes = 16;            // threads splitting the rows of a column
  static constexpr int unroll = 4;              // independent loads in flight per thread
};

struct partial_sums {
  const float* partials;  // rows of `columns`
  int64_t columns;        // D W weight columns, then D bias columns when there is a bias
  int64_t dim;
  int width;
  // The rows of a column: `uniform_rows` (channel-first), or, when that is 0, one per block of
  // `ranges` that met the column's tile (channel-last).
  int64_t uniform_rows;
  position_ranges ranges;
  void* grad_weight;
  bool weight_fp32;
  void* grad_bias;
  bool bias_fp32;
};

template <typename T>
__device__ __forceinline__ void write_parameter(void* out, bool fp32, int64_t i, float v) {
  if (fp32) {
    static_cast<float*>(out)[i] = v;
  } else {
    static_cast<T*>(out)[i] = numeric<T>::from_float(v);
  }
}

template <typename T>
__global__ void __launch_bounds__(sum_plan::columns * sum_plan::stripes) sum_partials_kernel(const __grid_constant__ partial_sums s) {
  __shared__ float stripe_sums[sum_plan::stripes][sum_plan::columns + 1];
  const int64_t column = int64_t(blockIdx.x) * sum_plan::columns + threadIdx.x;
  const int64_t weight_columns = s.dim * s.width;
  float sum = 0.0f;
  if (column < s.columns) {
    const int64_t channel = column < weight_columns ? column / s.width : column - weight_columns;
    const int64_t rows = s.uniform_rows > 0 ? s.uniform_rows : s.ranges.rows(channel / channel_last_plan::tile_channels);
#pragma unroll sum_plan::unroll
    for (int64_t r = threadIdx.y; r < rows; r += sum_plan::stripes) sum += s.partials[r * s.columns + column];
  }
  stripe_sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || column >= s.columns) return;
  float total = 0.0f;
#pragma unroll
  for (int y = 0; y < sum_plan::stripes; ++y) total += stripe_sums[y][threadIdx.x];
  if (column < weight_columns) {
    write_parameter<T>(s.grad_weight, s.weight_fp32, column, total);
  } else {
    write_parameter<T>(s.grad_bias, s.bias_fp32, column - weight_columns, total);
  }
}

// ------------------------------------------------------------------------------------- host side

namespace {

int64_t partial_columns(const backward_problem& p) {
  return p.size.dim * p.size.width + (p.bias.data != nullptr ? p.size.dim : 0);
}

// The work of one backward launch: its kernel's grid (channel-last ranges from the kernel's own
// occupancy) and its rows of partial sums.
struct backward_grid {
  work grid;
  int64_t partial_rows;  // the most rows any column has
};

template <typename T, int W, bool SILU, bool VECTORISED, layout KIND>
auto backward_kernel() {
  if constexpr (KIND == layout::channel_first) {
    return channel_first_backward_kernel<T, W, SILU, VECTORISED>;
  } else {
    return channel_last_backward_kernel<T, W, SILU, VECTORISED>;
  }
}

template <typename T, int W, bool SILU, bool VECTORISED, layout KIND>
cudaError_t plan_backward(const backward_problem& p, backward_grid& out) {
  if constexpr (KIND == layout::channel_first) {
    out.grid = channel_first_work(p.size, p.dtype);
    out.partial_rows = p.size.batch * out.grid.segments;
  } else {
    out.grid = work{};
    const cudaError_t err = channel_last_ranges(backward_kernel<T, W, SILU, VECTORISED, KIND>(), p.size, out.grid.ranges);
    if (err != cudaSuccess) return err;
    out.partial_rows = 0;
    for (int64_t tile = 0; tile < channel_last_tiles(p.size); ++tile) {
      out.partial_rows = std::max(out.partial_rows, out.grid.ranges.rows(tile));
    }
  }
  return cudaSuccess;
}

template <typename T, int W, bool SILU, bool VECTORISED, layout KIND>
cudaError_t run_backward(const backward_problem& problem, cudaStream_t stream) {
  backward_grid plan{};
  if (const cudaError_t err = plan_backward<T, W, SILU, VECTORISED, KIND>(problem, plan); err != cudaSuccess) return err;
  backward_params<T> p{};
  p.dim = problem.size.dim;
  p.seq_len = problem.size.seq_len;
  p.grad = input_of<T>(problem.grad);
  p.x = input_of<T>(problem.x);
  p.grad_x = output_of<T>(problem.grad_x);
  p.params = parameters_of(problem.weight, problem.bias);
  p.grid = plan.grid;
  p.partials = problem.workspace;
  p.columns = partial_columns(problem);
  const auto kernel = backward_kernel<T, W, SILU, VECTORISED, KIND>();
  const int64_t blocks = KIND == layout::channel_first ? ceil_div<int64_t>(p.grid.items, channel_first_plan::warps)
                                                       : p.grid.ranges.blocks;
  const int threads = KIND == layout::channel_first ? channel_first_plan::block_threads : channel_last_plan::block_threads;
  if (const cudaError_t err = pipeline::launch(kernel, unsigned(blocks), threads, 0, stream, p); err != cudaSuccess) {
    return err;
  }

  partial_sums s{};
  s.partials = problem.workspace;
  s.columns = p.columns;
  s.dim = problem.size.dim;
  s.width = W;
  s.uniform_rows = KIND == layout::channel_first ? plan.partial_rows : 0;
  s.ranges = plan.grid.ranges;
  s.grad_weight = problem.grad_weight;
  s.weight_fp32 = problem.weight.dtype == element_type::fp32;
  s.grad_bias = problem.grad_bias;
  s.bias_fp32 = problem.bias.data != nullptr && problem.bias.dtype == element_type::fp32;
  const unsigned sum_blocks = unsigned(ceil_div<int64_t>(s.columns, sum_plan::columns));
  return pipeline::launch(sum_partials_kernel<T>, sum_blocks, dim3(sum_plan::columns, sum_plan::stripes), 0, stream, s);
}

// f.template operator()<T, W, SILU, VECTORISED, KIND>() for the problem's variant.
template <typename F>
auto with_backward_variant(const backward_problem& p, F&& f) {
  const launch_plan plan = plan_launch(p.dtype, p.size, p.grad, p.x, p.grad_x);
  return dispatch<dtypes, widths, flags, flags, flags>(
      [&]<element_type E, int W, bool SILU, bool VECTORISED, bool CHANNEL_LAST>() {
        constexpr layout kind = CHANNEL_LAST ? layout::channel_last : layout::channel_first;
        return f.template operator()<element_t<E>, W, SILU, VECTORISED, kind>();
      },
      p.dtype, p.size.width, p.silu, plan.vectorised, plan.kind == layout::channel_last);
}

}  // namespace

std::string unsupported_reason(const backward_problem& p) {
  if (p.grad_weight == nullptr) return "grad_weight is required";
  if (p.bias.data != nullptr && p.grad_bias == nullptr) return "grad_bias is required with a bias";
  return common_reason(p.dtype, p.size, p.weight, p.bias, p.grad, p.x, p.grad_x);
}

int64_t backward_workspace_floats(const backward_problem& p) {
  if (!unsupported_reason(p).empty()) return 0;
  return with_backward_variant(p, [&]<typename T, int W, bool SILU, bool VECTORISED, layout KIND>() -> int64_t {
    backward_grid plan{};
    if (plan_backward<T, W, SILU, VECTORISED, KIND>(p, plan) != cudaSuccess) return 0;
    return plan.partial_rows * partial_columns(p);
  });
}

cudaError_t launch_backward(const backward_problem& p, cudaStream_t stream) {
  if (!unsupported_reason(p).empty() || p.workspace == nullptr) return cudaErrorInvalidValue;
  return with_backward_variant(p, [&]<typename T, int W, bool SILU, bool VECTORISED, layout KIND>() {
    return run_backward<T, W, SILU, VECTORISED, KIND>(p, stream);
  });
}

}  // namespace tk::causal_conv1d
