// What the CUDA impls of the chunked causal linear attention forwards (tk::based_attention,
// tk::linear_attention) share: the argument checks, the kernels' view of q, k, v as they are stored
// (any strides with a unit last stride, so (B, N, H, F) views need no copy), the outputs and the
// launch. The caller sends what the kernel cannot take to its reference twin.
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

}  // namespace tk::causal_linear
