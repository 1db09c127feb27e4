// CUDA kernels of tk::causal_conv1d and tk::causal_conv1d_bwd (csrc/kernels/causal_conv1d).
//
// Each entry re-checks its arguments as tk_ops.causal_conv1d does, allocates its outputs in x's
// layout exactly as the reference does (channel-last when x is, else contiguous), describes every
// activation to the kernels as it is stored and launches on the current stream. The kernels read
// either layout in place: a unit stride along L (any batch and channel strides), or a unit stride
// along D (a (B, L, D) tensor or a column slice of one, transposed). A gradient whose unit stride is
// not x's is first copied into x's layout. What the kernels do not take goes to the reference twin
// tk::<op>_ref, which warns once: fp64, W outside {2, 3, 4}, another GPU than sm_90, an x with no
// unit stride along L or D, empty tensors.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "kernels/causal_conv1d/causal_conv1d.h"
#include "registration.h"

namespace {

using tk::registration::element_of;
using tk::registration::fallback;
using tk::registration::launch_on;

namespace conv = tk::causal_conv1d;
using optional_tensor = std::optional<at::Tensor>;
using backward_outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

bool is_16bit(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// x's dtype, or fp32 when x is fp16/bf16: what a weight or bias may have.
void check_parameter(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x, int64_t dim) {
  TORCH_CHECK_VALUE(t.dim() == dim && t.size(0) == x.size(1), op, ": ", name, " must have ", dim,
                    " dimensions and shape[0] = D = ", x.size(1), " (x.shape[1]), got shape ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == x.scalar_type() || (is_16bit(x.scalar_type()) && t.scalar_type() == at::kFloat),
                   op, ": ", name, " must have x's dtype ", x.scalar_type(),
                   (is_16bit(x.scalar_type()) ? " or float32" : ""), ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == x.device(), op, ": ", name, " must be on x's device ", x.device(), ", got ",
                    t.device());
}

void check_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight, const optional_tensor& bias) {
  TORCH_CHECK_VALUE(x.dim() == 3, op, ": x must have 3 dimensions (B, D, L), got shape ", x.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(x.scalar_type()), op, ": x must be a floating-point tensor, got ",
                   x.scalar_type());
  check_parameter(op, "weight", weight, x, 2);
  TORCH_CHECK_VALUE(weight.size(1) >= 1, op, ": weight.shape[1] (the kernel width W) must be >= 1, got shape ",
                    weight.sizes());
  if (bias.has_value()) check_parameter(op, "bias", *bias, x, 1);
}

// tk_ops.ops.causal_conv1d.is_channel_last: (B, D, L) with a unit stride along D and not along L.
bool is_channel_last(const at::Tensor& t) { return t.size(2) > 1 && t.stride(2) != 1 && t.stride(1) == 1; }

// An empty (B, D, L) tensor in x's dtype and layout: channel-last when x is, contiguous otherwise.
at::Tensor new_like_x(const at::Tensor& x) {
  if (is_channel_last(x)) return at::empty({x.size(0), x.size(2), x.size(1)}, x.options()).transpose(1, 2);
  return at::empty({x.size(0), x.size(1), x.size(2)}, x.options());
}

// Whether t has a unit stride along the dimension x's outputs have theirs (D when x is channel-last, else L).
bool unit_stride_of_x_layout(const at::Tensor& t, const at::Tensor& x) {
  const int64_t along = is_channel_last(x) ? 1 : 2;
  return t.size(along) == 1 || t.stride(along) == 1;
}

bool kernel_inputs(const at::Tensor& x) {
  return tk::registration::runs_kernels(x) && tk::registration::has_element_type(x) && x.numel() > 0;
}

conv::sizes sizes_of(const at::Tensor& x, const at::Tensor& weight) {
  return {x.size(0), x.size(1), x.size(2), weight.size(1)};
}

conv::input_view input_of(const at::Tensor& t) { return {t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)}; }
conv::output_view output_of(const at::Tensor& t) { return {t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)}; }

conv::parameter parameter_of(const optional_tensor& t) {
  return t.has_value() ? conv::parameter{t->data_ptr(), element_of(*t)} : conv::parameter{nullptr, tk::element_type::fp32};
}

optional_tensor contiguous(const optional_tensor& t) {
  return t.has_value() ? optional_tensor(t->contiguous()) : std::nullopt;
}

at::Tensor causal_conv1d_cuda(const at::Tensor& x, const at::Tensor& weight, const optional_tensor& bias, bool silu) {
  constexpr const char* op = "tk::causal_conv1d";
  check_inputs(op, x, weight, bias);
  if (kernel_inputs(x)) {
    const at::Tensor taps = weight.contiguous();
    const optional_tensor bias_values = contiguous(bias);
    at::Tensor out = new_like_x(x);
    conv::forward_problem p{};
    p.dtype = element_of(x);
    p.size = sizes_of(x, taps);
    p.x = input_of(x);
    p.out = output_of(out);
    p.weight = parameter_of(taps);
    p.bias = parameter_of(bias_values);
    p.silu = silu;
    if (conv::unsupported_reason(p).empty()) {
      launch_on(x, [&](cudaStream_t stream) { return conv::launch_forward(p, stream); });
      return out;
    }
  }
  return fallback<&causal_conv1d_cuda>("tk::causal_conv1d_ref", x, weight, bias, silu);
}

backward_outputs causal_conv1d_bwd_cuda(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                                        const optional_tensor& bias, bool silu) {
  constexpr const char* op = "tk::causal_conv1d_bwd";
  check_inputs(op, x, weight, bias);
  TORCH_CHECK_VALUE(grad.sizes() == x.sizes(), op, ": grad must have x's shape ", x.sizes(), ", got ", grad.sizes());
  TORCH_CHECK_TYPE(grad.scalar_type() == x.scalar_type(), op, ": grad must have x's dtype ", x.scalar_type(), ", got ",
                   grad.scalar_type());
  TORCH_CHECK_VALUE(grad.device() == x.device(), op, ": grad must be on x's device ", x.device(), ", got ",
                    grad.device());
  if (kernel_inputs(x)) {
    const at::Tensor taps = weight.contiguous();
    const optional_tensor bias_values = contiguous(bias);
    at::Tensor grad_in_layout = grad;
    if (!unit_stride_of_x_layout(grad, x)) grad_in_layout = new_like_x(x).copy_(grad);
    at::Tensor grad_x = new_like_x(x);
    at::Tensor grad_weight = at::empty(taps.sizes(), taps.options());
    at::Tensor grad_bias = bias_values.has_value() ? at::empty(bias_values->sizes(), bias_values->options()) : x.new_empty({0});
    conv::backward_problem p{};
    p.dtype = element_of(x);
    p.size = sizes_of(x, taps);
    p.grad = input_of(grad_in_layout);
    p.x = input_of(x);
    p.grad_x = output_of(grad_x);
    p.weight = parameter_of(taps);
    p.bias = parameter_of(bias_values);
    p.silu = silu;
    p.grad_weight = grad_weight.data_ptr();
    p.grad_bias = bias_values.has_value() ? grad_bias.data_ptr() : nullptr;
    if (conv::unsupported_reason(p).empty()) {
      launch_on(x, [&](cudaStream_t stream) {
        // Its rows of partial sums depend on how many blocks fit x's device: counted with it current.
        const at::Tensor workspace = at::empty({conv::backward_workspace_floats(p)}, x.options().dtype(at::kFloat));
        p.workspace = workspace.data_ptr<float>();
        return conv::launch_backward(p, stream);
      });
      return {grad_x, grad_weight, grad_bias};
    }
  }
  return fallback<&causal_conv1d_bwd_cuda>("tk::causal_conv1d_bwd_ref", grad, x, weight, bias, silu);
}

}  // namespace

TORCH_LIBRARY_IMPL(tk, CUDA, m) {
  m.impl("causal_conv1d", &causal_conv1d_cuda);
  m.impl("causal_conv1d_bwd", &causal_conv1d_bwd_cuda);
}
