// CUDA kernels of tk::attention and tk::attention_bwd on the Hopper attention kernels, and of
// tk::attention_varlen and its backward on the same kernels, sequence by sequence (at the end).
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

std::optional<attn::forward_problem> plan_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  bool causal, double scale, int64_t window_left,
                                                  int64_t window_right, double softcap,
                                                  const std::optional<at::Tensor>& sinks) {
  if (!kernel_device(q) || q.numel() == 0 || k.numel() == 0) return std::nullopt;
  if (sinks.has_value() && !kernel_sinks(*sinks, q)) return std::nullopt;
  const auto qv = view_of(q), kv = view_of(k), vv = view_of(v);
  if (!qv || !kv || !vv) return std::nullopt;
  attn::forward_problem p{element_of(q), causal, float(scale), *qv, *kv, *vv, nullptr, nullptr};
  p.window_left = window_left;
  p.window_right = window_right;
  p.softcap = softcap;
  p.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
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

// grad_sinks, the fourth output, is an empty fp32 tensor when the call has no sinks.
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
      p.window_left = window_left;
      p.window_right = window_right;
      p.softcap = softcap;
      p.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
      if (attn::unsupported_reason(p).empty()) plan = p;
    }
  }
  if (!plan) {
    return fallback<&attention_bwd_cuda>("tk::attention_bwd_ref", grad_out, grad_lse, q, k, v, out, lse, causal, scale,
                                         deterministic, window_left, window_right, softcap, sinks);
  }

  const at::Tensor lse_rows = lse.contiguous();
  const std::optional<at::Tensor> grad_lse_rows =
      grad_lse.has_value() ? std::optional<at::Tensor>(grad_lse->contiguous()) : std::nullopt;
  at::Tensor grad_q = at::empty(q.sizes(), q.options());
  at::Tensor grad_k = at::empty(k.sizes(), k.options());
  at::Tensor grad_v = at::empty(v.sizes(), v.options());
  at::Tensor grad_sinks = at::empty({sinks.has_value() ? q.size(1) : 0}, q.options().dtype(at::kFloat));
  at::Tensor workspace = at::empty({attn::backward_workspace_floats(*plan)}, q.options().dtype(at::kFloat));
  plan->lse = lse_rows.data_ptr<float>();
  plan->grad_lse = grad_lse_rows.has_value() ? grad_lse_rows->data_ptr<float>() : nullptr;
  plan->grad_q = grad_q.data_ptr();
  plan->grad_k = grad_k.data_ptr();
  plan->grad_v = grad_v.data_ptr();
  plan->workspace = workspace.data_ptr<float>();
  plan->grad_sinks = sinks.has_value() ? grad_sinks.data_ptr<float>() : nullptr;
  launch_on(q, [&](cudaStream_t stream) { return attn::launch(*plan, stream); });
  return {grad_q, grad_k, grad_v, grad_sinks};
}

// ------------------------------------------------------------------------ packed sequences (varlen)
//
// tk::attention_varlen and its backward on the same kernels, sequence by sequence: each sequence's rows
// of the packed (total, H, D) tensors seen as a (1, H, N, D) view (no copy), attention_cuda or
// attention_bwd_cuda on them (the kernels, or the reference for what they do not take, as for any dense
// call), and the results copied into the packed outputs. The lengths are read on the host: one device sync
// a call, so a call cannot be captured in a CUDA graph; and each sequence is a launch of its own, which
// leaves SMs idle on short sequences: a stopgap until the kernels' task orders walk cu_seqlens themselves.

// (start, stop) of each sequence of cu_seqlens, checked as tk_ops/ops/attention.py's sequence_bounds
// checks them (the same ValueErrors, so the reference and this entry reject the same contents).
std::vector<std::pair<int64_t, int64_t>> sequence_bounds(const std::string& name, const at::Tensor& cu_seqlens,
                                                         int64_t total, int64_t max_seqlen) {
  const at::Tensor host = cu_seqlens.to(at::kCPU, at::kLong).contiguous();
  const int64_t* values = host.data_ptr<int64_t>();
  const int64_t count = host.numel();
  TORCH_CHECK_VALUE(values[0] == 0, name, " must start at 0, got ", values[0]);
  std::vector<std::pair<int64_t, int64_t>> bounds;
  int64_t longest = 0;
  for (int64_t i = 0; i + 1 < count; ++i) {
    TORCH_CHECK_VALUE(values[i + 1] >= values[i], name, " must be non-decreasing, got ", values[i], " then ",
                      values[i + 1]);
    bounds.emplace_back(values[i], values[i + 1]);
    longest = std::max(longest, values[i + 1] - values[i]);
  }
  TORCH_CHECK_VALUE(values[count - 1] == total, name, " must end at the packed length ", total,
                    " (the first dimension), got ", values[count - 1]);
  const std::string max_name = "max_seqlen" + name.substr(std::string("cu_seqlens").size());
  TORCH_CHECK_VALUE(longest <= max_seqlen, max_name, " (", max_seqlen, ") must be at least the longest sequence of ",
                    name, " (", longest, ")");
  return bounds;
}

// Sequence b's rows [start, stop) of a packed (total, H, X) tensor as a (1, H, stop - start, X) view.
at::Tensor sequence_view(const at::Tensor& packed, std::pair<int64_t, int64_t> rows) {
  return packed.slice(0, rows.first, rows.second).transpose(0, 1).unsqueeze(0);
}

struct varlen_sequence {
  std::pair<int64_t, int64_t> q_rows, k_rows;
};

// The sequences with at least one query row (the others have no output and give no gradient).
std::vector<varlen_sequence> varlen_sequences(const char* op, const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                                              const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                              int64_t max_seqlen_k) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, op,
                    ": q, k and v must be packed (total, H, D), got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK_VALUE(cu_seqlens_q.dim() == 1 && cu_seqlens_k.dim() == 1 && cu_seqlens_q.numel() >= 2 &&
                        cu_seqlens_q.numel() == cu_seqlens_k.numel(),
                    op, ": cu_seqlens_q and cu_seqlens_k must be (B + 1,) alike, got ", cu_seqlens_q.sizes(), " and ",
                    cu_seqlens_k.sizes());
  const auto queries = sequence_bounds("cu_seqlens_q", cu_seqlens_q, q.size(0), max_seqlen_q);
  const auto keys = sequence_bounds("cu_seqlens_k", cu_seqlens_k, k.size(0), max_seqlen_k);
  std::vector<varlen_sequence> sequences;
  for (size_t b = 0; b < queries.size(); ++b) {
    if (queries[b].second > queries[b].first) sequences.push_back({queries[b], keys[b]});
  }
  return sequences;
}

std::tuple<at::Tensor, at::Tensor> attention_varlen_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal, double scale,
    int64_t window_left, int64_t window_right, double softcap, const std::optional<at::Tensor>& sinks,
    bool deterministic) {
  const auto sequences = varlen_sequences("tk::attention_varlen", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k);
  at::Tensor out = at::zeros({q.size(0), q.size(1), v.size(2)}, q.options());
  at::Tensor lse = at::full({q.size(1), q.size(0)}, -INFINITY, q.options().dtype(at::kFloat));
  for (const varlen_sequence& s : sequences) {
    auto [sequence_out, sequence_lse] =
        attention_cuda(sequence_view(q, s.q_rows), sequence_view(k, s.k_rows), sequence_view(v, s.k_rows), causal,
                       scale, deterministic, window_left, window_right, softcap, sinks);
    out.slice(0, s.q_rows.first, s.q_rows.second).copy_(sequence_out[0].transpose(0, 1));
    lse.slice(1, s.q_rows.first, s.q_rows.second).copy_(sequence_lse[0]);
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_varlen_bwd_cuda(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal, double scale,
    int64_t window_left, int64_t window_right, double softcap, const std::optional<at::Tensor>& sinks,
    bool deterministic) {
  const auto sequences = varlen_sequences("tk::attention_varlen_bwd", q, k, v, cu_seqlens_q, cu_seqlens_k,
                                          max_seqlen_q, max_seqlen_k);
  at::Tensor grad_q = at::zeros_like(q), grad_k = at::zeros_like(k), grad_v = at::zeros_like(v);
  at::Tensor grad_sinks = sinks.has_value() ? at::zeros_like(*sinks) : at::empty({0}, q.options().dtype(at::kFloat));
  for (const varlen_sequence& s : sequences) {
    const auto rows = [&](const at::Tensor& statistic) {  // (Hq, total) -> (1, Hq, N)
      return statistic.slice(1, s.q_rows.first, s.q_rows.second).unsqueeze(0);
    };
    const std::optional<at::Tensor> sequence_grad_lse =
        grad_lse.has_value() ? std::optional<at::Tensor>(rows(*grad_lse)) : std::nullopt;
    auto [dq, dk, dv, dsinks] = attention_bwd_cuda(
        sequence_view(grad_out, s.q_rows), sequence_grad_lse, sequence_view(q, s.q_rows), sequence_view(k, s.k_rows),
        sequence_view(v, s.k_rows), sequence_view(out, s.q_rows), rows(lse), causal, scale, deterministic, window_left,
        window_right, softcap, sinks);
    grad_q.slice(0, s.q_rows.first, s.q_rows.second).copy_(dq[0].transpose(0, 1));
    grad_k.slice(0, s.k_rows.first, s.k_rows.second).copy_(dk[0].transpose(0, 1));
    grad_v.slice(0, s.k_rows.first, s.k_rows.second).copy_(dv[0].transpose(0, 1));
    if (sinks.has_value()) grad_sinks.add_(dsinks);
  }
  return {grad_q, grad_k, grad_v, grad_sinks};
}

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) {
  m.impl("attention", &attention_cuda);
  m.impl("attention_bwd", &attention_bwd_cuda);
  m.impl("attention_varlen", &attention_varlen_cuda);
  m.impl("attention_varlen_bwd", &attention_varlen_bwd_cuda);
}
