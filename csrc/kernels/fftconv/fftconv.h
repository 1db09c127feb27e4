// The FFT long-convolution launchers (tk::fftconv and tk::fftconv_bwd, tk_ops/ops/fftconv.py for the
// semantics) for u in bf16 or fp16 and N a power of two from 256 to 16384, or u in fp32 (split
// operands: precision.cuh) and N from 256 to 8192:
//   forward    y[b, h, t] = sum_{s <= t} k[h, s] u[b, h, t - s] + D[h] u[b, h, t]
//   backward   grad_u (the correlation of grad_y with k, + D grad_y), grad_k (sum over the batch of
//              the correlation of grad_y with u, t < L), grad_D (sum of grad_y u)
// Plain C++ (no torch): csrc/torch/fftconv.cpp calls them.
//
// The caller hands the filter's spectrum, rfft(k, 2N) in fp32 (cuFFT through ATen: the filter's
// transform, once per call and shared by the whole batch), and a workspace into which the first
// launch writes the kernel's tables (DFT factor, twiddles, the spectrum in the kernel's order).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "tk/element_type.h"

namespace tk::fftconv {

struct forward_problem {
  element_type dtype;             // of u and y: bf16, fp16 or fp32
  const void* u;                  // u[b, h, n] at u + b * u_batch_stride + h * u_head_stride + n (elements)
  int64_t batch, heads, seq_len;  // B, H, N
  int64_t u_batch_stride, u_head_stride;
  const float* spectrum;          // rfft(k, 2N): (H, N + 1) complex64 as (re, im) float pairs
  int64_t spectrum_head_stride;   // complex entries between heads
  const float* D;                 // (H,) fp32, or null
  void* y;                        // (B, H, N) contiguous, u's dtype
  void* workspace;                // workspace_bytes(N, H, dtype) bytes, 16-byte aligned
};

struct backward_problem {
  element_type dtype;                 // of grad, u and grad_u: bf16, fp16 or fp32
  const void* grad;                   // grad_y[b, h, n] at grad + b * grad_batch_stride + h * grad_head_stride + n
  int64_t grad_batch_stride, grad_head_stride;
  const void* u;                      // as in forward_problem
  int64_t u_batch_stride, u_head_stride;
  int64_t batch, heads, seq_len;      // B, H, N
  int64_t filter_len;                 // L <= N: grad_k is needed for s < L
  const float* spectrum;              // rfft(k, 2N) as in forward_problem
  int64_t spectrum_head_stride;
  const float* D;                     // (H,) fp32, or null (then grad_D is not written)
  void* grad_u;                       // (B, H, N) contiguous, u's dtype
  float* grad_k;                      // (H, N) contiguous fp32: columns s < filter_len are written
  float* grad_D;                      // (H,) fp32, or null when D is
  void* workspace;                    // workspace_bytes(N, H, dtype) bytes, 16-byte aligned
};

// Bytes of workspace the kernels need, forward or backward (0 for a sequence length they do not take).
int64_t workspace_bytes(int64_t seq_len, int64_t heads, element_type dtype);

// Empty when the kernels can run the problem; otherwise why not.
std::string unsupported_reason(const forward_problem& p);
std::string unsupported_reason(const backward_problem& p);

// Launch on `stream` (forward: the table launch, then the convolution; backward: the tables with
// conj(K), the convolution kernel for grad_u, then the filter-gradient kernel); return the first
// launch error.
cudaError_t launch(const forward_problem& p, cudaStream_t stream);
cudaError_t launch(const backward_problem& p, cudaStream_t stream);

}  // namespace tk::fftconv
