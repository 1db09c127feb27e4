// Host-side helpers of the kernels that read (B, H, N, D) tensors through TMA: the 4-D global
// layout of a heads_view, the view of a contiguous output, and why a view cannot be a tile's source.
#pragma once

#include <string>

#include "kernels/common/heads_view.h"
#include "tk/tk.cuh"

namespace tk {

template <typename T>
global_layout<T, 4> heads_layout(const heads_view& t) {
  return strided_layout<T, 4>(static_cast<T*>(const_cast<void*>(t.data)), {t.batch, t.heads, t.rows, t.dim},
                              {t.batch_stride, t.head_stride, t.row_stride});
}

inline heads_view contiguous_view(const void* data, int64_t batch, int64_t heads, int64_t rows, int64_t dim) {
  return {data, batch, heads, rows, dim, heads * rows * dim, rows * dim, dim};
}

// The batch, head and row strides of `t` (elements), as a kernel that indexes rows itself takes them.
inline void copy_strides(int64_t (&dst)[3], const heads_view& t) {
  dst[0] = t.batch_stride;
  dst[1] = t.head_stride;
  dst[2] = t.row_stride;
}

// Empty when TMA can move Tile-sized boxes of `t`; otherwise the rule it breaks, prefixed with `name`.
template <typename Tile, typename T>
std::string layout_reason(const char* name, const heads_view& t) {
  const std::string r = tma_unsupported_reason<Tile>(heads_layout<T>(t));
  return r.empty() ? r : std::string(name) + ": " + r;
}

}  // namespace tk
