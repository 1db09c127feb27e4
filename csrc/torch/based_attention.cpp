// CUDA kernel of tk::based_attention (the forward) on the Hopper Based kernel.
//
// The entry re-checks its arguments, describes q, k, v to the kernel as they are stored (any
// strides with a unit last stride, so (B, N, H, F) views need no copy) and launches on the current
// stream. What the kernel cannot take (fp32/fp64, F other than 16, Dv not a multiple of 32 up to
// 256, another GPU, strides TMA cannot describe) goes to the reference twin tk::based_attention_ref,
// which warns once. tk::based_attention_bwd runs the backward kernels on the same inputs (grad_out,
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
  return causal_linear::run_forward(*plan, q, v, normalize, [](const based::forward_problem& p, cudaStream_t stream) {
    return based::launch(p, stream);
  });
}

void check_backward_inputs(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& out, const at::Tensor& denominator, double eps, bool normalize) {
  constexpr const char* op = "tk::based_attention_bwd";
  causal_linear::check_inputs(op, q, k, v, eps);
  TORCH_CHECK_VALUE(grad_out.sizes() == v.sizes(), op, ": grad_out must have v's shape ", v.sizes(), ", got ",
                    grad_out.sizes());
  TORCH_CHECK_VALUE(grad_out.device() == q.device(), op, ": grad_out must be on q's device ", q.device());
  if (!normalize) return;
  TORCH_CHECK_VALUE(out.sizes() == v.sizes(), op, ": out must have v's shape ", v.sizes(), ", got ", out.sizes());
  TORCH_CHECK_VALUE(denominator.dim() == 3 && denominator.size(0) == q.size(0) && denominator.size(1) == q.size(1) &&
                        denominator.size(2) == q.size(2),
                    op, ": denominator must be (B, H, N), got ", denominator.sizes());
  TORCH_CHECK_VALUE(out.device() == q.device() && denominator.device() == q.device(), op,
                    ": out and denominator must be on q's device ", q.device());
}

std::optional<based::backward_problem> plan_backward(const at::Tensor& grad_out, const at::Tensor& q,
                                                     const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                                     const at::Tensor& denominator, double eps, bool normalize) {
  const at::ScalarType dtype = q.scalar_type();
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return std::nullopt;
  if (grad_out.scalar_type() != dtype || (normalize && out.scalar_type() != dtype)) return std::nullopt;
  if (normalize && (denominator.scalar_type() != at::kFloat || !denominator.is_contiguous())) return std::nullopt;
  if (!tk::registration::runs_kernels(q) || q.numel() == 0 || v.numel() == 0) return std::nullopt;
  const auto qv = causal_linear::view_of(q), kv = causal_linear::view_of(k), vv = causal_linear::view_of(v),
             gv = causal_linear::view_of(grad_out);
  if (!qv || !kv || !vv || !gv) return std::nullopt;
  // Unnormalised, out is not read: v's view stands in for it.
  const auto ov = normalize ? causal_linear::view_of(out) : vv;
  if (!ov) return std::nullopt;
  based::backward_problem p{tk::registration::element_of(q), normalize, float(eps), *qv, *kv, *vv, *gv, *ov,
                            normalize ? denominator.data_ptr<float>() : nullptr,
                            nullptr, nullptr, nullptr, nullptr};
  if (!based::unsupported_reason(p).empty()) return std::nullopt;
  return p;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> based_attention_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& q,
                                                                        const at::Tensor& k, const at::Tensor& v,
                                                                        const at::Tensor& out,
                                                                        const at::Tensor& denominator, double eps,
                                                                        bool normalize) {
  check_backward_inputs(grad_out, q, k, v, out, denominator, eps, normalize);
  auto plan = plan_backward(grad_out, q, k, v, out, denominator, eps, normalize);
  if (!plan) {
    return tk::registration::fallback<&based_attention_bwd_cuda>("tk::based_attention_bwd_ref", grad_out, q, k, v, out, denominator, eps,
                                               normalize);
  }
  const auto contiguous = [](const at::Tensor& like) {
    return at::empty(like.sizes(), like.options().memory_format(at::MemoryFormat::Contiguous));
  };
  at::Tensor grad_q = contiguous(q), grad_k = contiguous(k), grad_v = contiguous(v);
  at::Tensor workspace = at::empty(
      {based::backward_workspace_floats(q.size(0), q.size(1), q.size(2), v.size(3), normalize)},
      q.options().dtype(at::kFloat));
  plan->grad_q = grad_q.data_ptr();
  plan->grad_k = grad_k.data_ptr();
  plan->grad_v = grad_v.data_ptr();
  plan->workspace = workspace.data_ptr<float>();
  tk::registration::launch_on(q, [&](cudaStream_t stream) { return based::launch(*plan, stream); });
  return {grad_q, grad_k, grad_v};
}

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) {
  m.impl("based_attention", &based_attention_cuda);
  m.impl("based_attention_bwd", &based_attention_bwd_cuda);
}
