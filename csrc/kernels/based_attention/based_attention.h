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

using backward_problem = causal_backward_problem;

// Floats of fp32 workspace the forward needs (forward_problem::workspace): 0 unless its split rule cuts
// the sequences into segments on the current device (then per (batch, head), segment but the last and
// 32 value columns, one state record of 10752 floats).
int64_t forward_workspace_floats(const forward_problem& p);

// Floats of workspace the backward needs.
int64_t backward_workspace_floats(int64_t batch, int64_t heads, int64_t rows, int64_t value_dim, bool normalize);

// Empty when the kernels can run the problem; otherwise why not.
std::string unsupported_reason(const forward_problem& p);
std::string unsupported_reason(const backward_problem& p);

// Launch on `stream`; return the first launch error.
cudaError_t launch(const forward_problem& p, cudaStream_t stream);
cudaError_t launch(const backward_problem& p, cudaStream_t stream);

}  // namespace tk::based
