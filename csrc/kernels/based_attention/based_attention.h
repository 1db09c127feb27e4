// The Based attention launcher: causal linear attention with the 2nd-order Taylor feature map,
// phi(q) . phi(k) = 1 + s + s^2 / 2 with s = q . k / sqrt(F), bf16 or fp16 in and out, fp32
// denominators. Plain C++ (no torch): csrc/torch/based_attention.cpp calls it.
//
// q, k are (B, H, N, F) and v (B, H, N, Dv) views with a unit last stride and any other strides
// (in elements); the kernels take F = 16 and Dv a multiple of 32 up to 256, forward and backward.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/common/causal_problem.h"

namespace tk::based {

using forward_problem = causal_forward_problem;

// The backward: grad_out, q, k, v as the forward's views; out and denominator (the forward's
// outputs) are read only when normalize. The gradients come back contiguous in the input dtype.
struct backward_problem {
  element_type dtype;
  bool normalize;
  float eps;
  heads_view q, k, v, grad_out;
  heads_view out;            // (B, H, N, Dv), read only when normalize
  const float* denominator;  // (B, H, N) contiguous (without eps), read only when normalize
  void* grad_q;              // (B, H, N, F) contiguous
  void* grad_k;              // (B, H, N, F) contiguous
  void* grad_v;              // (B, H, N, Dv) contiguous
  // backward_workspace_floats(...) floats: per-value-block partial grad_q / grad_k and, when
  // normalize, the per-row statistics 1 / (denominator + eps) and -(grad_out . out) / (denominator + eps).
  float* workspace;
};

// Floats of workspace the backward needs.
int64_t backward_workspace_floats(int64_t batch, int64_t heads, int64_t rows, int64_t value_dim, bool normalize);

// Empty when the kernels can run the problem; otherwise why not.
std::string unsupported_reason(const forward_problem& p);
std::string unsupported_reason(const backward_problem& p);

// Launch on `stream`; return the first launch error.
cudaError_t launch(const forward_problem& p, cudaStream_t stream);
cudaError_t launch(const backward_problem& p, cudaStream_t stream);

}  // namespace tk::based
