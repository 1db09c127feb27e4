// The forward problem of a causal linear attention kernel (Based, generic linear attention): plain
// C++, so the torch registrations can build one.
#pragma once

#include "kernels/common/heads_view.h"
#include "tk/element_type.h"

namespace tk {

struct causal_forward_problem {
  element_type dtype;
  bool normalize;
  float eps;
  heads_view q, k, v;
  void* out;           // (B, H, N, Dv) contiguous
  float* denominator;  // (B, H, N) contiguous; written (without eps) only when normalize
};

}  // namespace tk
