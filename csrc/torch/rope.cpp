// CUDA kernels of tk::rope, tk::rope_bwd, tk::rope_qk and tk::rope_qk_bwd on one RoPE kernel.
//
// Each entry re-checks its arguments, describes the tensors to the kernel as they are stored (any
// batch, head and position strides with a unit channel stride; tables shared by the batch or not)
// and launches on the current stream, q and k in one launch. What the kernel cannot take (fp64,
// another GPU, a non-unit channel stride) goes to the op's reference twin tk::<op>_ref, which warns
// once.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "kernels/rope/rope.h"
#include "registration.h"

namespace {

using tk::registration::element_of;
using tk::registration::fallback;
using tk::registration::launch_on;

namespace rope = tk::rope;

struct named_tensor {
  const char* name;
  const at::Tensor& tensor;
};

// x (or q and k) are (B, H, N, D) with shared B, N, D, dtype and device; cos and sin are
// (Bc, N, R/2) or, not interleaved, (Bc, N, D), Bc in {1, B}, in x's dtype or fp32.
void check_inputs(const char* op, const std::vector<named_tensor>& xs, const at::Tensor& cos, const at::Tensor& sin,
                  bool interleaved) {
  const auto& [first_name, first] = xs.front();
  for (const auto& [name, x] : xs) {
    TORCH_CHECK_VALUE(x.dim() == 4, op, ": ", name, " must be 4-D (B, H, N, D), got ", x.sizes());
    TORCH_CHECK_VALUE(x.device() == first.device(), op, ": ", name, " must be on ", first_name, "'s device ",
                      first.device(), ", got ", x.device());
    TORCH_CHECK_TYPE(x.scalar_type() == first.scalar_type(), op, ": ", name, " must have ", first_name, "'s dtype ",
                     first.scalar_type(), ", got ", x.scalar_type());
    TORCH_CHECK_VALUE(x.size(0) == first.size(0) && x.size(2) == first.size(2) && x.size(3) == first.size(3), op,
                      ": ", name, " must be (B, H, N, D) with ", first_name, "'s B, N, D, got ", x.sizes(), " and ",
                      first.sizes());
  }
  const int64_t batch = first.size(0), seq_len = first.size(2), head_dim = first.size(3);
  TORCH_CHECK_VALUE(cos.dim() == 3, op, ": cos must be 3-D (Bc, N, R/2) or (Bc, N, D), got ", cos.sizes());
  TORCH_CHECK_VALUE(sin.sizes() == cos.sizes(), op, ": sin must have cos's shape ", cos.sizes(), ", got ",
                    sin.sizes());
  TORCH_CHECK_VALUE(cos.device() == first.device() && sin.device() == first.device(), op, ": cos and sin must be on ",
                    first_name, "'s device ", first.device());
  TORCH_CHECK_TYPE(sin.scalar_type() == cos.scalar_type(), op, ": sin must have cos's dtype ", cos.scalar_type(),
                   ", got ", sin.scalar_type());
  TORCH_CHECK_TYPE(cos.scalar_type() == first.scalar_type() || cos.scalar_type() == at::kFloat, op,
                   ": cos and sin must have ", first_name, "'s dtype ", first.scalar_type(), " or float32, got ",
                   cos.scalar_type());
  TORCH_CHECK_VALUE(cos.size(0) == 1 || cos.size(0) == batch, op, ": cos.shape[0] must be 1 or B = ", batch, ", got ",
                    cos.sizes());
  TORCH_CHECK_VALUE(cos.size(1) == seq_len, op, ": cos.shape[1] must equal N = ", seq_len, ", got ", cos.sizes());
  const int64_t width = cos.size(2);
  const bool full = !interleaved && width == head_dim && head_dim % 2 == 0;
  TORCH_CHECK_VALUE(full || 2 * width <= head_dim, op, ": cos.shape[2] must be R/2 with R <= D = ", head_dim,
                    (interleaved ? "" : ", or D when D is even"), ", got ", cos.sizes());
}

bool unit_channel_stride(const at::Tensor& t) { return t.size(-1) <= 1 || t.stride(-1) == 1; }

rope::table table_of(const at::Tensor& t) {
  return {t.data_ptr(), t.size(0) == 1 ? 0 : t.stride(0), t.stride(1)};
}

// The kernel's problem for the inputs with their outputs allocated, or nothing if it cannot run them.
std::optional<rope::problem> plan_rope(const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& outputs,
                                       const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                                       bool backward) {
  const at::Tensor& first = xs.front();
  // cos and sin have x's dtype or fp32 (check_inputs), so a kernel takes them when it takes x.
  if (!tk::registration::has_element_type(first) || !tk::registration::runs_kernels(first)) return std::nullopt;
  if (!unit_channel_stride(cos) || !unit_channel_stride(sin)) return std::nullopt;
  rope::problem p{};
  p.x_type = element_of(first);
  p.table_type = element_of(cos);
  p.tensor_count = int(xs.size());
  for (size_t t = 0; t < xs.size(); ++t) {
    const at::Tensor& x = xs[t];
    if (!unit_channel_stride(x)) return std::nullopt;
    p.tensors[t] = {x.data_ptr(), x.size(1), x.stride(0), x.stride(1), x.stride(2), outputs[t].data_ptr()};
  }
  p.batch = first.size(0);
  p.seq_len = first.size(2);
  p.head_dim = first.size(3);
  p.table_width = cos.size(2);
  p.interleaved = interleaved;
  p.backward = backward;
  p.cos = table_of(cos);
  p.sin = table_of(sin);
  if (!rope::unsupported_reason(p).empty()) return std::nullopt;
  return p;
}

// Rotate every tensor of xs with the kernel; nothing when it cannot (the caller runs the reference).
std::optional<std::vector<at::Tensor>> rotate(const std::vector<at::Tensor>& xs, const at::Tensor& cos,
                                              const at::Tensor& sin, bool interleaved, bool backward) {
  std::vector<at::Tensor> outputs;
  bool all_empty = true;
  for (const at::Tensor& x : xs) {
    outputs.push_back(at::empty(x.sizes(), x.options()));
    all_empty = all_empty && x.numel() == 0;
  }
  if (all_empty) return outputs;  // nothing to rotate, and no empty grid to launch
  const auto plan = plan_rope(xs, outputs, cos, sin, interleaved, backward);
  if (!plan) return std::nullopt;
  launch_on(xs.front(), [&](cudaStream_t stream) { return rope::launch(*plan, stream); });
  return outputs;
}

at::Tensor rope_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  check_inputs("tk::rope", {{"x", x}}, cos, sin, interleaved);
  if (auto out = rotate({x}, cos, sin, interleaved, /*backward=*/false)) return (*out)[0];
  return fallback<&rope_cuda>("tk::rope_ref", x, cos, sin, interleaved);
}

at::Tensor rope_bwd_cuda(const at::Tensor& grad, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  check_inputs("tk::rope_bwd", {{"grad", grad}}, cos, sin, interleaved);
  if (auto out = rotate({grad}, cos, sin, interleaved, /*backward=*/true)) return (*out)[0];
  return fallback<&rope_bwd_cuda>("tk::rope_bwd_ref", grad, cos, sin, interleaved);
}

std::tuple<at::Tensor, at::Tensor> rope_qk_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                const at::Tensor& sin, bool interleaved) {
  check_inputs("tk::rope_qk", {{"q", q}, {"k", k}}, cos, sin, interleaved);
  if (auto out = rotate({q, k}, cos, sin, interleaved, /*backward=*/false)) return {(*out)[0], (*out)[1]};
  return fallback<&rope_qk_cuda>("tk::rope_qk_ref", q, k, cos, sin, interleaved);
}

std::tuple<at::Tensor, at::Tensor> rope_qk_bwd_cuda(const at::Tensor& grad_q, const at::Tensor& grad_k,
                                                    const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  check_inputs("tk::rope_qk_bwd", {{"grad_q", grad_q}, {"grad_k", grad_k}}, cos, sin, interleaved);
  if (auto out = rotate({grad_q, grad_k}, cos, sin, interleaved, /*backward=*/true)) return {(*out)[0], (*out)[1]};
  return fallback<&rope_qk_bwd_cuda>("tk::rope_qk_bwd_ref", grad_q, grad_k, cos, sin, interleaved);
}

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) {
  m.impl("rope", &rope_cuda);
  m.impl("rope_bwd", &rope_bwd_cuda);
  m.impl("rope_qk", &rope_qk_cuda);
  m.impl("rope_qk_bwd", &rope_qk_bwd_cuda);
}
