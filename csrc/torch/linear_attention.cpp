// CUDA kernel of tk::linear_attention (the forward) on the Hopper linear attention kernel.
//
// The entry re-checks its arguments, describes q, k, v to the kernel as they are stored (any
// strides with a unit last stride, so (B, N, H, F) views need no copy) and launches on the current
// stream. What the kernel cannot take (fp32/fp64, F outside {16, 32, 64, 128, 256}, Dv not a
// multiple of 32 up to 256, another GPU, strides TMA cannot describe) goes to the reference twin
// tk::linear_attention_ref, which warns once. tk::linear_attention_bwd runs the backward kernels on
// the same inputs (grad_out, and out when normalising, with the layout rules of v; the denominator
// fp32 and contiguous) and falls back to tk::linear_attention_bwd_ref otherwise.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "causal_linear.h"
#include "kernels/linear_attention/linear_attention.h"
#include "registration.h"

namespace {

namespace linear = tk::linear;
namespace causal_linear = tk::causal_linear;

std::tuple<at::Tensor, at::Tensor> linear_attention_cuda(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v, double eps, bool normalize) {
  causal_linear::check_inputs("tk::linear_attention", q, k, v, eps);
  auto plan = causal_linear::plan_forward(q, k, v, eps, normalize,
                                          [](const linear::forward_problem& p) { return linear::unsupported_reason(p); });
  if (!plan) {
    return tk::registration::fallback<&linear_attention_cuda>("tk::linear_attention_ref", q, k, v, eps, normalize);
  }
  return causal_linear::run_forward(*plan, q, v, normalize, [](const linear::forward_problem& p, cudaStream_t stream) {
    return linear::launch(p, stream);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_attention_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& denominator, double eps, bool normalize) {
  causal_linear::check_backward_inputs("tk::linear_attention_bwd", grad_out, q, k, v, out, denominator, eps,
                                       normalize);
  auto plan = causal_linear::plan_backward(
      grad_out, q, k, v, out, denominator, eps, normalize,
      [](const linear::backward_problem& p) { return linear::unsupported_reason(p); });
  if (!plan) {
    return tk::registration::fallback<&linear_attention_bwd_cuda>("tk::linear_attention_bwd_ref", grad_out, q, k, v,
                                                                  out, denominator, eps, normalize);
  }
  return causal_linear::run_backward(
      *plan, q, k, v,
      linear::backward_workspace_floats(q.size(0), q.size(1), q.size(2), q.size(3), v.size(3), normalize),
      [](const linear::backward_problem& p, cudaStream_t stream) { return linear::launch(p, stream); });
}

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) {
  m.impl("linear_attention", &linear_attention_cuda);
  m.impl("linear_attention_bwd", &linear_attention_bwd_cuda);
}
