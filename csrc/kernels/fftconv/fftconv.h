// The FFT long-convolution launcher (tk::fftconv, tk_ops/ops/fftconv.py for the semantics):
// y[b, h, t] = sum_{s <= t} k[h, s] u[b, h, t - s] + D[h] u[b, h, t] for u in bf16 or fp16 and N a
// power of two from 256 to 16384. Plain C++ (no torch): csrc/torch/fftconv.cpp calls it.
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
  element_type dtype;             // of u and y: bf16 or fp16
  const void* u;                  // u[b, h, n] at u + b * u_batch_stride + h * u_head_stride + n (elements)
  int64_t batch, heads, seq_len;  // B, H, N
  int64_t u_batch_stride, u_head_stride;
  const float* spectrum;          // rfft(k, 2N): (H, N + 1) complex64 as (re, im) float pairs
  int64_t spectrum_head_stride;   // complex entries between heads
  const float* D;                 // (H,) fp32, or null
  void* y;                        // (B, H, N) contiguous, u's dtype
  void* workspace;                // workspace_bytes(N, H, dtype) bytes, 16-byte aligned
};

// Bytes of workspace the kernels need (0 for a sequence length they do not take).
int64_t workspace_bytes(int64_t seq_len, int64_t heads, element_type dtype);

// Empty when the kernels can run the problem; otherwise why not.
std::string unsupported_reason(const forward_problem& p);

// Launch on `stream` (the table launch, then the convolution); return the first launch error.
cudaError_t launch(const forward_problem& p, cudaStream_t stream);

}  // namespace tk::fftconv
