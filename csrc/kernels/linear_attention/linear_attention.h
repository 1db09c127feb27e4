// The generic causal linear attention launcher: out_i = sum_{j<=i} (q_i . k_j) v_j, divided by
// (sum_{j<=i} q_i . k_j + eps) when normalising, on already feature-mapped q and k; bf16 or fp16 in
// and out, fp32 denominators. Plain C++ (no torch): csrc/torch/linear_attention.cpp calls it.
//
// q, k are (B, H, N, F) and v (B, H, N, Dv) views with a unit last stride and any other strides
// (in elements); the kernels take F in {16, 32, 64, 128, 256} and Dv a multiple of 32 up to 256,
// forward and backward.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/common/causal_problem.h"

namespace tk::linear {

using forward_problem = causal_forward_problem;
using backward_problem = causal_backward_problem;

// Floats of workspace the backward needs (its `workspace`).
int64_t backward_workspace_floats(int64_t batch, int64_t heads, int64_t rows, int64_t features, int64_t value_dim,
                                  bool normalize);

// Empty when the kernels can run the problem; otherwise why not.
std::string unsupported_reason(const forward_problem& p);
std::string unsupported_reason(const backward_problem& p);

// Launch on `stream`; return the (first) launch error.
cudaError_t launch(const forward_problem& p, cudaStream_t stream);
cudaError_t launch(const backward_problem& p, cudaStream_t stream);

}  // namespace tk::linear
