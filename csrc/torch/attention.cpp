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
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/attention/attention.h"
#include "kernels/attention/kvcache.h"
#include "kernel_support.h"
#include "registration.h"

namespace {

using tk::registration::element_of;
using tk::registration::fallback;
using tk::registration::launch_on;

namespace attn = tk::attention;

const tk::registration::kernel_support forward_head_dims("attention", "head_dims", attn::forward_head_dims::integers());
const tk::registration::kernel_support backward_head_dims("attention_bwd", "head_dims",
                                                          attn::backward_head_dims::integers());
// attention_with_kvcache's kernel takes paged caches whose blocks hold a multiple of this many positions.
const tk::registration::kernel_support paged_block_multiple("attention_with_kvcache", "paged_block_multiple",
                                                            {attn::KEY_BLOCK_ALIGNMENT});

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

// Sinks the forward kernel reads as they are: (heads,) fp32 for the op's query heads, contiguous, on q's device.
bool kernel_sinks(const at::Tensor& sinks, const at::Tensor& q, int64_t heads) {
  return sinks.dim() == 1 && sinks.size(0) == heads && sinks.scalar_type() == at::kFloat &&
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
  if (sinks.has_value() && !kernel_sinks(*sinks, q, q.size(1))) return std::nullopt;
  const auto qv = view_of(q), kv = view_of(k), vv = view_of(v);
  if (!qv || !kv || !vv) return std::nullopt;
  attn::forward_problem p{element_of(q), causal, float(scale), *qv, *kv, *vv, nullptr, nullptr};
  set_options(p, window_left, window_right, softcap, sinks);
  if (!attn::unsupported_reason(p).empty()) return std::nullopt;
  return p;
}

std::optional<std::tuple<at::Tensor, at::Tensor>> attention_with_kvcache_kernels(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const std::optional<at::Tensor>& k,
    const std::optional<at::Tensor>& v, const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& block_table,
    bool causal, double scale, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& sinks);

// One query row per head against many keys (a decoding step through tk.attention, e.g. Hugging Face's
// generate()) runs as a KV-cache call's decode form (attention_with_kvcache_kernels below): each KV head's
// query heads as one task's rows and split-KV, instead of a 128-row tile per query head with one row used.
// The keys are a cache every row of which is full: tokens-major k, v ((B, Nk, Hkv, D) memory, a model's
// transposed views) are a dense cache of B rows; head-major ones ((B, Hkv, Nk, D) contiguous, Hugging Face's
// caches) one of B x Hkv rows of one head, whose query heads G then share a row (sinks differ per head
// there: those calls keep the forward kernel). A window keeps it too (the decode form has no mask). Where
// the cache kernels cannot take the views (a stride or an address TMA refuses, a size past their limits),
// the call keeps the forward kernel or its reference: never the cache op's reference, which reads the
// lengths on the host (a sync, and no CUDA-graph capture).
constexpr int64_t DECODE_ROUTE_MIN_KEYS = 256;

std::optional<std::tuple<at::Tensor, at::Tensor>> attention_as_decode(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& sinks) {
  const int64_t batch = q.size(0), q_heads = q.size(1), kv_heads = k.size(1), keys = k.size(2), dim = q.size(3);
  // (the cache call's positions are int32: (rows + 1) x Nk must fit, rows = B or B x Hkv)
  const bool decoding = q.size(2) == 1 && keys >= DECODE_ROUTE_MIN_KEYS && window_left < 0 && window_right < 0 &&
                        (batch * kv_heads + 1) * keys <= std::numeric_limits<int>::max() &&
                        v.size(3) == dim && attn::forward_head_dims::contains(dim) && kernel_device(q) &&
                        (!sinks.has_value() || kernel_sinks(*sinks, q, q_heads));
  if (!decoding) return std::nullopt;
  const auto tokens_major = [&](const at::Tensor& t) { return t.stride(0) == keys * t.stride(2) && t.stride(3) == 1; };
  const auto head_major = [&](const at::Tensor& t) {
    return t.stride(0) == kv_heads * t.stride(1) && t.stride(1) == keys * t.stride(2) && t.stride(3) == 1;
  };
  const at::TensorOptions lengths = q.options().dtype(at::kInt);
  if (tokens_major(k) && tokens_major(v)) {
    const auto result = attention_with_kvcache_kernels(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), std::nullopt, std::nullopt,
        at::full({batch}, keys, lengths), std::nullopt, causal, scale, -1, -1, softcap, sinks);
    if (!result) return std::nullopt;
    const auto& [out, lse] = *result;
    return std::make_tuple(out.view({batch, q_heads, 1, dim}), lse);  // (B, 1, Hq, D) holds (B, Hq, 1, D)
  }
  if (head_major(k) && head_major(v) && !sinks.has_value()) {
    const int64_t group = q_heads / kv_heads;
    const auto result = attention_with_kvcache_kernels(
        q.reshape({batch * kv_heads, 1, group, dim}), k.flatten(0, 1).unsqueeze(2), v.flatten(0, 1).unsqueeze(2),
        std::nullopt, std::nullopt, at::full({batch * kv_heads}, keys, lengths), std::nullopt, causal, scale, -1, -1,
        softcap, std::nullopt);
    if (!result) return std::nullopt;
    const auto& [out, lse] = *result;
    return std::make_tuple(out.view({batch, q_heads, 1, dim}), lse.view({batch, q_heads, 1}));
  }
  return std::nullopt;
}

// `deterministic` only concerns the backward; the forward takes it so that autograd can hand it on.
std::tuple<at::Tensor, at::Tensor> attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  bool causal, double scale, bool deterministic, int64_t window_left,
                                                  int64_t window_right, double softcap,
                                                  const std::optional<at::Tensor>& sinks) {
  check_inputs("tk::attention", q, k, v);
  // Dv < D (MLA's (192, 128)): the kernel of head dim D on v zero-padded to D, out cut back to Dv (exact: the
  // padding's columns of P V are zero). Costs D / Dv the P V work and the copies.
  if (v.size(3) < q.size(3) && attn::forward_head_dims::contains(q.size(3)) && kernel_device(q)) {
    const auto [out, lse] = attention_cuda(q, k, at::constant_pad_nd(v, {0, q.size(3) - v.size(3)}), causal, scale,
                                           deterministic, window_left, window_right, softcap, sinks);
    return {out.narrow(3, 0, v.size(3)).contiguous(), lse};
  }
  if (auto decoded = attention_as_decode(q, k, v, causal, scale, window_left, window_right, softcap, sinks)) {
    return *decoded;
  }
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

// A head dim the forward kernel takes but the backward kernels are not instantiated for, below one they are
// (96: 128), runs them on copies zero-padded along D: the padding adds nothing to q k^T, dO v^T or
// rowsum(dO o), and its own gradients are zero, so the first D columns are the gradients. Costs the copies
// and (128 / 96 - 1) more work; the alternative is the reference. Nothing when D != Dv or no larger head dim
// exists. (Head dims no kernel takes, e.g. 80, keep the reference in both directions.)
std::optional<int64_t> padded_backward_head_dim(const at::Tensor& q, const at::Tensor& v) {
  const int64_t dim = q.size(3);
  if (v.size(3) != dim || attn::backward_head_dims::contains(dim) || !attn::forward_head_dims::contains(dim)) {
    return std::nullopt;
  }
  std::optional<int64_t> padded;
  for (const int64_t candidate : attn::backward_head_dims::integers()) {
    if (candidate > dim && (!padded || candidate < *padded)) padded = candidate;
  }
  return padded;
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
      (!sinks.has_value() || kernel_sinks(*sinks, q, q.size(1)))) {
    // (after the checks above: padding a wrong-sized out or grad_out would hide, or crop, it)
    // Dv < D (MLA's (192, 128)), as the forward: the kernels of head dim D on v, out and grad_out zero-padded
    // to D (the padding adds nothing to dO v^T or rowsum(dO o)), dv cut back to Dv (its padding columns are
    // P^T times dO's zero columns).
    if (v.size(3) < q.size(3) && attn::backward_head_dims::contains(q.size(3))) {
      const auto pad = [&](const at::Tensor& t) { return at::constant_pad_nd(t, {0, q.size(3) - t.size(3)}); };
      const auto [grad_q, grad_k, grad_v, grad_sinks] =
          attention_bwd_cuda(pad(grad_out), grad_lse, q, k, pad(v), pad(out), lse, causal, scale, deterministic,
                             window_left, window_right, softcap, sinks);
      return {grad_q, grad_k, grad_v.narrow(3, 0, v.size(3)).contiguous(), grad_sinks};
    }
    if (const auto padded = padded_backward_head_dim(q, v)) {
      const auto pad = [&](const at::Tensor& t) { return at::constant_pad_nd(t, {0, *padded - t.size(3)}); };
      const auto [grad_q, grad_k, grad_v, grad_sinks] =
          attention_bwd_cuda(pad(grad_out), grad_lse, pad(q), pad(k), pad(v), pad(out), lse, causal, scale,
                             deterministic, window_left, window_right, softcap, sinks);
      const auto cut = [&](const at::Tensor& t) { return t.narrow(3, 0, q.size(3)).contiguous(); };
      return {cut(grad_q), cut(grad_k), cut(grad_v), grad_sinks};
    }
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
  if (kernel_device(q) && q.size(0) > 0 && k.size(0) > 0 && (!sinks.has_value() || kernel_sinks(*sinks, q, q.size(1)))) {
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

// packed_sequences::statistics_start on the device (no sync): the backward's statistics rows of all sequences
// packed in each head, rather than every sequence given the longest's rows.
at::Tensor statistics_starts(const at::Tensor& cu_seqlens_q, int64_t max_seqlen_q, int64_t total_q) {
  const int64_t multiple = attn::STATISTICS_ROW_MULTIPLE;
  const at::Tensor rows = (cu_seqlens_q.slice(0, 1) - cu_seqlens_q.slice(0, 0, -1))
                              .to(at::kLong)
                              .clamp(0, std::min(max_seqlen_q, total_q));
  const at::Tensor padded = (rows + (multiple - 1)).div(multiple, "floor") * multiple;
  return at::cat({at::zeros({1}, padded.options()), padded.cumsum(0)}).to(at::kInt);
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
  const at::Tensor statistics_start = statistics_starts(cu_q, max_seqlen_q, q.size(0));
  std::optional<attn::backward_problem> plan;
  const bool statistics_fp32 =
      lse.scalar_type() == at::kFloat && (!grad_lse.has_value() || grad_lse->scalar_type() == at::kFloat);
  if (kernel_device(q) && q.size(0) > 0 && k.size(0) > 0 && statistics_fp32 &&
      grad_out.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type() &&
      grad_out.device() == q.device() && out.device() == q.device() && lse.device() == q.device() &&
      (!sinks.has_value() || kernel_sinks(*sinks, q, q.size(1)))) {
    const auto qv = packed_view_of(q), kv = packed_view_of(k), vv = packed_view_of(v), ov = packed_view_of(out),
               gv = packed_view_of(grad_out);
    if (qv && kv && vv && ov && gv) {
      attn::backward_problem p{element_of(q), causal, float(scale), *qv, *kv, *vv, *ov, *gv,
                               nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, backward_method(deterministic)};
      set_options(p, window_left, window_right, softcap, sinks);
      p.packed = packed_of(cu_q, cu_k, max_seqlen_q, max_seqlen_k);
      p.packed.statistics_start = statistics_start.data_ptr<int>();
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

// ------------------------------------------------------------------------------ KV cache (decoding)
//
// tk::attention_with_kvcache on the forward kernel's packed variant, for dense caches and paged ones in
// blocks of a multiple of 128 positions: the cache (B_cache, Nmax, Hkv, D) as packed rows, each sequence's
// span a row's Nmax slots (or a chunk of them) and its keys the first cache_seqlens[b] + Nnew of them
// (FlashAttention's seqused_k); the queries as below (kvcache_rows). One launch before the kernel appends
// k and v and writes the packed sequences' metadata (attn::launch_prepare; the decode form's chunks cut by
// every row's length there), one after it combines the decode form's chunks. Nothing is read on the host
// (no sync: a decode step can be captured in a CUDA graph). The contents of cache_seqlens are the caller's
// contract, as with FlashAttention: appended positions are clamped into the sequence's own row and the
// kernel's reads to the cache, so no content makes a call touch memory outside the caches.

// A dense cache (B_cache, Nmax, H, X), or a paged one (num_blocks, block_size, H, X), as packed rows
// (B_cache * Nmax or num_blocks * block_size, H, X), or nothing if its rows are not one stride apart.
std::optional<at::Tensor> cache_rows(const at::Tensor& cache) {
  if (cache.size(0) > 1 && cache.stride(0) != cache.size(1) * cache.stride(1)) return std::nullopt;
  return cache.as_strided({cache.size(0) * cache.size(1), cache.size(2), cache.size(3)},
                          {cache.stride(1), cache.stride(2), cache.stride(3)});
}

// How a call's queries meet the cache in the kernel (kernels/attention/kvcache.h has the two forms'
// packed sequences). Decode form (Nq <= DECODE_MAX_QUERIES and no window: every query sees the prefix of
// the keys, so its rows need no mask there): each K/V block is read once per KV head for its Nq x G
// query rows (G = Hq / Hkv) instead of once per query head; the cache rows are cut into chunks (split-KV),
// about target_chunks over the batch by the rows' lengths on the device (balanced; many rows: one chunk
// each), `sequences` the most any lengths make; with a causal mask the last Nq - 1 keys are a separate tail call. The chunks and the tail are
// combined by their lse afterwards, where the sinks (one per query head) join. Host arithmetic only: the
// rows themselves are made on the device (attn::launch_prepare).
struct kvcache_rows {
  int64_t sequences = 0, max_q = 0, target_chunks = 0, group = 1;
  int64_t tail = 0;  // the decode form's causal tail (kvcache.h): Nq - 1 keys, or none
  bool decode = false, balanced = false;
};

// A packed call's metadata in an int32 buffer, as the prepare kernel writes it: cu_seqlens_q and cu_seqlens_k
// (sequences + 1 each), then seqused_k (sequences).
constexpr int64_t packed_metadata_ints(int64_t sequences) { return 3 * sequences + 2; }

attn::packed_sequences packed_at(int* metadata, int64_t sequences, int64_t max_q, int64_t max_k) {
  return {metadata, metadata + sequences + 1, sequences, max_q, max_k, metadata + 2 * (sequences + 1)};
}

// The decode form takes at most this many queries per sequence (speculative decoding's draft tokens); longer
// query blocks (a chunked prefill) run per query head, where the work is the scores', not the reads'.
constexpr int64_t DECODE_MAX_QUERIES = 16;

kvcache_rows rows_for(const at::Tensor& q, int64_t kv_heads, int64_t capacity, bool decode, bool causal) {
  const int64_t batch = q.size(0), q_len = q.size(1), q_heads = q.size(2);
  kvcache_rows r;
  r.decode = decode;
  if (!decode) {
    r.sequences = batch;
    r.max_q = q_len;
    return r;
  }
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, q.get_device()));
  const attn::decode_split split = attn::decode_split_for(batch, kv_heads, capacity, sms);
  r.balanced = split.balanced;
  r.target_chunks = split.target_chunks;
  r.group = q_heads / kv_heads;
  r.sequences = split.sequences;
  r.max_q = r.group * q_len;
  r.tail = causal ? q_len - 1 : 0;
  return r;
}

// A (B, N, H, D) tensor as the kernels' (B, H, N, D) view, or nothing if its last stride is not unit.
std::optional<attn::heads_view> tokens_view_of(const at::Tensor& t) { return view_of(t.transpose(1, 2)); }

// The kernels' answer, or nothing where they cannot take the call (attention_with_kvcache_cuda then runs
// the reference; tk.attention's decode route its own forward instead).
std::optional<std::tuple<at::Tensor, at::Tensor>> attention_with_kvcache_kernels(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const std::optional<at::Tensor>& k,
    const std::optional<at::Tensor>& v, const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& block_table,
    bool causal, double scale, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& sinks) {
  std::optional<at::Tensor> k_rows, v_rows;
  // Paged caches whose blocks hold whole key blocks of the kernel (KEY_BLOCK_ALIGNMENT, attention.h).
  const bool paged = block_table.has_value();
  const bool kernel_layout =
      paged ? block_table->scalar_type() == at::kInt && block_table->dim() == 2 && block_table->size(0) == q.size(0) &&
                  block_table->device() == q.device() && k_cache.dim() == 4 && k_cache.size(1) > 0 &&
                  k_cache.size(1) % attn::KEY_BLOCK_ALIGNMENT == 0
            : k_cache.dim() == 4 && k_cache.size(0) >= q.size(0);
  const bool kernel_case = kernel_layout && q.dim() == 4 && v_cache.dim() == 4 && kernel_device(q) && q.numel() > 0 &&
                           k_cache.size(1) > 0 && k_cache.device() == q.device() && v_cache.device() == q.device() &&
                           k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type() &&
                           cache_seqlens.scalar_type() == at::kInt && cache_seqlens.dim() == 1 &&
                           cache_seqlens.size(0) == q.size(0) && cache_seqlens.device() == q.device() &&
                           (!sinks.has_value() || kernel_sinks(*sinks, q, q.size(2)));
  if (kernel_case) {
    k_rows = cache_rows(k_cache);
    v_rows = cache_rows(v_cache);
  }
  std::optional<attn::forward_problem> plan;
  const int64_t batch = q.size(0), q_len = q.size(1);
  // A sequence's positions: a dense row's slots, or its table row's pages (its logical cache).
  const int64_t capacity = paged && kernel_case ? block_table->size(1) * k_cache.size(1) : k_cache.size(1);
  const at::Tensor table = paged && kernel_case ? block_table->contiguous() : at::Tensor();
  const int64_t new_len = k.has_value() ? k->size(1) : 0;
  kvcache_rows rows;
  at::Tensor q_rows, metadata, k_tail, v_tail, tail_q_rows;
  // q with a unit last stride, as the decode form's prepare and its tail read it (a name, not a temporary:
  // the prepare launch reads it after the statement that takes its view)
  const at::Tensor q_unit = !kernel_case || q.stride(3) == 1 || q.size(3) <= 1 ? q : q.contiguous();
  std::optional<attn::forward_problem> tail_plan;
  // the metadata's positions are int32, as the kernels read them
  const bool int_positions = (batch + 1) * capacity <= std::numeric_limits<int>::max();
  if (k_rows && v_rows && int_positions) {
    const bool decode = q_len <= DECODE_MAX_QUERIES && window_left < 0 && window_right < 0;
    rows = rows_for(q, k_cache.size(2), capacity, decode, causal);
    const int64_t kv_heads = k_cache.size(2), tail_rows = batch * rows.tail;
    q_rows = decode ? at::empty({rows.sequences * rows.max_q, kv_heads, q.size(3)}, q.options())
                    : q.reshape({batch * q_len, q.size(2), q.size(3)});
    // the call's packed metadata, then the tail's (one sequence per batch row), then the decode form's chunk
    // offsets (batch + 1)
    const int64_t call_ints = packed_metadata_ints(rows.sequences);
    const int64_t tail_ints = rows.tail > 0 ? packed_metadata_ints(batch) : 0, chunk_offsets = decode ? batch + 1 : 0;
    metadata = at::empty({call_ints + tail_ints + chunk_offsets}, q.options().dtype(at::kInt));
    const auto qv = packed_view_of(q_rows), kv = packed_view_of(*k_rows), vv = packed_view_of(*v_rows);
    if (qv && kv && vv) {
      attn::forward_problem p{element_of(q), causal && !decode, float(scale), *qv, *kv, *vv, nullptr, nullptr};
      // the decode form joins the sinks in its combine
      set_options(p, window_left, window_right, softcap, decode ? std::nullopt : sinks);
      p.packed = packed_at(metadata.data_ptr<int>(), rows.sequences, rows.max_q, capacity);
      if (paged) {
        p.packed.page_table = table.data_ptr<int>();
        p.packed.table_rows = batch;
        p.packed.pages_per_row = table.size(1);
        p.packed.page_rows = k_cache.size(1);
        p.packed.pages = k_cache.size(0);
      }
      if (attn::unsupported_reason(p).empty()) plan = p;
    }
    if (plan && rows.tail > 0) {
      // The tail: each sequence's Nq query rows per query head, causal, against its last Nq - 1 keys.
      k_tail = at::empty({tail_rows, kv_heads, k_cache.size(3)}, q.options());
      v_tail = at::empty({tail_rows, kv_heads, v_cache.size(3)}, q.options());
      tail_q_rows = q_unit.reshape({batch * q_len, q.size(2), q.size(3)});
      const auto tqv = packed_view_of(tail_q_rows), tkv = packed_view_of(k_tail), tvv = packed_view_of(v_tail);
      if (tqv && tkv && tvv) {
        attn::forward_problem t{element_of(q), true, float(scale), *tqv, *tkv, *tvv, nullptr, nullptr};
        set_options(t, -1, -1, softcap, std::nullopt);
        t.packed = packed_at(metadata.data_ptr<int>() + call_ints, batch, q_len, rows.tail);
        if (attn::unsupported_reason(t).empty()) tail_plan = t;
      }
      // no tail, no decode form: the reference
      if (!tail_plan) plan.reset();
    }
  }
  if (!plan) return std::nullopt;
  // The append, the decode form's query rows and the metadata: one launch before the kernel's.
  const at::Tensor seqlens = cache_seqlens.contiguous();
  attn::kvcache_call call{element_of(q), batch, q.size(2), k_cache.size(2), q_len, capacity, seqlens.data_ptr<int>()};
  const at::Tensor k_new = new_len > 0 ? k->contiguous() : at::Tensor(), v_new = new_len > 0 ? v->contiguous() : at::Tensor();
  call.k_cache = plan->k;
  call.v_cache = plan->v;
  call.k.dim = k_cache.size(3);
  call.v.dim = v_cache.size(3);
  if (new_len > 0) {
    call.new_len = new_len;
    call.k = *tokens_view_of(k_new);
    call.v = *tokens_view_of(v_new);
  }
  if (paged) {
    call.page_table = table.data_ptr<int>();
    call.pages_per_row = table.size(1);
    call.page_rows = k_cache.size(1);
    call.pages = k_cache.size(0);
  }
  call.sequences = rows.sequences;
  call.decode = rows.decode;
  call.balanced = rows.balanced;
  call.target_chunks = rows.target_chunks;
  if (tail_plan) {
    call.tail = rows.tail;
    call.k_tail = k_tail.data_ptr();
    call.v_tail = v_tail.data_ptr();
    call.tail_cu_seqlens_q = const_cast<int*>(tail_plan->packed.cu_seqlens_q);
    call.tail_cu_seqlens_k = const_cast<int*>(tail_plan->packed.cu_seqlens_k);
    call.tail_seqused_k = const_cast<int*>(tail_plan->packed.seqused_k);
  }
  if (rows.decode) {
    call.q = *tokens_view_of(q_unit);
    call.q_rows = q_rows.data_ptr();
  }
  call.cu_seqlens_q = const_cast<int*>(plan->packed.cu_seqlens_q);
  call.cu_seqlens_k = const_cast<int*>(plan->packed.cu_seqlens_k);
  call.seqused_k = const_cast<int*>(plan->packed.seqused_k);
  if (rows.decode) call.chunk_offsets = metadata.data_ptr<int>() + metadata.numel() - (batch + 1);
  const int64_t heads = q_rows.size(1), total = q_rows.size(0), value_dim = v_cache.size(3);
  at::Tensor out = at::empty({total, heads, value_dim}, q.options());
  at::Tensor lse = at::empty({heads, total}, q.options().dtype(at::kFloat));
  plan->out = out.data_ptr();
  plan->lse = lse.data_ptr<float>();
  at::Tensor tail_out, tail_lse;
  if (tail_plan) {
    tail_out = at::empty({batch * q_len, q.size(2), value_dim}, q.options());
    tail_lse = at::empty({q.size(2), batch * q_len}, q.options().dtype(at::kFloat));
    tail_plan->out = tail_out.data_ptr();
    tail_plan->lse = tail_lse.data_ptr<float>();
  }
  launch_on(q, [&](cudaStream_t stream) {
    cudaError_t error = attn::launch_prepare(call, stream);
    if (error == cudaSuccess) error = attn::launch(*plan, stream);
    if (error == cudaSuccess && tail_plan) error = attn::launch(*tail_plan, stream);
    return error;
  });
  if (!rows.decode) {
    return std::make_tuple(out.view({batch, q_len, heads, value_dim}),
                           lse.view({heads, batch, q_len}).permute({1, 0, 2}).contiguous());
  }
  at::Tensor combined = at::empty({batch, q_len, q.size(2), value_dim}, q.options());
  at::Tensor combined_lse = at::empty({batch, q.size(2), q_len}, q.options().dtype(at::kFloat));
  attn::kvcache_combine combine{element_of(q), batch, q_len, q.size(2), k_cache.size(2), value_dim,
                                rows.sequences, call.chunk_offsets, out.data_ptr(), lse.data_ptr<float>()};
  if (tail_plan) {
    combine.tail_out = tail_out.data_ptr();
    combine.tail_lse = tail_lse.data_ptr<float>();
  }
  combine.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  combine.out = combined.data_ptr();
  combine.lse = combined_lse.data_ptr<float>();
  launch_on(q, [&](cudaStream_t stream) { return attn::launch_combine(combine, stream); });
  return std::make_tuple(combined, combined_lse);
}

std::tuple<at::Tensor, at::Tensor> attention_with_kvcache_cuda(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const std::optional<at::Tensor>& k,
    const std::optional<at::Tensor>& v, const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& block_table,
    bool causal, double scale, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& sinks) {
  if (auto result = attention_with_kvcache_kernels(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal,
                                                   scale, window_left, window_right, softcap, sinks)) {
    return *std::move(result);
  }
  return fallback<&attention_with_kvcache_cuda>("tk::attention_with_kvcache_ref", q, k_cache, v_cache, k, v,
                                                cache_seqlens, block_table, causal, scale, window_left, window_right,
                                                softcap, sinks);
}

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) {
  m.impl("attention", &attention_cuda);
  m.impl("attention_bwd", &attention_bwd_cuda);
  m.impl("attention_varlen", &attention_varlen_cuda);
  m.impl("attention_varlen_bwd", &attention_varlen_bwd_cuda);
  m.impl("attention_with_kvcache", &attention_with_kvcache_cuda);
}
