// The Based attention launcher: causal linear attention with the 2nd-order Taylor feature map,
// phi(q) . phi(k) = 1 + s + s^2 / 2 with s = q . k / sqrt(F), bf16 or fp16 in and out, fp32
// denominators. Plain C++ (no torch): csrc/torch/based_attention.cpp calls it.
//
// q, k are (B, H, N, F) and v (B, H, N, Dv) views with a unit last stride and any other strides
// (in elements); the kernels take F = 16 and Dv a multiple of 32 up to 256.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "kernels/common/causal_problem.h"

namespace tk::based {

using forward_problem = causal_forward_problem;

// Empty when the kernel can run the problem; otherwise why not.
std::string unsupported_reason(const forward_problem& p);

// Launch on `stream`; return the launch error.
cudaError_t launch(const forward_problem& p, cudaStream_t stream);

}  // namespace tk::based
