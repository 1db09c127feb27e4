// CUDA kernel of tk::based_attention (the forward) on the Hopper Based kernel.
//
// The entry re-checks its arguments, describes q, k, v to the kernel as they are stored (any
// strides with a unit last stride, so (B, N, H, F) views need no copy) and launches on the current
// stream. What the kernel cannot take (fp32/fp64, F other than 16, Dv not a multiple of 32 up to
// 256, another GPU, strides TMA cannot describe) goes to the reference twin tk::based_attention_ref,
// which warns once. tk::based_attention_bwd has no kernel yet: its reference serves every device.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <utility>

#include "kernels/based_attention/based_attention.h"
#include "registration.h"

namespace {

using tk::registration::element_of;
using tk::registration::fallback;
using tk::registration::launch_on;

namespace based = tk::based;

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double eps) {
  constexpr const char* op = "tk::based_attention";
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
std::optional<tk::heads_view> view_of(const at::Tensor& t) {
  if (t.stride(3) != 1 && t.size(3) > 1) return std::nullopt;
  return tk::heads_view{t.data_ptr(), t.size(0), t.size(1), t.size(2), t.size(3), t.stride(0), t.stride(1), t.stride(2)};
}

std::optional<based::forward_problem> plan_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   double eps, bool normalize) {
  const at::ScalarType dtype = q.scalar_type();
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return std::nullopt;
  if (!tk::registration::runs_kernels(q) || q.numel() == 0 || v.numel() == 0) return std::nullopt;
  const auto qv = view_of(q), kv = view_of(k), vv = view_of(v);
  if (!qv || !kv || !vv) return std::nullopt;
  based::forward_problem p{element_of(q), normalize, float(eps), *qv, *kv, *vv, nullptr, nullptr};
  if (!based::unsupported_reason(p).empty()) return std::nullopt;
  return p;
}

std::tuple<at::Tensor, at::Tensor> based_attention_cuda(const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& v, double eps, bool normalize) {
  check_inputs(q, k, v, eps);
  auto plan = plan_forward(q, k, v, eps, normalize);
  if (!plan) return fallback<&based_attention_cuda>("tk::based_attention_ref", q, k, v, eps, normalize);
  at::Tensor out = at::empty(v.sizes(), v.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor denominator = normalize ? at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat))
                                     : at::empty({0}, q.options().dtype(at::kFloat));
  plan->out = out.data_ptr();
  plan->denominator = normalize ? denominator.data_ptr<float>() : nullptr;
  launch_on(q, [&](cudaStream_t stream) { return based::launch(*plan, stream); });
  return {out, denominator};
}

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) { m.impl("based_attention", &based_attention_cuda); }
