// CUDA kernels of tk::gated_delta_rule (the forward; csrc/kernels/gated_delta_rule): the recurrent one
// when no sequence is longer than RECURRENT_MAX_T (decoding), the chunked ones otherwise. The backward
// stays the reference (tk::gated_delta_rule_bwd, which recomputes from the inputs).
//
// The entry re-checks its arguments, describes q, k, v to the kernels as they are stored ((B, T, H, D)
// read as (B, H, T, D), any strides with a unit last stride), brings g and beta to contiguous fp32 and
// initial_state to contiguous, checks cu_seqlens' contents on the host (one device sync, as the
// reference, which raises the same ValueError) and launches on the current stream. A short problem
// the recurrent kernel cannot take (an initial_state view 8- but not 16-byte aligned) goes to the
// chunked ones. What neither takes (fp32/fp64, K or V other than 128 except K = V = 64 up to
// RECURRENT_MAX_T, rows that are not 16-byte aligned, an initial_state view that is not 8-byte aligned,
// another GPU, empty inputs) goes to the reference twin tk::gated_delta_rule_ref, which warns once.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels/gated_delta_rule/gated_delta_rule.h"
#include "registration.h"

namespace {

namespace gdn = tk::gdn;
using optional_tensor = std::optional<at::Tensor>;

constexpr const char* OP = "tk::gated_delta_rule";

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                  const at::Tensor& beta, const optional_tensor& initial_state, const optional_tensor& cu_seqlens) {
  TORCH_CHECK_VALUE(q.dim() == 4 && k.sizes() == q.sizes(), OP, ": q and k must be (B, T, Hk, K) alike, got ",
                    q.sizes(), " and ", k.sizes());
  TORCH_CHECK_VALUE(v.dim() == 4 && v.size(0) == q.size(0) && v.size(1) == q.size(1), OP,
                    ": v must be (B, T, Hv, V) with q's B, T, got ", v.sizes());
  TORCH_CHECK_VALUE(q.size(2) > 0 && v.size(2) % q.size(2) == 0, OP, ": Hv (", v.size(2),
                    ") must be a multiple of Hk (", q.size(2), ")");
  const std::vector<int64_t> gates{v.size(0), v.size(1), v.size(2)};
  TORCH_CHECK_VALUE(g.sizes() == at::IntArrayRef(gates) && beta.sizes() == at::IntArrayRef(gates), OP,
                    ": g and beta must be (B, T, Hv) = ", at::IntArrayRef(gates), ", got ", g.sizes(), " and ",
                    beta.sizes());
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), OP,
                   ": q, k, v must share one dtype");
  if (cu_seqlens) {
    TORCH_CHECK_VALUE(cu_seqlens->dim() == 1 && cu_seqlens->size(0) >= 2 && q.size(0) == 1, OP,
                      ": cu_seqlens must be (N + 1,) with N >= 1 and B = 1, got ", cu_seqlens->sizes());
    TORCH_CHECK_TYPE(cu_seqlens->scalar_type() == at::kInt, OP, ": cu_seqlens must be int32");
  }
  const int64_t states = cu_seqlens ? cu_seqlens->size(0) - 1 : q.size(0);
  if (initial_state) {
    const std::vector<int64_t> shape{states, v.size(2), k.size(3), v.size(3)};
    TORCH_CHECK_VALUE(initial_state->sizes() == at::IntArrayRef(shape), OP, ": initial_state must be ",
                      at::IntArrayRef(shape), " (N or B, Hv, K, V), got ", initial_state->sizes());
  }
  for (const optional_tensor& t : {optional_tensor(k), optional_tensor(v), optional_tensor(g), optional_tensor(beta),
                                   initial_state, cu_seqlens}) {
    if (t) TORCH_CHECK_VALUE(t->device() == q.device(), OP, ": every tensor must be on q's device ", q.device());
  }
}

// The kernel's (B, H, T, D) view of a (B, T, H, D) tensor, or nothing without a unit last stride.
std::optional<tk::heads_view> view_of(const at::Tensor& t) {
  if (t.stride(3) != 1 && t.size(3) > 1) return std::nullopt;
  return tk::heads_view{t.data_ptr(), t.size(0), t.size(2), t.size(1), t.size(3), t.stride(0), t.stride(2), t.stride(1)};
}

// cu_seqlens' values, checked as tk_ops.ops.gated_delta_rule.sequence_bounds checks them (same messages).
std::vector<int> checked_bounds(const at::Tensor& cu_seqlens, int64_t total) {
  const at::Tensor host = cu_seqlens.to(at::kCPU).contiguous();
  const int* values = host.data_ptr<int>();
  const int64_t count = host.size(0);
  TORCH_CHECK_VALUE(values[0] == 0, "cu_seqlens must start at 0, got ", values[0]);
  for (int64_t i = 0; i + 1 < count; ++i) {
    TORCH_CHECK_VALUE(values[i + 1] >= values[i], "cu_seqlens must be non-decreasing, got ", values[i], " then ",
                      values[i + 1], " at index ", i);
  }
  TORCH_CHECK_VALUE(values[count - 1] == total, "cu_seqlens must end at T = q.shape[1] (", total, "), got ",
                    values[count - 1]);
  return std::vector<int>(values, values + count);
}

std::tuple<at::Tensor, at::Tensor> gated_delta_rule_cuda(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v, const at::Tensor& g,
                                                         const at::Tensor& beta, double scale,
                                                         const optional_tensor& initial_state,
                                                         const optional_tensor& cu_seqlens, bool use_qk_l2norm) {
  check_inputs(q, k, v, g, beta, initial_state, cu_seqlens);
  const auto fallback = [&] {
    return tk::registration::fallback<&gated_delta_rule_cuda>("tk::gated_delta_rule_ref", q, k, v, g, beta, scale,
                                                               initial_state, cu_seqlens, use_qk_l2norm);
  };
  const at::ScalarType dtype = q.scalar_type();
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return fallback();
  if (!tk::registration::runs_kernels(q) || q.numel() == 0 || v.numel() == 0) return fallback();
  if (initial_state && initial_state->scalar_type() != at::kFloat) return fallback();
  const auto qv = view_of(q), kv = view_of(k), vv = view_of(v);
  if (!qv || !kv || !vv) return fallback();

  gdn::forward_problem p{};
  p.dtype = tk::registration::element_of(q);
  p.q = *qv;
  p.k = *kv;
  p.v = *vv;
  const std::optional<at::Tensor> initial = initial_state ? std::optional(initial_state->contiguous()) : std::nullopt;
  p.initial_state = initial ? initial->data_ptr<float>() : nullptr;
  const bool recurrent_takes = gdn::recurrent_unsupported_reason(p).empty();
  const bool chunked_takes = gdn::unsupported_reason(p).empty();
  if (!recurrent_takes && !chunked_takes) return fallback();

  const int64_t seq_len = q.size(1), value_heads = v.size(2);
  const std::vector<int> bounds = cu_seqlens ? checked_bounds(*cu_seqlens, seq_len) : std::vector<int>{};
  int64_t longest = seq_len;
  if (cu_seqlens) {
    longest = 0;
    for (size_t n = 0; n + 1 < bounds.size(); ++n) longest = std::max<int64_t>(longest, bounds[n + 1] - bounds[n]);
  }
  const bool recurrent = recurrent_takes && longest <= gdn::RECURRENT_MAX_T;
  if (!recurrent && !chunked_takes) return fallback();

  const at::Tensor g32 = g.to(at::kFloat).contiguous(), beta32 = beta.to(at::kFloat).contiguous();
  p.g = g32.data_ptr<float>();
  p.beta = beta32.data_ptr<float>();
  p.scale = float(scale);
  p.l2norm = use_qk_l2norm;
  p.sequences = int(cu_seqlens ? bounds.size() - 1 : q.size(0));

  const at::TensorOptions ints = at::TensorOptions().dtype(at::kInt);
  at::Tensor device_bounds, device_first_chunks;
  if (cu_seqlens) {
    device_bounds = at::tensor(bounds, ints).to(q.device());
    p.cu_seqlens = device_bounds.data_ptr<int>();
  }
  at::Tensor o = at::empty(v.sizes(), v.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor final_state = at::empty({p.sequences, value_heads, k.size(3), v.size(3)}, q.options().dtype(at::kFloat));
  p.o = o.data_ptr();
  p.final_state = final_state.data_ptr<float>();
  if (recurrent) {
    tk::registration::launch_on(q, [&](cudaStream_t stream) { return gdn::launch_recurrent(p, stream); });
    return {o, final_state};
  }

  if (cu_seqlens) {
    std::vector<int> first_chunks(bounds.size(), 0);
    for (size_t n = 0; n + 1 < bounds.size(); ++n) {
      first_chunks[n + 1] = first_chunks[n] + (bounds[n + 1] - bounds[n] + gdn::CHUNK - 1) / gdn::CHUNK;
    }
    device_first_chunks = at::tensor(first_chunks, ints).to(q.device());
    p.first_chunks = device_first_chunks.data_ptr<int>();
    p.chunks = first_chunks.back();
  } else {
    p.chunks = q.size(0) * ((seq_len + gdn::CHUNK - 1) / gdn::CHUNK);
  }
  at::Tensor workspace = at::empty({gdn::workspace_bytes(p.chunks, k.size(2), value_heads, k.size(3), v.size(3))},
                                   q.options().dtype(at::kByte));
  p.workspace = workspace.data_ptr();
  tk::registration::launch_on(q, [&](cudaStream_t stream) { return gdn::launch(p, stream); });
  return {o, final_state};
}

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) { m.impl("gated_delta_rule", &gated_delta_rule_cuda); }
