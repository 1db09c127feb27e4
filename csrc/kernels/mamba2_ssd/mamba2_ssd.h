// The Mamba-2 SSD forward launcher (tk::mamba2_ssd, tk_ops/ops/mamba2_ssd.py for the semantics):
// x, B, C, z in bf16 or fp16, dt fp32, head dim P = 64, state size N in {64, 128}, chunk_size in
// {64, 128, 256}, any L, H % G == 0. Plain C++ (no torch): csrc/torch/mamba2_ssd.cpp calls it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/common/heads_view.h"
#include "tk/element_type.h"

namespace tk::mamba2 {

struct ssd_forward_problem {
  element_type dtype;              // of x, B, C, z and y
  heads_view x;                    // (Bt, H, L, P) view of x (Bt, L, H, P): any strides, unit last
  heads_view B, C;                 // (Bt, G, L, N) views of B, C (Bt, L, G, N)
  heads_view z;                    // like x; z.data null without the gate
  const float* dt;                 // dt[b, l, h] at dt + b * dt_batch_stride + l * dt_row_stride + h * dt_head_stride
  int64_t dt_batch_stride, dt_row_stride, dt_head_stride;
  const float* A;                  // (H,)
  const float* D;                  // null, (H,) or (H, P) contiguous
  bool D_per_channel;              // D is (H, P)
  const float* dt_bias;            // null or (H,)
  bool dt_softplus;
  const float* initial_states;     // null or (Bt, H, P, N) contiguous
  int chunk_size;
  void* y;                         // (Bt, L, H, P) contiguous, x's dtype
  float* final_states;             // (Bt, H, P, N) contiguous
  float* chunk_states;             // (Bt, ceil(L / chunk_size), H, P, N) contiguous
};

// Empty when the kernel can run the problem; otherwise why not.
std::string unsupported_reason(const ssd_forward_problem& p);

// Launch on `stream`; return the launch error.
cudaError_t launch(const ssd_forward_problem& p, cudaStream_t stream);

}  // namespace tk::mamba2
