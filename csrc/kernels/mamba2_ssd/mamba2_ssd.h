// The Mamba-2 SSD launchers (tk::mamba2_ssd and tk::mamba2_ssd_bwd, tk_ops/ops/mamba2_ssd.py for the
// semantics): x, B, C, z in bf16 or fp16, dt fp32, head dim P = 64, state size N in {64, 128},
// chunk_size in {64, 128, 256}, any L, H % G == 0. Plain C++ (no torch): csrc/torch/mamba2_ssd.cpp
// calls them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/common/heads_view.h"
#include "tk/element_type.h"

namespace tk::mamba2 {

// dt (Bt, L, H) fp32 with any strides (elements). The kernels walk one (batch, head) column of it
// along the positions; column() is constexpr so that device code may call it (the build passes
// --expt-relaxed-constexpr) while this header stays plain C++ for the torch registration.
struct dt_view {
  const float* data;
  int64_t batch_stride, row_stride, head_stride;

  // &dt[batch, 0, head]; position l of the column is row_stride * l further.
  constexpr const float* column(int64_t batch, int64_t head) const {
    return data + batch * batch_stride + head * head_stride;
  }
};

struct ssd_forward_problem {
  element_type dtype;              // of x, B, C, z and y
  heads_view x;                    // (Bt, H, L, P) view of x (Bt, L, H, P): any strides, unit last
  heads_view B, C;                 // (Bt, G, L, N) views of B, C (Bt, L, G, N)
  heads_view z;                    // like x; z.data null without the gate
  dt_view dt;                      // (Bt, L, H), any strides
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

// The backward: the forward's inputs as the forward takes them, grad_y like x, and the forward's
// chunk_states. The per-(batch, head) sums of grad_A, grad_D and grad_dt_bias come back unreduced
// over the batch (the caller sums them); every other gradient is final.
struct ssd_backward_problem {
  ssd_forward_problem forward;     // its y, final_states and chunk_states are unused
  heads_view grad_y;               // like x
  const float* chunk_states;       // (Bt, ceil(L / chunk_size), H, P, N) contiguous
  const float* grad_final_states;  // null or (Bt, H, P, N) contiguous
  void* grad_x;                    // (Bt, L, H, P) contiguous, x's dtype
  void* grad_z;                    // like grad_x; gated only
  void* grad_B;                    // (Bt, L, G, N) contiguous, x's dtype
  void* grad_C;
  float* grad_dt;                  // (Bt, L, H) contiguous: the gradient of dt itself
  float* grad_initial_states;      // null or (Bt, H, P, N) contiguous
  float* grad_A_partial;           // (Bt, H): sum over the positions of da dt
  float* grad_dt_bias_partial;     // (Bt, H): sum over the positions of grad_dt
  float* grad_D_partial;           // null or (Bt, H, P): sum over the positions of gy x
  // backward_workspace_floats(...) floats: the state entering every 64-position block and the
  // per-head partial grad_B and grad_C.
  float* workspace;
};

// Floats of workspace the backward needs.
int64_t backward_workspace_floats(int64_t batch, int64_t heads, int64_t rows, int64_t state_size);

// Empty when the kernels can run the problem; otherwise why not.
std::string unsupported_reason(const ssd_forward_problem& p);
std::string unsupported_reason(const ssd_backward_problem& p);

// Launch on `stream`; return the first launch error.
cudaError_t launch(const ssd_forward_problem& p, cudaStream_t stream);
cudaError_t launch(const ssd_backward_problem& p, cudaStream_t stream);

}  // namespace tk::mamba2
