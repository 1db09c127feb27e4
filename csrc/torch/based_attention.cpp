// CUDA kernel of tk::based_attention (the forward) on the Hopper Based kernel.
//
// The entry re-checks its arguments, describes q, k, v to the kernel as they are stored (any
// strides with a unit last stride, so (B, N, H, F) views need no copy) and launches on the current
// stream. What the kernel cannot take (fp32/fp64, F other than 16, Dv not a multiple of 32 up to
// 256, another GPU, strides TMA cannot describe) goes to the reference twin tk::based_attention_ref,
// which warns once. When the forward's split rule cuts the sequences into segments (few (batch,
// head) tasks for the SMs), the entry allocates the segments' fp32 states as a workspace that lives
// for the launch (stream-ordered by the caching allocator). tk::based_attention_bwd runs the backward kernels on the same inputs (grad_out,
// and out when normalising, with the layout rules of v) and falls back to
// tk::based_attention_bwd_ref otherwise.
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
  auto plan = causal_linear::plan_forward(q, k, v, eps, normalize,
                                          [](const based::forward_problem& p) { return based::unsupported_reason(p); });
  if (!plan) {
    return tk::registration::fallback<&based_attention_cuda>("tk::based_attention_ref", q, k, v, eps, normalize);
  }
  return causal_linear::run_forward(*plan, q, v, normalize, [&](based::forward_problem& p, cudaStream_t stream) {
    // The segment states of a split forward (fp32, on q's device: the guard of the launch is current).
    at::Tensor workspace;
    if (const int64_t floats = based::forward_workspace_floats(p); floats > 0) {
      workspace = at::empty({floats}, q.options().dtype(at::kFloat));
      p.workspace = workspace.data_ptr<float>();
    }
    return based::launch(p, stream);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> based_attention_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& q,
                                                                        const at::Tensor& k, const at::Tensor& v,
                                                                        const at::Tensor& out,
                                                                        const at::Tensor& denominator, double eps,
                                                                        bool normalize) {
  causal_linear::check_backward_inputs("tk::based_attention_bwd", grad_out, q, k, v, out, denominator, eps,
                                       normalize);
  auto plan = causal_linear::plan_backward(
      grad_out, q, k, v, out, denominator, eps, normalize,
      [](const based::backward_problem& p) { return based::unsupported_reason(p); });
  if (!plan) {
    return tk::registration::fallback<&based_attention_bwd_cuda>("tk::based_attention_bwd_ref", grad_out, q, k, v, out,
                                                                 denominator, eps, normalize);
  }
  return causal_linear::run_backward(
      *plan, q, k, v, based::backward_workspace_floats(q.size(0), q.size(1), q.size(2), v.size(3), normalize),
      [](const based::backward_problem& p, cudaStream_t stream) { return based::launch(p, stream); });
}

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) {
  m.impl("based_attention", &based_attention_cuda);
  m.impl("based_attention_bwd", &based_attention_bwd_cuda);
}
