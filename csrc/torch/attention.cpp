// CUDA kernels of tk::attention and tk::attention_bwd on the Hopper attention kernels, and of
// tk::attention_varlen and its backward on their packed variant (at the end).
//
// Each entry re-checks its arguments, describes q, k, v (and the gradients' inputs) to the kernels
// as they are stored (any strides with a unit last stride, so (B, N, H, D) views need no copy) and
// launches on the current stream. What the kernels cannot take (fp32/fp64, head dims other than
// 64/128 or differing between q, k and v, another GPU, strides TMA cannot describe) goes to the
// op's reference twin tk::<op>_ref, which warns once. The options window, softcap and sinks (the last
// four arguments of both ops, tk_ops/ops/attention.py) run on the forward and the backward kernels.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/attention/attention.h"
#include "kernel_support.h"
#include "registration.h"

namespace {

using tk::registration::element_of;
using tk::registration::fallback;
using tk::registration::launch_on;

namespace attn = tk::attention;

const tk::registration::kernel_support forward_head_dims("attention", "head_dims", attn::kernel_head_dims::integers());
const tk::registration::kernel_support backward_head_dims("attention_bwd", "head_dims",
                                                          attn::kernel_head_dims::integers());

void check_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK_VALUE(q.dim() == 4, op, ": q must be 4-D (B, Hq, Nq, D), got ", q.sizes());
  TORCH_CHECK_VALUE(k.dim() == 4, op, ": k must be 4-D (B, Hkv, Nk, D), got ", k.sizes());
  TORCH_CHECK_VALUE(v.dim() == 4, op, ": v must be 4-D (B, Hkv, Nk, Dv), got ", v.sizes());
  TORCH_CHECK_VALUE(k.device() == q.device() && v.device() == q.device(), op, ": k and v must be on q's device ",
                    q.device());
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), op,
                   ": k and v must have q's dtype ", q.scalar_type());
  TORCH_CHECK_VALUE(k.size(0) == q.size(0) && k.size(3) == q.size(3), op, ": k must be (", q.size(0), ", Hkv, Nk, ",
                    q.size(3), "), got ", k.sizes());
  TORCH_CHECK_VALUE(v.size(0) == k.size(0) && v.size(1) == k.size(1) && v.size(2) == k.size(2), op,
                    ": v must be (B, Hkv, Nk, Dv) = (", k.size(0), ", ", k.size(1), ", ", k.size(2), ", Dv), got ",
                    v.sizes());
  TORCH_CHECK_VALUE(k.size(1) > 0 && q.size(1) % k.size(1) == 0, op, ": q's head count Hq (", q.size(1),
                    ") must be a multiple of k's head count Hkv (", k.size(1), ")");
}

// The kernels' view of a (B, H, N, D) tensor, or nothing if its last stride is not unit.
std::optional<attn::heads_view> view_of(const at::Tensor& t) {
  if (t.stride(3) != 1 && t.size(3) > 1) return std::nullopt;
  return attn::heads_view{t.data_ptr(), t.size(0), t.size(1), t.size(2), t.size(3),
                          t.stride(0), t.stride(1), t.stride(2)};
}

bool kernel_device(const at::Tensor& t) {
  const at::ScalarType dtype = t.scalar_type();
  return (dtype == at::kBFloat16 || dtype == at::kHalf) && tk::registration::runs_kernels(t);
}

// Sinks the forward kernel reads as they are: (Hq,) fp32, contiguous, on q's device.
bool kernel_sinks(const at::Tensor& sinks, const at::Tensor& q) {
  return sinks.dim() == 1 && sinks.size(0) == q.size(1) && sinks.scalar_type() == at::kFloat &&
         sinks.device() == q.device() && sinks.is_contiguous();
}

// A problem's options as the op's arguments give them (sinks the caller has checked with kernel_sinks).
template <typename Problem>
void set_options(Problem& p, int64_t window_left, int64_t window_right, double softcap,
                 const std::optional<at::Tensor>& sinks) {
  p.window_left = window_left;
  p.window_right = window_right;
  p.softcap = softcap;
  p.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
}

std::optional<attn::forward_problem> plan_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  bool causal, double scale, int64_t window_left,
                                                  int64_t window_right, double softcap,
                                                  const std::optional<at::Tensor>& sinks) {
  if (!kernel_device(q) || q.numel() == 0 || k.numel() == 0) return std::nullopt;
  if (sinks.has_value() && !kernel_sinks(*sinks, q)) return std::nullopt;
  const auto qv = view_of(q), kv = view_of(k), vv = view_of(v);
  if (!qv || !kv || !vv) return std::nullopt;
  attn::forward_problem p{element_of(q), causal, float(scale), *qv, *kv, *vv, nullptr, nullptr};
  set_options(p, window_left, window_right, softcap, sinks);
  if (!attn::unsupported_reason(p).empty()) return std::nullopt;
  return p;
}

// `deterministic` only concerns the backward; the forward takes it so that autograd can hand it on.
std::tuple<at::Tensor, at::Tensor> attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  bool causal, double scale, bool deterministic, int64_t window_left,
                                                  int64_t window_right, double softcap,
                                                  const std::optional<at::Tensor>& sinks) {
  check_inputs("tk::attention", q, k, v);
  std::optional<attn::forward_problem> plan =
      plan_forward(q, k, v, causal, scale, window_left, window_right, softcap, sinks);
  if (!plan) {
    return fallback<&attention_cuda>("tk::attention_ref", q, k, v, causal, scale, deterministic, window_left,
                                     window_right, softcap, sinks);
  }
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  plan->out = out.data_ptr();
  plan->lse = lse.data_ptr<float>();
  launch_on(q, [&](cudaStream_t stream) { return attn::launch(*plan, stream); });
  return {out, lse};
}

// deterministic=True: the recompute method. Otherwise the faster method for the shape, unless the
// environment variable TK_OPS_ATTENTION_BACKWARD names one ("one_pass" or "recompute"; read on
// every call, for tests and benchmarks that compare the two).
attn::backward_method backward_method(bool deterministic) {
  if (deterministic) return attn::backward_method::recompute;
  const char* forced = std::getenv("TK_OPS_ATTENTION_BACKWARD");
  if (forced == nullptr || *forced == '\0') return attn::backward_method::fastest;
  const std::string name(forced);
  TORCH_CHECK_VALUE(name == "one_pass" || name == "recompute",
                    "TK_OPS_ATTENTION_BACKWARD must be one_pass or recompute (or unset), got ", name);
  return name == "one_pass" ? attn::backward_method::one_pass : attn::backward_method::recompute;
}

// The backward kernels on a plan: the gradients (in q's, k's and v's shapes, dense or packed) and the
// workspace allocated, lse and grad_lse made contiguous. grad_sinks, the fourth output, is an empty fp32
// tensor when the call has no sinks.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> launch_backward(
    attn::backward_problem plan, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& lse, const std::optional<at::Tensor>& sinks) {
  const at::Tensor lse_rows = lse.contiguous();
  const std::optional<at::Tensor> grad_lse_rows =
      grad_lse.has_value() ? std::optional<at::Tensor>(grad_lse->contiguous()) : std::nullopt;
  at::Tensor grad_q = at::empty(q.sizes(), q.options());
  at::Tensor grad_k = at::empty(k.sizes(), k.options());
  at::Tensor grad_v = at::empty(v.sizes(), v.options());
  at::Tensor grad_sinks = at::empty({sinks.has_value() ? q.size(1) : 0}, q.options().dtype(at::kFloat));
  at::Tensor workspace = at::empty({attn::backward_workspace_floats(plan)}, q.options().dtype(at::kFloat));
  plan.lse = lse_rows.data_ptr<float>();
  plan.grad_lse = grad_lse_rows.has_value() ? grad_lse_rows->data_ptr<float>() : nullptr;
  plan.grad_q = grad_q.data_ptr();
  plan.grad_k = grad_k.data_ptr();
  plan.grad_v = grad_v.data_ptr();
  plan.workspace = workspace.data_ptr<float>();
  plan.grad_sinks = sinks.has_value() ? grad_sinks.data_ptr<float>() : nullptr;
  launch_on(q, [&](cudaStream_t stream) { return attn::launch(plan, stream); });
  return {grad_q, grad_k, grad_v, grad_sinks};
}

// grad_sinks is an empty fp32 tensor when the call has no sinks (launch_backward).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_bwd_cuda(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, bool causal, double scale, bool deterministic,
    int64_t window_left, int64_t window_right, double softcap, const std::optional<at::Tensor>& sinks) {
  check_inputs("tk::attention_bwd", q, k, v);
  const std::vector<int64_t> out_shape{q.size(0), q.size(1), q.size(2), v.size(3)};
  TORCH_CHECK_VALUE(out.sizes() == out_shape, "tk::attention_bwd: out must be ", out_shape, ", got ", out.sizes());
  TORCH_CHECK_VALUE(grad_out.sizes() == out_shape, "tk::attention_bwd: grad_out must be ", out_shape, ", got ",
                    grad_out.sizes());
  TORCH_CHECK_VALUE(lse.sizes() == q.sizes().slice(0, 3), "tk::attention_bwd: lse must be ", q.sizes().slice(0, 3),
                    ", got ", lse.sizes());
  TORCH_CHECK_VALUE(!grad_lse.has_value() || grad_lse->sizes() == lse.sizes(),
                    "tk::attention_bwd: grad_lse must have lse's shape ", lse.sizes());
  for (const at::Tensor* t : {&grad_out, &out, &lse}) {
    TORCH_CHECK_VALUE(t->device() == q.device(), "tk::attention_bwd: every tensor must be on q's device ", q.device());
  }

  std::optional<attn::backward_problem> plan;
  const bool statistics_fp32 =
      lse.scalar_type() == at::kFloat && (!grad_lse.has_value() || grad_lse->scalar_type() == at::kFloat);
  if (kernel_device(q) && q.numel() > 0 && k.numel() > 0 && statistics_fp32 &&
      grad_out.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type() &&
      (!sinks.has_value() || kernel_sinks(*sinks, q))) {
    const auto qv = view_of(q), kv = view_of(k), vv = view_of(v), ov = view_of(out), gv = view_of(grad_out);
    if (qv && kv && vv && ov && gv) {
      attn::backward_problem p{element_of(q), causal, float(scale), *qv, *kv, *vv, *ov, *gv,
                               nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, backward_method(deterministic)};
      set_options(p, window_left, window_right, softcap, sinks);
      if (attn::unsupported_reason(p).empty()) plan = p;
    }
  }
  if (!plan) {
    return fallback<&attention_bwd_cuda>("tk::attention_bwd_ref", grad_out, grad_lse, q, k, v, out, lse, causal, scale,
                                         deterministic, window_left, window_right, softcap, sinks);
  }

  return launch_backward(*plan, grad_lse, q, k, v, lse, sinks);
}

// ------------------------------------------------------------------------ packed sequences (varlen)
//
// tk::attention_varlen and its backward on the kernels' packed variant: one launch walks every
// (sequence, head, block) task, the kernels reading cu_seqlens on the device. The contents of cu_seqlens
// are not read on the host (a device sync on every call, and no CUDA-graph capture); as with
// FlashAttention they are the caller's contract (tk_ops.attention_varlen checks them where that is free:
// CPU tensors in eager mode), and the kernels clamp what they read to the packed tensors, so that no
// content makes them read or write outside them.

void check_packed_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                         int64_t max_seqlen_k) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, op,
                    ": q, k and v must be packed (total, H, D), got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK_VALUE(cu_seqlens_q.dim() == 1 && cu_seqlens_k.dim() == 1 && cu_seqlens_q.numel() >= 2 &&
                        cu_seqlens_q.numel() == cu_seqlens_k.numel(),
                    op, ": cu_seqlens_q and cu_seqlens_k must be (B + 1,) alike, got ", cu_seqlens_q.sizes(), " and ",
                    cu_seqlens_k.sizes());
  TORCH_CHECK_VALUE(max_seqlen_q >= 1 && max_seqlen_k >= 1, op, ": max_seqlen_q and max_seqlen_k must be at least 1");
}

// The kernels' view of a packed (total, H, X) tensor: (1, H, total, X), or nothing if its last stride is
// not unit.
std::optional<attn::heads_view> packed_view_of(const at::Tensor& t) {
  if (t.stride(2) != 1 && t.size(2) > 1) return std::nullopt;
  return attn::heads_view{t.data_ptr(), 1, t.size(1), t.size(0), t.size(2), t.size(0) * t.stride(0), t.stride(1),
                          t.stride(0)};
}

// cu_seqlens as the kernels read them: int32, contiguous, on q's device (copied if they are not).
at::Tensor device_seqlens(const at::Tensor& cu_seqlens, const at::Tensor& q) {
  return cu_seqlens.to(q.device(), at::kInt).contiguous();
}

attn::packed_sequences packed_of(const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                 int64_t max_seqlen_k) {
  return {cu_seqlens_q.data_ptr<int>(), cu_seqlens_k.data_ptr<int>(), cu_seqlens_q.numel() - 1, max_seqlen_q,
          max_seqlen_k};
}

std::tuple<at::Tensor, at::Tensor> attention_varlen_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal, double scale,
    int64_t window_left, int64_t window_right, double softcap, const std::optional<at::Tensor>& sinks,
    bool deterministic) {
  check_packed_inputs("tk::attention_varlen", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  const at::Tensor cu_q = device_seqlens(cu_seqlens_q, q), cu_k = device_seqlens(cu_seqlens_k, q);
  std::optional<attn::forward_problem> plan;
  if (kernel_device(q) && q.size(0) > 0 && k.size(0) > 0 && (!sinks.has_value() || kernel_sinks(*sinks, q))) {
    const auto qv = packed_view_of(q), kv = packed_view_of(k), vv = packed_view_of(v);
    if (qv && kv && vv) {
      attn::forward_problem p{element_of(q), causal, float(scale), *qv, *kv, *vv, nullptr, nullptr};
      set_options(p, window_left, window_right, softcap, sinks);
      p.packed = packed_of(cu_q, cu_k, max_seqlen_q, max_seqlen_k);
      if (attn::unsupported_reason(p).empty()) plan = p;
    }
  }
  if (!plan) {
    return fallback<&attention_varlen_cuda>("tk::attention_varlen_ref", q, k, v, cu_seqlens_q, cu_seqlens_k,
                                            max_seqlen_q, max_seqlen_k, causal, scale, window_left, window_right,
                                            softcap, sinks, deterministic);
  }
  at::Tensor out = at::empty({q.size(0), q.size(1), v.size(2)}, q.options());
  at::Tensor lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  plan->out = out.data_ptr();
  plan->lse = lse.data_ptr<float>();
  launch_on(q, [&](cudaStream_t stream) { return attn::launch(*plan, stream); });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_varlen_bwd_cuda(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal, double scale,
    int64_t window_left, int64_t window_right, double softcap, const std::optional<at::Tensor>& sinks,
    bool deterministic) {
  check_packed_inputs("tk::attention_varlen_bwd", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  const std::vector<int64_t> out_shape{q.size(0), q.size(1), v.size(2)};
  TORCH_CHECK_VALUE(out.sizes() == out_shape && grad_out.sizes() == out_shape, "tk::attention_varlen_bwd: out and ",
                    "grad_out must be ", out_shape, ", got ", out.sizes(), " and ", grad_out.sizes());
  const std::vector<int64_t> lse_shape{q.size(1), q.size(0)};
  TORCH_CHECK_VALUE(lse.sizes() == lse_shape && (!grad_lse.has_value() || grad_lse->sizes() == lse_shape),
                    "tk::attention_varlen_bwd: lse and grad_lse must be ", lse_shape);
  const at::Tensor cu_q = device_seqlens(cu_seqlens_q, q), cu_k = device_seqlens(cu_seqlens_k, q);
  std::optional<attn::backward_problem> plan;
  const bool statistics_fp32 =
      lse.scalar_type() == at::kFloat && (!grad_lse.has_value() || grad_lse->scalar_type() == at::kFloat);
  if (kernel_device(q) && q.size(0) > 0 && k.size(0) > 0 && statistics_fp32 &&
      grad_out.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type() &&
      grad_out.device() == q.device() && out.device() == q.device() && lse.device() == q.device() &&
      (!sinks.has_value() || kernel_sinks(*sinks, q))) {
    const auto qv = packed_view_of(q), kv = packed_view_of(k), vv = packed_view_of(v), ov = packed_view_of(out),
               gv = packed_view_of(grad_out);
    if (qv && kv && vv && ov && gv) {
      attn::backward_problem p{element_of(q), causal, float(scale), *qv, *kv, *vv, *ov, *gv,
                               nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, backward_method(deterministic)};
      set_options(p, window_left, window_right, softcap, sinks);
      p.packed = packed_of(cu_q, cu_k, max_seqlen_q, max_seqlen_k);
      if (attn::unsupported_reason(p).empty()) plan = p;
    }
  }
  if (!plan) {
    return fallback<&attention_varlen_bwd_cuda>("tk::attention_varlen_bwd_ref", grad_out, grad_lse, q, k, v, out, lse,
                                                cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                                                window_left, window_right, softcap, sinks, deterministic);
  }
  return launch_backward(*plan, grad_lse, q, k, v, lse, sinks);
}

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) {
  m.impl("attention", &attention_cuda);
  m.impl("attention_bwd", &attention_bwd_cuda);
  m.impl("attention_varlen", &attention_varlen_cuda);
  m.impl("attention_varlen_bwd", &attention_varlen_bwd_cuda);
}
