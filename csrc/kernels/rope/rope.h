// The rotary-embedding launcher: rotates one (B, H, N, D) tensor, or q and k together, in one launch.
// Plain C++ (no torch): csrc/torch/rope.cpp calls it.
//
// Each tensor is described as it is stored (any batch, head and position strides, unit channel
// stride); its result is written contiguous. cos and sin are (Bc, N, width) tables, Bc in {1, B}
// (a batch stride of 0 shares one table), with unit channel stride:
//   half tables  width R / 2: pair i of the first R channels turns by (cos[i], sin[i]), the last
//                D - R channels pass through; pairs are (i, i + R/2), or (2i, 2i + 1) when interleaved;
//   full tables  width D, not interleaved: out = x * cos + rotate_half(x) * sin with per-channel tables.
// `backward` applies the transpose of that map. The math runs in fp32.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "tk/element_type.h"

namespace tk::rope {

using tk::element_type;

// One tensor to rotate: (B, heads, N, D) at `input` with the given element strides, and where its
// contiguous (B, heads, N, D) result goes.
struct head_tensor {
  const void* input;
  int64_t heads;
  int64_t batch_stride;
  int64_t head_stride;
  int64_t seq_stride;
  void* output;
};

// cos or sin: entry (b, n, i) at data[b * batch_stride + n * seq_stride + i].
struct table {
  const void* data;
  int64_t batch_stride;  // 0 when one table serves every batch
  int64_t seq_stride;
};

constexpr int MAX_TENSORS = 2;

struct problem {
  element_type x_type;      // of every tensor and output
  element_type table_type;  // x_type or fp32
  int tensor_count;         // 1 (rope) or 2 (rope_qk: q, then k)
  head_tensor tensors[MAX_TENSORS];
  int64_t batch;
  int64_t seq_len;
  int64_t head_dim;
  int64_t table_width;  // R / 2 (half tables) or D (full tables, not interleaved)
  bool interleaved;
  bool backward;
  table cos;
  table sin;
};

// Empty when the kernel can run the problem; otherwise why not.
std::string unsupported_reason(const problem& p);

// Launch on `stream` (the current device's); returns the launch's error code.
cudaError_t launch(const problem& p, cudaStream_t stream);

}  // namespace tk::rope
