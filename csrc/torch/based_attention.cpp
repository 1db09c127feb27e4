// CUDA kernel of tk::based_attention (the forward) on the Hopper Based kernel.
//
// The entry re-checks its arguments, describes q, k, v to the kernel as they are stored (any
// strides with a unit last stride, so (B, N, H, F) views need no copy) and launches on the current
// stream. What the kernel cannot take (fp32/fp64, F other than 16, Dv not a multiple of 32 up to
// 256, another GPU, strides TMA cannot describe) goes to the reference twin tk::based_attention_ref,
// which warns once. tk::based_attention_bwd has no kernel yet: its reference serves every device.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "causal_linear.h"
#include "kernels/based_attention/based_attention.h"
#include "registration.h"

namespace {

namespace based = tk::based;
namespace causal_linear = tk::causal_linear;

std::tuple<at::Tensor, at::Tensor> based_attention_cuda(const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& v, double eps, bool normalize) {
  causal_linear::check_inputs("tk::based_attention", q, k, v, eps);
  auto plan = causal_linear::plan_forward(q, k, v, eps, normalize, based::unsupported_reason);
  if (!plan) {
    return tk::registration::fallback<&based_attention_cuda>("tk::based_attention_ref", q, k, v, eps, normalize);
  }
  return causal_linear::run_forward(*plan, q, v, normalize, based::launch);
}

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) { m.impl("based_attention", &based_attention_cuda); }
