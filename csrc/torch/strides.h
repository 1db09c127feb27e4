// Layout helpers of the torch glue that need no CUDA headers (the autograd and the norms' fast
// entries are also built for CPU tensors in the tests).
#pragma once

#include <ATen/core/Tensor.h>

namespace tk::strides {

// tk_ops._checks.unit_last_stride: the kernels take any strides with a unit last stride; anything
// else is copied, never misread.
inline at::Tensor unit_last_stride(const at::Tensor& t) {
  return t.dim() > 0 && t.size(-1) > 1 && t.stride(-1) != 1 ? t.contiguous() : t;
}

}  // namespace tk::strides
