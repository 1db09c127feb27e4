// CUDA kernels of tk::layer_norm, tk::layer_norm_bwd, tk::rms_norm and tk::rms_norm_bwd.
//
// Each entry re-checks its arguments, views every activation as (rows, hidden) with contiguous
// columns (a copy only for layouts without such a view), and launches on the current stream.
// What the kernels do not take goes to the op's reference twin tk::<op>_ref, which warns once:
// fp32/fp64 x, another GPU than sm_90, hidden sizes above the kernels' maximum (8192 for bf16/fp16
// rows that are 16-byte aligned, 2048 otherwise), empty tensors. The dropout seed is read by the
// kernels from device memory, so a launch never synchronises and can be captured in a CUDA graph.
#include <ATen/ATen.h>
#include <ATen/cuda/EmptyTensor.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

#include "kernels/norms/norms.h"
#include "registration.h"

namespace {

using tk::registration::element_of;
using tk::registration::fallback;
using tk::registration::launch_on;

using tk::norms::element_type;
using tk::norms::norm_kind;
using tk::norms::output_matrix;
using tk::norms::parameter;
using tk::norms::row_matrix;

using optional_tensor = std::optional<at::Tensor>;
using layer_norm_outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using rms_norm_outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

bool is_16bit(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf; }

// x's dtype or fp32: what the kernels take for a parameter or the residual stream.
bool x_or_fp32(const optional_tensor& t, at::ScalarType x) {
  return !t.has_value() || t->scalar_type() == x || t->scalar_type() == at::kFloat;
}

bool kernel_device(const at::Tensor& x) { return tk::registration::runs_kernels(x); }

// A tensor seen as (rows, hidden) with contiguous columns. A contiguous tensor is read in place
// (rows `hidden` apart: no view is made, which would cost a dispatched reshape per call); any
// other layout goes through a (rows, hidden) view where one exists, else a copy, kept in `held`.
struct rows_view {
  at::Tensor held;  // defined only when a view or copy was needed
  row_matrix matrix;
  int64_t rows;
};

row_matrix matrix_of(const at::Tensor& rows) {
  // A single row has no meaningful stride: give it one that keeps it aligned when it can be.
  const int64_t stride = rows.size(0) == 1 ? rows.size(1) : rows.stride(0);
  return {rows.data_ptr(), stride, element_of(rows)};
}

rows_view as_rows(const at::Tensor& t, int64_t hidden) {
  if (t.is_contiguous()) {
    // What the (rows, hidden) view of a contiguous tensor holds: rows `hidden` elements apart.
    return {at::Tensor(), {t.data_ptr(), hidden, element_of(t)}, t.numel() / hidden};
  }
  at::Tensor rows = t.reshape({-1, hidden});
  if (rows.stride(1) != 1 && hidden != 1) rows = rows.contiguous();
  return {rows, matrix_of(rows), rows.size(0)};
}

row_matrix rows_of(const rows_view& rows) { return rows.matrix; }

row_matrix rows_of(const std::optional<rows_view>& rows) {
  return rows.has_value() ? rows->matrix : row_matrix{nullptr, 0, element_type::bf16};
}

parameter parameter_of(const optional_tensor& t) {
  return t.has_value() ? parameter{t->data_ptr(), element_of(*t)} : parameter{nullptr, element_type::bf16};
}

output_matrix output_of(const at::Tensor& t, bool wanted) {
  return wanted ? output_matrix{t.data_ptr(), element_of(t)} : output_matrix{nullptr, element_type::bf16};
}

std::optional<at::Tensor> contiguous(const optional_tensor& t) {
  return t.has_value() ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt;
}

std::optional<rows_view> rows_or_none(const optional_tensor& t, int64_t hidden) {
  return t.has_value() ? std::optional<rows_view>(as_rows(*t, hidden)) : std::nullopt;
}

void check_parameter(const char* op, const char* name, const optional_tensor& t, const at::Tensor& x) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == x.size(-1), op, ": ", name, " must have shape (", x.size(-1),
                    ",) (x.shape[-1]), got ", t->sizes());
  TORCH_CHECK_VALUE(t->device() == x.device(), op, ": ", name, " must be on x's device ", x.device(), ", got ",
                    t->device());
}

void check_like(const char* op, const char* name, const optional_tensor& t, const at::Tensor& x, const char* x_name) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->sizes() == x.sizes(), op, ": ", name, " must have ", x_name, "'s shape ", x.sizes(), ", got ",
                    t->sizes());
  TORCH_CHECK_VALUE(t->device() == x.device(), op, ": ", name, " must be on ", x_name, "'s device ", x.device(),
                    ", got ", t->device());
}

void check_statistic(const char* op, const char* name, const at::Tensor& t, const at::Tensor& h) {
  TORCH_CHECK_VALUE(t.numel() * h.size(-1) == h.numel(), op, ": ", name, " must hold one value per row of h ",
                    h.sizes(), ", got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.device() == h.device(), op, ": ", name, " must be on h's device ", h.device());
}

void check_dropout(const char* op, const optional_tensor& seed, double dropout_p, const at::Tensor& x) {
  TORCH_CHECK_VALUE(dropout_p >= 0 && dropout_p < 1, op, ": dropout_p must be in [0, 1), got ", dropout_p);
  if (dropout_p == 0) return;
  TORCH_CHECK_VALUE(seed.has_value(), op, ": dropout_p > 0 needs a dropout_seed");
  TORCH_CHECK_TYPE(seed->scalar_type() == at::kLong, op, ": dropout_seed must be int64, got ", seed->scalar_type());
  TORCH_CHECK_VALUE(seed->numel() == 1, op, ": dropout_seed must hold one value, got shape ", seed->sizes());
  TORCH_CHECK_VALUE(seed->device() == x.device(), op, ": dropout_seed must be on x's device ", x.device(), ", got ",
                    seed->device());
}

const int64_t* seed_pointer(const optional_tensor& seed, double dropout_p) {
  return dropout_p > 0 ? seed->data_ptr<int64_t>() : nullptr;  // one element: at data_ptr whatever its strides
}

// A fresh contiguous tensor of `dtype` on `like`'s device, as at::empty(sizes, like.options().dtype(dtype)):
// taken from the CUDA caching allocator directly (at::detail::empty_cuda, what at::empty's CUDA kernel
// calls), which saves the dispatcher's hops (BackendSelect, then CUDA) on every output of every call.
// With torch.use_deterministic_algorithms and fill_uninitialized_memory on, at::empty fills fresh
// memory with NaN: then the dispatched at::empty runs, so that the fill happens as torch does it.
at::Tensor new_tensor(at::IntArrayRef sizes, at::ScalarType dtype, const at::Tensor& like) {
  const at::Context& context = at::globalContext();
  if (context.deterministicAlgorithms() && context.deterministicFillUninitializedMemory()) {
    return at::empty(sizes, like.options().dtype(dtype));
  }
  return at::Tensor(at::detail::empty_cuda(sizes, dtype, like.device(), std::nullopt));
}

at::Tensor new_like(const at::Tensor& like) { return new_tensor(like.sizes(), like.scalar_type(), like); }

// The empty tensor returned for an output that is not computed (like.new_empty({0})).
at::Tensor empty_output(const at::Tensor& like) { return new_tensor({0}, like.scalar_type(), like); }

at::Tensor statistic(const at::Tensor& x) { return new_tensor(x.sizes().slice(0, x.dim() - 1), at::kFloat, x); }

// ------------------------------------------------------------------------------------- forward

// One forward launch; `residual_or_none`, `bias`, the seed and `mean` as the kind takes them.
// Returns false (nothing launched) when the kernels do not take the problem.
bool run_forward(norm_kind kind, const at::Tensor& x, const optional_tensor& weight, const optional_tensor& bias,
                 const optional_tensor& residual, const optional_tensor& seed, double eps, double dropout_p,
                 const at::Tensor& out, const at::Tensor& h, const optional_tensor& mean, const at::Tensor& rstd) {
  const int64_t hidden = x.size(-1);
  const rows_view x_rows = as_rows(x, hidden);
  const std::optional<rows_view> residual_rows = rows_or_none(residual, hidden);
  const optional_tensor weight_vector = contiguous(weight), bias_vector = contiguous(bias);
  tk::norms::forward_problem p{};
  p.rows = x_rows.rows;
  p.hidden = hidden;
  p.x = rows_of(x_rows);
  p.residual = rows_of(residual_rows);
  p.weight = parameter_of(weight_vector);
  p.bias = parameter_of(bias_vector);
  p.eps = float(eps);
  p.dropout_seed = seed_pointer(seed, dropout_p);
  p.dropout_p = dropout_p;
  p.out = output_of(out, true);
  p.h = output_of(h, h.numel() > 0);
  p.mean = mean.has_value() ? mean->data_ptr<float>() : nullptr;
  p.rstd = rstd.data_ptr<float>();
  if (!tk::norms::unsupported_reason(kind, p).empty()) return false;
  launch_on(x, [&](cudaStream_t stream) { return tk::norms::launch_forward(kind, p, stream); });
  return true;
}

bool forward_supported(const at::Tensor& x, const optional_tensor& residual, const optional_tensor& weight,
                       const optional_tensor& bias) {
  return kernel_device(x) && is_16bit(x) && x.numel() > 0 && x_or_fp32(residual, x.scalar_type()) &&
         x_or_fp32(weight, x.scalar_type()) && x_or_fp32(bias, x.scalar_type());
}

layer_norm_outputs layer_norm_cuda(const at::Tensor& x, const optional_tensor& weight, const optional_tensor& bias,
                                   const optional_tensor& residual, const optional_tensor& dropout_seed, double eps,
                                   double dropout_p) {
  constexpr const char* op = "tk::layer_norm";
  TORCH_CHECK_VALUE(x.dim() >= 1, op, ": x must have at least 1 dimension (..., hidden), got shape ", x.sizes());
  check_parameter(op, "weight", weight, x);
  check_parameter(op, "bias", bias, x);
  check_like(op, "residual", residual, x, "x");
  check_dropout(op, dropout_seed, dropout_p, x);
  if (forward_supported(x, residual, weight, bias)) {
    const at::ScalarType stream = residual.has_value() ? residual->scalar_type() : x.scalar_type();
    const bool materialise_h = residual.has_value() || dropout_p > 0;
    at::Tensor out = new_like(x);
    at::Tensor h = materialise_h ? new_tensor(x.sizes(), stream, x) : empty_output(x);
    at::Tensor mean = statistic(x), rstd = statistic(x);
    if (run_forward(norm_kind::layer, x, weight, bias, residual, dropout_seed, eps, dropout_p, out, h, mean, rstd)) {
      return {out, h, mean, rstd};
    }
  }
  return fallback<&layer_norm_cuda>("tk::layer_norm_ref", x, weight, bias, residual, dropout_seed, eps, dropout_p);
}

rms_norm_outputs rms_norm_cuda(const at::Tensor& x, const optional_tensor& weight, const optional_tensor& residual,
                               double eps) {
  constexpr const char* op = "tk::rms_norm";
  TORCH_CHECK_VALUE(x.dim() >= 1, op, ": x must have at least 1 dimension (..., hidden), got shape ", x.sizes());
  check_parameter(op, "weight", weight, x);
  check_like(op, "residual", residual, x, "x");
  if (forward_supported(x, residual, weight, std::nullopt)) {
    const at::ScalarType stream = residual.has_value() ? residual->scalar_type() : x.scalar_type();
    at::Tensor out = new_like(x);
    at::Tensor h = residual.has_value() ? new_tensor(x.sizes(), stream, x) : empty_output(x);
    at::Tensor rstd = statistic(x);
    if (run_forward(norm_kind::rms, x, weight, std::nullopt, residual, std::nullopt, eps, 0.0, out, h, std::nullopt,
                    rstd)) {
      return {out, h, rstd};
    }
  }
  return fallback<&rms_norm_cuda>("tk::rms_norm_ref", x, weight, residual, eps);
}

// ------------------------------------------------------------------------------------ backward

struct backward_outputs {
  at::Tensor grad_x, grad_residual, grad_weight, grad_bias;
};

bool run_backward(norm_kind kind, const at::Tensor& grad_out, const optional_tensor& grad_h, const at::Tensor& h,
                  const optional_tensor& weight, const optional_tensor& mean, const at::Tensor& rstd,
                  const optional_tensor& seed, double dropout_p, const backward_outputs& out,
                  const std::array<bool, 4>& wanted) {
  const int64_t hidden = h.size(-1);
  const rows_view grad_out_rows = as_rows(grad_out, hidden), h_rows = as_rows(h, hidden);
  const std::optional<rows_view> grad_h_rows = rows_or_none(grad_h, hidden);
  const optional_tensor weight_vector = contiguous(weight);
  const at::Tensor rstd_values = rstd.contiguous();
  const optional_tensor mean_values = contiguous(mean);
  tk::norms::backward_problem p{};
  p.rows = h_rows.rows;
  p.hidden = hidden;
  p.grad_out = rows_of(grad_out_rows);
  p.grad_h = rows_of(grad_h_rows);
  p.h = rows_of(h_rows);
  p.weight = parameter_of(weight_vector);
  p.mean = mean_values.has_value() ? mean_values->data_ptr<float>() : nullptr;
  p.rstd = rstd_values.data_ptr<float>();
  p.dropout_seed = seed_pointer(seed, dropout_p);
  p.dropout_p = dropout_p;
  p.grad_x = output_of(out.grad_x, wanted[0]);
  p.grad_residual = output_of(out.grad_residual, wanted[1]);
  p.grad_weight = output_of(out.grad_weight, wanted[2]);
  p.grad_bias = output_of(out.grad_bias, wanted[3]);
  if (!tk::norms::unsupported_reason(kind, p).empty()) return false;
  launch_on(h, [&](cudaStream_t stream) {
    // One partial row per block of the backward's grid on h's device: counted with that device current.
    // None without parameter gradients (then the kernel writes no partial rows).
    const int64_t workspace_floats = tk::norms::backward_workspace_floats(kind, p, h.get_device());
    const at::Tensor workspace = workspace_floats > 0 ? new_tensor({workspace_floats}, at::kFloat, h) : at::Tensor();
    p.workspace = workspace.defined() ? workspace.data_ptr<float>() : nullptr;
    return tk::norms::launch_backward(kind, p, stream);
  });
  return true;
}

bool backward_supported(const at::Tensor& grad_out, const optional_tensor& grad_h, const at::Tensor& h,
                        const optional_tensor& weight, const optional_tensor& bias, const optional_tensor& mean,
                        const at::Tensor& rstd) {
  const at::ScalarType x = grad_out.scalar_type();
  return kernel_device(h) && is_16bit(grad_out) && h.numel() > 0 && x_or_fp32(h, x) &&
         (!grad_h.has_value() || grad_h->scalar_type() == h.scalar_type()) && x_or_fp32(weight, x) &&
         x_or_fp32(bias, x) && rstd.scalar_type() == at::kFloat &&
         (!mean.has_value() || mean->scalar_type() == at::kFloat);
}

backward_outputs allocate_backward(const at::Tensor& grad_out, const at::Tensor& h, const optional_tensor& weight,
                                   const optional_tensor& bias, const std::array<bool, 4>& wanted) {
  return {wanted[0] ? new_tensor(h.sizes(), grad_out.scalar_type(), grad_out) : empty_output(grad_out),
          wanted[1] ? new_like(h) : empty_output(grad_out),
          wanted[2] ? new_like(*weight) : empty_output(grad_out),
          wanted[3] ? new_like(*bias) : empty_output(grad_out)};
}

void check_backward(const char* op, const at::Tensor& grad_out, const optional_tensor& grad_h, const at::Tensor& h,
                    const optional_tensor& weight, const optional_tensor& bias, const std::array<bool, 4>& wanted) {
  TORCH_CHECK_VALUE(h.dim() >= 1, op, ": h must have at least 1 dimension (..., hidden), got shape ", h.sizes());
  check_like(op, "grad_out", grad_out, h, "h");
  check_like(op, "grad_h", grad_h, h, "h");
  check_parameter(op, "weight", weight, h);
  check_parameter(op, "bias", bias, h);
  TORCH_CHECK_VALUE(!wanted[2] || weight.has_value(), op, ": grad_weight was asked for without a weight");
  TORCH_CHECK_VALUE(!wanted[3] || bias.has_value(), op, ": grad_bias was asked for without a bias");
}

layer_norm_outputs layer_norm_bwd_cuda(const at::Tensor& grad_out, const optional_tensor& grad_h, const at::Tensor& h,
                                       const optional_tensor& weight, const optional_tensor& bias,
                                       const at::Tensor& mean, const at::Tensor& rstd,
                                       const optional_tensor& dropout_seed, double dropout_p,
                                       std::array<bool, 4> output_mask) {
  constexpr const char* op = "tk::layer_norm_bwd";
  check_backward(op, grad_out, grad_h, h, weight, bias, output_mask);
  check_statistic(op, "mean", mean, h);
  check_statistic(op, "rstd", rstd, h);
  check_dropout(op, dropout_seed, dropout_p, h);
  const bool any = output_mask[0] || output_mask[1] || output_mask[2] || output_mask[3];
  if (backward_supported(grad_out, grad_h, h, weight, bias, mean, rstd)) {
    const backward_outputs out = allocate_backward(grad_out, h, weight, bias, output_mask);
    if (!any || run_backward(norm_kind::layer, grad_out, grad_h, h, weight, mean, rstd, dropout_seed, dropout_p, out,
                             output_mask)) {
      return {out.grad_x, out.grad_residual, out.grad_weight, out.grad_bias};
    }
  }
  return fallback<&layer_norm_bwd_cuda>("tk::layer_norm_bwd_ref", grad_out, grad_h, h, weight, bias, mean, rstd,
                                        dropout_seed, dropout_p, output_mask);
}

rms_norm_outputs rms_norm_bwd_cuda(const at::Tensor& grad_out, const optional_tensor& grad_h, const at::Tensor& h,
                                   const optional_tensor& weight, const at::Tensor& rstd,
                                   std::array<bool, 3> output_mask) {
  constexpr const char* op = "tk::rms_norm_bwd";
  const std::array<bool, 4> wanted = {output_mask[0], output_mask[1], output_mask[2], false};
  check_backward(op, grad_out, grad_h, h, weight, std::nullopt, wanted);
  check_statistic(op, "rstd", rstd, h);
  const bool any = output_mask[0] || output_mask[1] || output_mask[2];
  if (backward_supported(grad_out, grad_h, h, weight, std::nullopt, std::nullopt, rstd)) {
    const backward_outputs out = allocate_backward(grad_out, h, weight, std::nullopt, wanted);
    if (!any || run_backward(norm_kind::rms, grad_out, grad_h, h, weight, std::nullopt, rstd, std::nullopt, 0.0, out,
                             wanted)) {
      return {out.grad_x, out.grad_residual, out.grad_weight};
    }
  }
  return fallback<&rms_norm_bwd_cuda>("tk::rms_norm_bwd_ref", grad_out, grad_h, h, weight, rstd, output_mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) {
  m.impl("layer_norm", &layer_norm_cuda);
  m.impl("layer_norm_bwd", &layer_norm_bwd_cuda);
  m.impl("rms_norm", &rms_norm_cuda);
  m.impl("rms_norm_bwd", &rms_norm_bwd_cuda);
}
