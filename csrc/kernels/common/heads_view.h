// A (B, H, N, D) tensor as the kernels see it: plain C++, so the torch registrations can build one.
#pragma once

#include <cstdint>

namespace tk {

struct heads_view {
  const void* data;
  int64_t batch, heads, rows, dim;
  int64_t batch_stride, head_stride, row_stride;  // elements; the last dimension is contiguous
};

}  // namespace tk
