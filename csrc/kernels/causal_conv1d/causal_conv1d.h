// The causal depthwise conv1d launchers (forward, and backward through the optional SiLU), plain C++
// without torch: csrc/torch/causal_conv1d.cpp calls them. The math is tk_ops/ops/causal_conv1d.py's:
//   pre[b, d, t] = bias[d] + sum_{s < W} weight[d, s] * x[b, d, t - (W - 1) + s]   (x = 0 at t < 0)
//   out = silu(pre) or pre;  g = grad * silu'(pre) or grad
//   grad_x[b, d, u] = sum_s weight[d, s] * g[b, d, u + (W - 1) - s]   (g = 0 at t >= L)
//   grad_weight[d, s] = sum_{b, t} g * x[b, d, t - (W - 1) + s],  grad_bias[d] = sum_{b, t} g
//
// Every activation (x, out, grad, grad_x) is a (B, D, L) view with its own strides; the kernels need
// them all to share one unit-stride dimension: time (channel-first, a (B, D, L) tensor) or channel
// (channel-last, a (B, L, D) tensor seen as (B, D, L)). Activations are bf16, fp16 or fp32 (one
// dtype for all); weight (D, W) and bias (D,) are contiguous, in that dtype or fp32.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "tk/element_type.h"

namespace tk::causal_conv1d {

using tk::element_type;

// Element (b, d, t) of a (B, D, L) activation at data[b * batch_stride + d * channel_stride + t * time_stride].
struct input_view {
  const void* data;
  int64_t batch_stride, channel_stride, time_stride;
};

struct output_view {
  void* data;
  int64_t batch_stride, channel_stride, time_stride;
};

struct parameter {
  const void* data;  // contiguous; nullptr: absent (a bias only)
  element_type dtype;
};

struct sizes {
  int64_t batch, dim, seq_len;
  int64_t width;  // W, the taps per channel
};

struct forward_problem {
  element_type dtype;  // of x and out
  sizes size;
  input_view x;
  output_view out;
  parameter weight, bias;
  bool silu;
};

struct backward_problem {
  element_type dtype;  // of grad, x and grad_x
  sizes size;
  input_view grad, x;
  output_view grad_x;
  parameter weight, bias;
  bool silu;
  void* grad_weight;  // (D, W), the weight's dtype
  void* grad_bias;    // (D,), the bias's dtype; nullptr without a bias
  float* workspace;   // backward_workspace_floats() floats, any content
};

// Empty when the kernels can run the problem; otherwise why not (width, dtype, layout, sizes).
std::string unsupported_reason(const forward_problem& p);
std::string unsupported_reason(const backward_problem& p);

// fp32 scratch of the backward: the per-block partial sums of grad_weight and grad_bias. Counted
// with the problem's device current (it depends on how many blocks fit the device at once).
int64_t backward_workspace_floats(const backward_problem& p);

// Launch on `stream` (the current device's); return the launch's error code.
cudaError_t launch_forward(const forward_problem& p, cudaStream_t stream);
cudaError_t launch_backward(const backward_problem& p, cudaStream_t stream);

}  // namespace tk::causal_conv1d
