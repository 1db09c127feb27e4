// The forward and backward problems of the causal linear attention kernels (Based, generic linear
// attention): plain C++, so the torch registrations can build them.
#pragma once

#include "kernels/common/heads_view.h"
#include "tk/element_type.h"

namespace tk {

struct causal_forward_problem {
  element_type dtype;
  bool normalize;
  float eps;
  heads_view q, k, v;
  void* out;           // (B, H, N, Dv) contiguous
  float* denominator;  // (B, H, N) contiguous; written (without eps) only when normalize
  // The family's forward_workspace_floats(...) floats (Based: the segment states when the forward
  // splits the sequences; null when it needs none).
  float* workspace = nullptr;
};

// The backward: grad_out, q, k, v as the forward's views; out and denominator (the forward's
// outputs) are read only when normalize. The gradients come back contiguous in the input dtype.
struct causal_backward_problem {
  element_type dtype;
  bool normalize;
  float eps;
  heads_view q, k, v, grad_out;
  heads_view out;            // (B, H, N, Dv), read only when normalize
  const float* denominator;  // (B, H, N) contiguous (without eps), read only when normalize
  void* grad_q;              // (B, H, N, F) contiguous
  void* grad_k;              // (B, H, N, F) contiguous
  void* grad_v;              // (B, H, N, Dv) contiguous
  // The family's backward_workspace_floats(...) floats: per-value-block partial grad_q / grad_k
  // and, when normalize, the per-row statistics 1 / (denominator + eps) and
  // -(grad_out . out) / (denominator + eps).
  float* workspace;
};

}  // namespace tk
