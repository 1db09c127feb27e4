// CUDA kernels of tk::matmul, tk::matmul_bwd, tk::linear, tk::linear_bwd on the Hopper GEMM.
//
// Each entry re-checks its arguments, describes every operand to the kernel as it is stored
// (row- or column-major, so transposed views need no copy) and launches on the current stream.
// What the kernel cannot take (fp32/fp64, another GPU, strides TMA cannot describe, empty sizes)
// goes to the op's reference twin tk::<op>_ref, which warns once.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels/gemm/gemm.h"
#include "registration.h"

namespace {

using tk::registration::element_of;
using tk::registration::fallback;
using tk::registration::launch_on;

using tk::gemm::major;
using tk::gemm::problem;
using tk::gemm::stored_matrix;

struct stored_operand {
  stored_matrix matrix;
  major order;
};

// The ways the kernel can read a 2-D operand of logical shape (R, C): as stored row-major (unit
// stride along C) or column-major (unit stride along R). A dimension of size 1 has no meaningful
// stride, so it admits both. `c_is_k` says whether C is the operand's K dimension (true for A).
std::vector<stored_operand> stored_forms(const at::Tensor& t, bool c_is_k) {
  const int64_t r = t.size(0), c = t.size(1);
  std::vector<stored_operand> forms;
  if (t.stride(1) == 1 || c == 1) forms.push_back({{t.data_ptr(), r, c, t.stride(0)}, c_is_k ? major::k : major::mn});
  if (t.stride(0) == 1 || r == 1) forms.push_back({{t.data_ptr(), c, r, t.stride(1)}, c_is_k ? major::mn : major::k});
  return forms;
}

// The GEMM a (M x K) * b (K x N) (+ bias) as the kernel would run it, or nothing if it cannot.
std::optional<problem> plan_gemm(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias) {
  const at::ScalarType dtype = a.scalar_type();
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return std::nullopt;
  if (!tk::registration::runs_kernels(a)) return std::nullopt;
  if (bias.has_value() && bias->stride(0) != 1 && bias->size(0) > 1) return std::nullopt;
  for (const stored_operand& sa : stored_forms(a, /*c_is_k=*/true)) {
    for (const stored_operand& sb : stored_forms(b, /*c_is_k=*/false)) {
      problem p{element_of(a), a.size(0), b.size(1), a.size(1), sa.matrix, sa.order, sb.matrix, sb.order,
                nullptr, b.size(1), bias.has_value() ? bias->data_ptr() : nullptr};
      if (tk::gemm::unsupported_reason(p).empty()) return p;
    }
  }
  return std::nullopt;
}

// A gradient the kernel can read: stored row- or column-major, else a contiguous copy. Autograd
// hands the backward expanded gradients (out.sum().backward() gives ones with zero strides), which
// no TMA map describes; copying one costs far less than the reference GEMM it would otherwise take.
at::Tensor readable_gradient(const at::Tensor& grad) {
  const bool either_major = grad.stride(1) == 1 || grad.stride(0) == 1 || grad.size(0) == 1 || grad.size(1) == 1;
  return either_major ? grad : grad.contiguous();
}

at::Tensor run_gemm(problem p, const at::Tensor& like) {
  at::Tensor c = at::empty({p.m, p.n}, like.options());
  p.c = c.data_ptr();
  launch_on(like, [&](cudaStream_t stream) { return tk::gemm::launch(p, stream); });
  return c;
}

void check_operands(const char* op, const char* a_name, const at::Tensor& a, const char* b_name, const at::Tensor& b) {
  TORCH_CHECK_VALUE(a.dim() == 2, op, ": ", a_name, " must be 2-D, got ", a.sizes());
  TORCH_CHECK_VALUE(b.dim() == 2, op, ": ", b_name, " must be 2-D, got ", b.sizes());
  TORCH_CHECK_VALUE(a.device() == b.device(), op, ": ", b_name, " must be on ", a_name, "'s device ", a.device(),
                    ", got ", b.device());
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), op, ": ", b_name, " must have ", a_name, "'s dtype ",
                   a.scalar_type(), ", got ", b.scalar_type());
}

at::Tensor matmul_cuda(const at::Tensor& a, const at::Tensor& b) {
  check_operands("tk::matmul", "a", a, "b", b);
  TORCH_CHECK_VALUE(b.size(0) == a.size(1), "tk::matmul: b.shape[0] must equal a.shape[1] (K) = ", a.size(1),
                    ", got ", b.sizes());
  if (auto p = plan_gemm(a, b, std::nullopt)) return run_gemm(*p, a);
  return fallback<&matmul_cuda>("tk::matmul_ref", a, b);
}

std::tuple<at::Tensor, at::Tensor> matmul_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& a,
                                                   const at::Tensor& b, std::array<bool, 2> output_mask) {
  check_operands("tk::matmul_bwd", "a", a, "b", b);
  check_operands("tk::matmul_bwd", "grad", grad_out, "a", a);
  TORCH_CHECK_VALUE(grad_out.size(0) == a.size(0) && grad_out.size(1) == b.size(1) && b.size(0) == a.size(1),
                    "tk::matmul_bwd: grad must be (M, N) = (", a.size(0), ", ", b.size(1), ") for a ", a.sizes(),
                    " and b ", b.sizes(), ", got ", grad_out.sizes());
  const at::Tensor grad = readable_gradient(grad_out);
  // grad_a = grad * b^T and grad_b = a^T * grad: transposed views, read column-major.
  const auto plan_a = output_mask[0] ? plan_gemm(grad, b.t(), std::nullopt) : std::nullopt;
  const auto plan_b = output_mask[1] ? plan_gemm(a.t(), grad, std::nullopt) : std::nullopt;
  if (output_mask[0] != plan_a.has_value() || output_mask[1] != plan_b.has_value()) {
    return fallback<&matmul_bwd_cuda>("tk::matmul_bwd_ref", grad, a, b, output_mask);
  }
  return {plan_a ? run_gemm(*plan_a, a) : a.new_empty({0}), plan_b ? run_gemm(*plan_b, b) : b.new_empty({0})};
}

at::Tensor linear_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_operands("tk::linear", "x", x, "weight", weight);
  TORCH_CHECK_VALUE(weight.size(1) == x.size(1), "tk::linear: weight.shape[1] must equal x.shape[1] (in_features) = ",
                    x.size(1), ", got ", weight.sizes());
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0),
                      "tk::linear: bias must have shape (out_features,) = (", weight.size(0), ",), got ", bias->sizes());
    TORCH_CHECK_VALUE(bias->device() == x.device(), "tk::linear: bias must be on x's device ", x.device());
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), "tk::linear: bias must have x's dtype ", x.scalar_type());
  }
  // x * weight^T: the weight's transpose is a column-major view of it.
  if (auto p = plan_gemm(x, weight.t(), bias)) return run_gemm(*p, x);
  return fallback<&linear_cuda>("tk::linear_ref", x, weight, bias);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                                                               const at::Tensor& weight,
                                                               std::array<bool, 3> output_mask) {
  check_operands("tk::linear_bwd", "x", x, "weight", weight);
  check_operands("tk::linear_bwd", "grad", grad_out, "x", x);
  TORCH_CHECK_VALUE(
      grad_out.size(0) == x.size(0) && grad_out.size(1) == weight.size(0) && weight.size(1) == x.size(1),
      "tk::linear_bwd: grad must be (M, out_features) = (", x.size(0), ", ", weight.size(0), ") for x ", x.sizes(),
      " and weight ", weight.sizes(), ", got ", grad_out.sizes());
  const at::Tensor grad = readable_gradient(grad_out);
  // grad_x = grad * weight and grad_weight = grad^T * x.
  const auto plan_x = output_mask[0] ? plan_gemm(grad, weight, std::nullopt) : std::nullopt;
  const auto plan_w = output_mask[1] ? plan_gemm(grad.t(), x, std::nullopt) : std::nullopt;
  if (output_mask[0] != plan_x.has_value() || output_mask[1] != plan_w.has_value()) {
    return fallback<&linear_bwd_cuda>("tk::linear_bwd_ref", grad, x, weight, output_mask);
  }
  at::Tensor grad_bias =
      output_mask[2] ? grad.sum(0, /*keepdim=*/false, at::kFloat).to(grad.scalar_type()) : grad.new_empty({0});
  return {plan_x ? run_gemm(*plan_x, x) : x.new_empty({0}), plan_w ? run_gemm(*plan_w, weight) : weight.new_empty({0}),
          grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) {
  m.impl("matmul", &matmul_cuda);
  m.impl("matmul_bwd", &matmul_bwd_cuda);
  m.impl("linear", &linear_cuda);
  m.impl("linear_bwd", &linear_bwd_cuda);
}
