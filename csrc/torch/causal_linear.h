// What the CUDA impls of the chunked causal linear attentions (tk::based_attention,
// tk::linear_attention and their _bwd ops) share: the argument checks, the kernels' view of the
// tensors as they are stored (any strides with a unit last stride, so (B, N, H, F) views need no
// copy), the outputs, the backward's workspace and the launch. The caller sends what the kernels
// cannot take to its reference twin.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "kernels/common/causal_problem.h"
#include "registration.h"

namespace tk::causal_linear {

inline void check_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double eps) {
  for (const auto& [name, t] : {std::pair{"q", &q}, std::pair{"k", &k}, std::pair{"v", &v}}) {
    TORCH_CHECK_VALUE(t->dim() == 4, op, ": ", name, " must be 4-D (B, H, N, ", name[0] == 'v' ? "Dv" : "F",
                      "), got ", t->sizes());
    TORCH_CHECK_VALUE(t->device() == q.device(), op, ": ", name, " must be on q's device ", q.device());
    TORCH_CHECK_TYPE(t->scalar_type() == q.scalar_type(), op, ": ", name, " must have q's dtype ", q.scalar_type());
  }
  TORCH_CHECK_VALUE(k.sizes() == q.sizes(), op, ": k must have q's shape ", q.sizes(), ", got ", k.sizes());
  TORCH_CHECK_VALUE(v.size(0) == q.size(0) && v.size(1) == q.size(1) && v.size(2) == q.size(2), op,
                    ": v must be (B, H, N, Dv) with q's B, H, N, got ", v.sizes());
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, op, ": eps must be a finite number >= 0, got ", eps);
}

// The kernel's view of a (B, H, N, D) tensor, or nothing if its last stride is not unit.
inline std::optional<heads_view> view_of(const at::Tensor& t) {
  if (t.stride(3) != 1 && t.size(3) > 1) return std::nullopt;
  return heads_view{t.data_ptr(), t.size(0), t.size(1), t.size(2), t.size(3), t.stride(0), t.stride(1), t.stride(2)};
}

// The problem, if the kernel (whose checks are `unsupported_reason`) takes it; out and denominator
// are set by run_forward.
template <typename UnsupportedReason>
std::optional<causal_forward_problem> plan_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   double eps, bool normalize, UnsupportedReason&& unsupported_reason) {
  const at::ScalarType dtype = q.scalar_type();
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return std::nullopt;
  if (!registration::runs_kernels(q) || q.numel() == 0 || v.numel() == 0) return std::nullopt;
  const auto qv = view_of(q), kv = view_of(k), vv = view_of(v);
  if (!qv || !kv || !vv) return std::nullopt;
  causal_forward_problem p{registration::element_of(q), normalize, float(eps), *qv, *kv, *vv, nullptr, nullptr};
  if (!unsupported_reason(p).empty()) return std::nullopt;
  return p;
}

// Allocates (out, denominator) as the op returns them and launches `launch(problem, stream)`.
template <typename Launch>
std::tuple<at::Tensor, at::Tensor> run_forward(causal_forward_problem& plan, const at::Tensor& q, const at::Tensor& v,
                                               bool normalize, Launch&& launch) {
  at::Tensor out = at::empty(v.sizes(), v.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor denominator = normalize ? at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat))
                                     : at::empty({0}, q.options().dtype(at::kFloat));
  plan.out = out.data_ptr();
  plan.denominator = normalize ? denominator.data_ptr<float>() : nullptr;
  registration::launch_on(q, [&](cudaStream_t stream) { return launch(plan, stream); });
  return {out, denominator};
}

inline void check_backward_inputs(const char* op, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                  const at::Tensor& v, const at::Tensor& out, const at::Tensor& denominator, double eps,
                                  bool normalize) {
  check_inputs(op, q, k, v, eps);
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

// The backward problem, if the kernels (whose checks are `unsupported_reason`) take it; the
// gradients and the workspace are set by run_backward.
template <typename UnsupportedReason>
std::optional<causal_backward_problem> plan_backward(const at::Tensor& grad_out, const at::Tensor& q,
                                                     const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                                     const at::Tensor& denominator, double eps, bool normalize,
                                                     UnsupportedReason&& unsupported_reason) {
  const at::ScalarType dtype = q.scalar_type();
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return std::nullopt;
  if (grad_out.scalar_type() != dtype || (normalize && out.scalar_type() != dtype)) return std::nullopt;
  if (normalize && (denominator.scalar_type() != at::kFloat || !denominator.is_contiguous())) return std::nullopt;
  if (!registration::runs_kernels(q) || q.numel() == 0 || v.numel() == 0) return std::nullopt;
  const auto qv = view_of(q), kv = view_of(k), vv = view_of(v), gv = view_of(grad_out);
  if (!qv || !kv || !vv || !gv) return std::nullopt;
  // Unnormalised, out is not read: v's view stands in for it.
  const auto ov = normalize ? view_of(out) : vv;
  if (!ov) return std::nullopt;
  causal_backward_problem p{registration::element_of(q), normalize, float(eps), *qv, *kv, *vv, *gv, *ov,
                            normalize ? denominator.data_ptr<float>() : nullptr,
                            nullptr, nullptr, nullptr, nullptr};
  if (!unsupported_reason(p).empty()) return std::nullopt;
  return p;
}

// Allocates (grad_q, grad_k, grad_v) contiguous and `workspace_floats` floats of workspace, and
// launches `launch(problem, stream)`.
template <typename Launch>
std::tuple<at::Tensor, at::Tensor, at::Tensor> run_backward(causal_backward_problem& plan, const at::Tensor& q,
                                                            const at::Tensor& k, const at::Tensor& v,
                                                            int64_t workspace_floats, Launch&& launch) {
  const auto contiguous = [](const at::Tensor& like) {
    return at::empty(like.sizes(), like.options().memory_format(at::MemoryFormat::Contiguous));
  };
  at::Tensor grad_q = contiguous(q), grad_k = contiguous(k), grad_v = contiguous(v);
  at::Tensor workspace = at::empty({workspace_floats}, q.options().dtype(at::kFloat));
  plan.grad_q = grad_q.data_ptr();
  plan.grad_k = grad_k.data_ptr();
  plan.grad_v = grad_v.data_ptr();
  plan.workspace = workspace.data_ptr<float>();
  registration::launch_on(q, [&](cudaStream_t stream) { return launch(plan, stream); });
  return {grad_q, grad_k, grad_v};
}

}  // namespace tk::causal_linear
