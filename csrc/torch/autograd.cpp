// Autograd of the kernel-backed tk ops in C++, registered at the AutogradCUDA key: matmul, linear,
// attention, layer_norm, rms_norm, rope, rope_qk, linear_attention, based_attention, causal_conv1d,
// fftconv, mamba2_ssd.
//
// tk_ops/_library.py registers every op's autograd as a Python autograd.Function at the Autograd
// alias key; it serves every device. For CUDA tensors these kernels take precedence (a direct
// AutogradCUDA registration beats the alias), so an eager call on the GPU never re-enters Python
// between the public function and the CUDA kernel. Each one is the Python autograd of the same op
// (tk_ops/ops/<op>.py, setup_context and backward) spelled in C++: the same saved tensors, the
// same outputs without a gradient, materialize_grads, needs_input_grad taken when the forward runs
// (as a Python autograd.Function does), the same backward op calls and output masks. Forward and
// backward call the tk ops through the dispatcher, so fake tensors, torch.compile, export, opcheck
// and compiled autograd see the same tk ops as with the Python autograd. (The norms' Functions return only the
// differentiable outputs, the rest beside them: see "norms" below; so do linear/Based attention and
// mamba2_ssd.)
//
// Knows no CUDA: TK_OPS_AUTOGRAD_KEY (AutogradCUDA unless defined) lets a CPU-only torch build this
// file for AutogradCPU, which is how tests/test_cpp_autograd.py checks it against the Python
// autograd without a GPU.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <optional>
#include <tuple>

#include "strides.h"

#ifndef TK_OPS_AUTOGRAD_KEY
#define TK_OPS_AUTOGRAD_KEY AutogradCUDA
#endif

namespace tk::autograd {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;
using optional_tensor = std::optional<Tensor>;
using tk::strides::unit_last_stride;

namespace {

// ------------------------------------------------------------------------------- the tk ops

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// One handle per op, looked up on first use (the ops are defined from Python, after this library
// may have been loaded).
#define TK_OPS_HANDLE(NAME, ...)                                                             \
  const c10::TypedOperatorHandle<__VA_ARGS__>& NAME() {                                      \
    static const c10::TypedOperatorHandle<__VA_ARGS__> handle = find_op<__VA_ARGS__>("tk::" #NAME); \
    return handle;                                                                           \
  }

// The base of every Function here: its backward calls tk ops only, so compiled autograd may trace it.
template <typename Self>
struct traceable_function : Function<Self> {
  static constexpr bool is_traceable = true;
};

using tensor_pair = std::tuple<Tensor, Tensor>;
using tensor_triple = std::tuple<Tensor, Tensor, Tensor>;
using tensor_quadruple = std::tuple<Tensor, Tensor, Tensor, Tensor>;

TK_OPS_HANDLE(matmul, Tensor(const Tensor&, const Tensor&))
TK_OPS_HANDLE(matmul_bwd, tensor_pair(const Tensor&, const Tensor&, const Tensor&, std::array<bool, 2>))
TK_OPS_HANDLE(linear, Tensor(const Tensor&, const Tensor&, const optional_tensor&))
TK_OPS_HANDLE(linear_bwd, tensor_triple(const Tensor&, const Tensor&, const Tensor&, std::array<bool, 3>))
// attention's last four arguments: window_left, window_right, softcap, sinks (tk_ops/ops/attention.py).
TK_OPS_HANDLE(attention, tensor_pair(const Tensor&, const Tensor&, const Tensor&, bool, double, bool, int64_t, int64_t,
                                     double, const optional_tensor&))
TK_OPS_HANDLE(attention_bwd, tensor_quadruple(const Tensor&, const optional_tensor&, const Tensor&, const Tensor&,
                                              const Tensor&, const Tensor&, const Tensor&, bool, double, bool, int64_t,
                                              int64_t, double, const optional_tensor&))
TK_OPS_HANDLE(layer_norm, tensor_quadruple(const Tensor&, const optional_tensor&, const optional_tensor&,
                                           const optional_tensor&, const optional_tensor&, double, double))
TK_OPS_HANDLE(layer_norm_bwd,
              tensor_quadruple(const Tensor&, const optional_tensor&, const Tensor&, const optional_tensor&,
                               const optional_tensor&, const Tensor&, const Tensor&, const optional_tensor&, double,
                               std::array<bool, 4>))
TK_OPS_HANDLE(rms_norm, tensor_triple(const Tensor&, const optional_tensor&, const optional_tensor&, double))
TK_OPS_HANDLE(rms_norm_bwd, tensor_triple(const Tensor&, const optional_tensor&, const Tensor&,
                                          const optional_tensor&, const Tensor&, std::array<bool, 3>))
TK_OPS_HANDLE(rope, Tensor(const Tensor&, const Tensor&, const Tensor&, bool))
TK_OPS_HANDLE(rope_bwd, Tensor(const Tensor&, const Tensor&, const Tensor&, bool))
TK_OPS_HANDLE(rope_qk, tensor_pair(const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool))
TK_OPS_HANDLE(rope_qk_bwd, tensor_pair(const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool))
TK_OPS_HANDLE(linear_attention, tensor_pair(const Tensor&, const Tensor&, const Tensor&, double, bool))
TK_OPS_HANDLE(linear_attention_bwd, tensor_triple(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                  const Tensor&, const Tensor&, double, bool))
TK_OPS_HANDLE(based_attention, tensor_pair(const Tensor&, const Tensor&, const Tensor&, double, bool))
TK_OPS_HANDLE(based_attention_bwd, tensor_triple(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                 const Tensor&, const Tensor&, double, bool))
TK_OPS_HANDLE(causal_conv1d, Tensor(const Tensor&, const Tensor&, const optional_tensor&, bool))
TK_OPS_HANDLE(causal_conv1d_bwd,
              tensor_triple(const Tensor&, const Tensor&, const Tensor&, const optional_tensor&, bool))
TK_OPS_HANDLE(fftconv, Tensor(const Tensor&, const Tensor&, const optional_tensor&))
TK_OPS_HANDLE(fftconv_bwd, tensor_triple(const Tensor&, const Tensor&, const Tensor&, const optional_tensor&))

using mamba2_outputs = std::tuple<Tensor, Tensor, Tensor>;
using mamba2_gradients = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
TK_OPS_HANDLE(mamba2_ssd,
              mamba2_outputs(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t,
                             const optional_tensor&, const optional_tensor&, const optional_tensor&, bool,
                             const optional_tensor&))
TK_OPS_HANDLE(mamba2_ssd_bwd,
              mamba2_gradients(const Tensor&, const optional_tensor&, const Tensor&, const Tensor&, const Tensor&,
                               const Tensor&, const Tensor&, int64_t, const optional_tensor&, const optional_tensor&,
                               const optional_tensor&, bool, const optional_tensor&, const Tensor&))

#undef TK_OPS_HANDLE

// The op below autograd, as the Python kernel's `with _AutoDispatchBelowAutograd(): op(*inputs)`:
// the CUDA kernel and everything it calls skip the autograd keys.
template <typename Signature, typename... Args>
auto below_autograd(const c10::TypedOperatorHandle<Signature>& op, Args&&... args) {
  const at::AutoDispatchBelowAutograd guard;
  return op.call(std::forward<Args>(args)...);
}

// ------------------------------------------------------------------------------------ helpers

bool requires_grad(const Tensor& t) { return t.requires_grad(); }
bool requires_grad(const optional_tensor& t) { return t.has_value() && t->requires_grad(); }

// The Python kernel's test: torch.is_grad_enabled() and torch._C._any_requires_grad(*inputs).
template <typename... Inputs>
bool builds_graph(const Inputs&... inputs) {
  return at::GradMode::is_enabled() && (requires_grad(inputs) || ...);
}

// ctx.needs_input_grad of a Python autograd.Function: per tensor input, whether it required grad
// when the forward ran (not whether this backward pass asks for it). Bit i is input i. The key is
// under 16 characters, so the std::string built for each lookup stays inline (no heap allocation).
constexpr const char* NEEDS_INPUT_GRAD = "needs_grad";

template <typename... Inputs>
void save_needs_input_grad(AutogradContext* ctx, const Inputs&... inputs) {
  int64_t bits = 0, bit = 1;
  ((bits |= requires_grad(inputs) ? bit : 0, bit <<= 1), ...);
  ctx->saved_data[NEEDS_INPUT_GRAD] = bits;
}

bool needs_input_grad(const AutogradContext* ctx, int input) {
  return (ctx->saved_data.at(NEEDS_INPUT_GRAD).toInt() >> input) & 1;
}

Tensor or_undefined(const optional_tensor& t) { return t.has_value() ? *t : Tensor(); }
optional_tensor or_none(const Tensor& t) { return t.defined() ? optional_tensor(t) : std::nullopt; }
Tensor if_needed(bool needed, const Tensor& t) { return needed ? t : Tensor(); }

}  // namespace

// Each Function is named <op>_autograd: its node's name() is torch::autograd::CppNode<tk::autograd::<op>_autograd>.

// ------------------------------------------------------------------------- matmul and linear

struct matmul_autograd : traceable_function<matmul_autograd> {
  static Tensor forward(AutogradContext* ctx, const Tensor& a, const Tensor& b) {
    save_needs_input_grad(ctx, a, b);
    ctx->save_for_backward({a, b});
    return below_autograd(matmul(), a, b);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const std::array<bool, 2> mask = {needs_input_grad(ctx, 0), needs_input_grad(ctx, 1)};
    auto [grad_a, grad_b] = matmul_bwd().call(grads[0], saved[0], saved[1], mask);
    return {if_needed(mask[0], grad_a), if_needed(mask[1], grad_b)};
  }
};

Tensor matmul_kernel(const Tensor& a, const Tensor& b) {
  if (!builds_graph(a, b)) return below_autograd(matmul(), a, b);
  return matmul_autograd::apply(a, b);
}

struct linear_autograd : traceable_function<linear_autograd> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const optional_tensor& bias) {
    save_needs_input_grad(ctx, x, weight, bias);
    ctx->save_for_backward({x, weight});
    ctx->saved_data["has_bias"] = bias.has_value();
    return below_autograd(linear(), x, weight, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const std::array<bool, 3> mask = {needs_input_grad(ctx, 0), needs_input_grad(ctx, 1),
                                      ctx->saved_data.at("has_bias").toBool() && needs_input_grad(ctx, 2)};
    auto [grad_x, grad_weight, grad_bias] = linear_bwd().call(grads[0], saved[0], saved[1], mask);
    return {if_needed(mask[0], grad_x), if_needed(mask[1], grad_weight), if_needed(mask[2], grad_bias)};
  }
};

Tensor linear_kernel(const Tensor& x, const Tensor& weight, const optional_tensor& bias) {
  if (!builds_graph(x, weight, bias)) return below_autograd(linear(), x, weight, bias);
  return linear_autograd::apply(x, weight, bias);
}

// ---------------------------------------------------------------------------------- attention

// The options (window_left, window_right, softcap, sinks) are handed on to the backward as they came;
// sinks is saved with the tensors and gets the backward's grad_sinks (no gradient without sinks).
struct attention_autograd : traceable_function<attention_autograd> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                               double scale, bool deterministic, int64_t window_left, int64_t window_right,
                               double softcap, const optional_tensor& sinks) {
    auto [out, lse] = below_autograd(attention(), q, k, v, causal, scale, deterministic, window_left, window_right,
                                     softcap, sinks);
    ctx->save_for_backward({q, k, v, out, lse, or_undefined(sinks)});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["deterministic"] = deterministic;
    ctx->saved_data["window_left"] = window_left;
    ctx->saved_data["window_right"] = window_right;
    ctx->saved_data["softcap"] = softcap;
    // An output that is not used gets no gradient (undefined), so the backward skips the lse term.
    ctx->set_materialize_grads(false);
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4], &sinks = saved[5];
    const Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(out);
    const optional_tensor grad_lse = grads[1].defined() ? optional_tensor(unit_last_stride(grads[1])) : std::nullopt;
    auto [grad_q, grad_k, grad_v, grad_sinks] = attention_bwd().call(
        unit_last_stride(grad_out), grad_lse, q, k, v, out, lse, ctx->saved_data.at("causal").toBool(),
        ctx->saved_data.at("scale").toDouble(), ctx->saved_data.at("deterministic").toBool(),
        ctx->saved_data.at("window_left").toInt(), ctx->saved_data.at("window_right").toInt(),
        ctx->saved_data.at("softcap").toDouble(), or_none(sinks));
    return {grad_q,   grad_k,   grad_v,   Tensor(), Tensor(),
            Tensor(), Tensor(), Tensor(), Tensor(), if_needed(sinks.defined(), grad_sinks)};
  }
};

tensor_pair attention_kernel(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                             bool deterministic, int64_t window_left, int64_t window_right, double softcap,
                             const optional_tensor& sinks) {
  if (!builds_graph(q, k, v, sinks)) {
    return below_autograd(attention(), q, k, v, causal, scale, deterministic, window_left, window_right, softcap, sinks);
  }
  const variable_list outputs =
      attention_autograd::apply(q, k, v, causal, scale, deterministic, window_left, window_right, softcap, sinks);
  return {outputs[0], outputs[1]};
}

// -------------------------------------------------------------------------------------- norms
//
// The statistics (mean, rstd), and h where the op returns an empty tensor for it, are what
// the Python autograd marks non-differentiable. Here they leave the Function beside it (forward
// writes them into `statistics`), so they come out exactly as marked outputs do (no grad_fn,
// requires_grad False) and the node's context marks nothing: compiled autograd refuses C++ nodes
// whose context marked outputs non-differentiable (CppNode::compiled_args asserts it never did).

// Whether the norm's op returns h (the pre-norm residual stream) or an empty tensor, in which
// case the backward receives x as h (tk_ops/ops/layer_norm.py, "When h is materialised").
bool materialises_h(const optional_tensor& residual, double dropout_p) { return residual.has_value() || dropout_p > 0; }

// A gradient for `out` when only h was used: zeros in out's dtype, shaped like h.
Tensor zeros_for_out(const Tensor& h, const AutogradContext* ctx) {
  const auto dtype = static_cast<at::ScalarType>(ctx->saved_data.at("out_dtype").toInt());
  return at::zeros(h.sizes(), h.options().dtype(dtype));
}

struct layer_norm_autograd : traceable_function<layer_norm_autograd> {
  // Returns out, and h when it is materialised; `outputs` receives all four outputs of the op.
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const optional_tensor& weight,
                               const optional_tensor& bias, const optional_tensor& residual,
                               const optional_tensor& dropout_seed, double eps, double dropout_p,
                               tensor_quadruple* outputs) {
    save_needs_input_grad(ctx, x, weight, bias, residual);
    *outputs = below_autograd(layer_norm(), x, weight, bias, residual, dropout_seed, eps, dropout_p);
    const auto& [out, h, mean, rstd] = *outputs;
    const bool materialised_h = materialises_h(residual, dropout_p);
    // An unused output (h when return_residual=False) then gets no gradient, not a tensor of zeros.
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({materialised_h ? h : x, or_undefined(weight), or_undefined(bias), mean, rstd,
                            or_undefined(dropout_seed)});
    ctx->saved_data["materialised_h"] = materialised_h;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["out_dtype"] = static_cast<int64_t>(out.scalar_type());
    return materialised_h ? variable_list{out, h} : variable_list{out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor &h = saved[0], &weight = saved[1], &bias = saved[2], &mean = saved[3], &rstd = saved[4];
    bool needs_x = needs_input_grad(ctx, 0), needs_weight = needs_input_grad(ctx, 1);
    bool needs_bias = needs_input_grad(ctx, 2), needs_residual = needs_input_grad(ctx, 3);
    Tensor grad_out = grads[0];
    if (!grad_out.defined()) {  // only h was used: the parameters get no gradient
      grad_out = zeros_for_out(h, ctx);
      needs_weight = needs_bias = false;
    }
    const optional_tensor grad_h = grads.size() > 1 ? or_none(grads[1]) : std::nullopt;
    const std::array<bool, 4> mask = {needs_x, needs_residual, needs_weight, needs_bias};
    auto [grad_x, grad_residual, grad_weight, grad_bias] =
        layer_norm_bwd().call(grad_out, grad_h, h, or_none(weight), or_none(bias), mean, rstd, or_none(saved[5]),
                              ctx->saved_data.at("dropout_p").toDouble(), mask);
    return {if_needed(needs_x, grad_x),
            if_needed(needs_weight, grad_weight),
            if_needed(needs_bias, grad_bias),
            if_needed(needs_residual, grad_residual),
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor()};
  }
};

tensor_quadruple layer_norm_kernel(const Tensor& x, const optional_tensor& weight, const optional_tensor& bias,
                                   const optional_tensor& residual, const optional_tensor& dropout_seed, double eps,
                                   double dropout_p) {
  if (!builds_graph(x, weight, bias, residual, dropout_seed)) {
    return below_autograd(layer_norm(), x, weight, bias, residual, dropout_seed, eps, dropout_p);
  }
  tensor_quadruple outputs;
  const variable_list differentiable =
      layer_norm_autograd::apply(x, weight, bias, residual, dropout_seed, eps, dropout_p, &outputs);
  const auto& [out, h, mean, rstd] = outputs;
  return {differentiable[0], differentiable.size() > 1 ? differentiable[1] : h, mean, rstd};
}

struct rms_norm_autograd : traceable_function<rms_norm_autograd> {
  // Returns out, and h when it is materialised; `outputs` receives all three outputs of the op.
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const optional_tensor& weight,
                               const optional_tensor& residual, double eps, tensor_triple* outputs) {
    save_needs_input_grad(ctx, x, weight, residual);
    *outputs = below_autograd(rms_norm(), x, weight, residual, eps);
    const auto& [out, h, rstd] = *outputs;
    const bool materialised_h = residual.has_value();
    // An unused output (h when return_residual=False) then gets no gradient, not a tensor of zeros.
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({materialised_h ? h : x, or_undefined(weight), rstd});
    ctx->saved_data["out_dtype"] = static_cast<int64_t>(out.scalar_type());
    return materialised_h ? variable_list{out, h} : variable_list{out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor &h = saved[0], &weight = saved[1], &rstd = saved[2];
    bool needs_x = needs_input_grad(ctx, 0), needs_weight = needs_input_grad(ctx, 1);
    bool needs_residual = needs_input_grad(ctx, 2);
    Tensor grad_out = grads[0];
    if (!grad_out.defined()) {  // only h was used: the weight gets no gradient
      grad_out = zeros_for_out(h, ctx);
      needs_weight = false;
    }
    const optional_tensor grad_h = grads.size() > 1 ? or_none(grads[1]) : std::nullopt;
    auto [grad_x, grad_residual, grad_weight] = rms_norm_bwd().call(
        grad_out, grad_h, h, or_none(weight), rstd, std::array<bool, 3>{needs_x, needs_residual, needs_weight});
    return {if_needed(needs_x, grad_x), if_needed(needs_weight, grad_weight), if_needed(needs_residual, grad_residual),
            Tensor(), Tensor()};
  }
};

tensor_triple rms_norm_kernel(const Tensor& x, const optional_tensor& weight, const optional_tensor& residual,
                              double eps) {
  if (!builds_graph(x, weight, residual)) return below_autograd(rms_norm(), x, weight, residual, eps);
  tensor_triple outputs;
  const variable_list differentiable = rms_norm_autograd::apply(x, weight, residual, eps, &outputs);
  const auto& [out, h, rstd] = outputs;
  return {differentiable[0], differentiable.size() > 1 ? differentiable[1] : h, rstd};
}

// --------------------------------------------------------------------------------------- rope

// cos and sin are constants: saved for the backward, never differentiated (tk_ops/ops/rope.py).
struct rope_autograd : traceable_function<rope_autograd> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["interleaved"] = interleaved;
    return below_autograd(rope(), x, cos, sin, interleaved);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const bool interleaved = ctx->saved_data.at("interleaved").toBool();
    return {rope_bwd().call(unit_last_stride(grads[0]), saved[0], saved[1], interleaved), Tensor(), Tensor(),
            Tensor()};
  }
};

Tensor rope_kernel(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved) {
  if (!builds_graph(x, cos, sin)) return below_autograd(rope(), x, cos, sin, interleaved);
  return rope_autograd::apply(x, cos, sin, interleaved);
}

struct rope_qk_autograd : traceable_function<rope_qk_autograd> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& cos,
                               const Tensor& sin, bool interleaved) {
    save_needs_input_grad(ctx, q, k);
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["interleaved"] = interleaved;
    auto [q_out, k_out] = below_autograd(rope_qk(), q, k, cos, sin, interleaved);
    return {q_out, k_out};
  }

  // Autograd gives an output that did not reach the loss a zero gradient (grads are materialised),
  // so rope_qk_bwd always gets two tensors; with only one of q, k requiring grad, rope_bwd runs alone.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor &cos = saved[0], &sin = saved[1];
    const bool interleaved = ctx->saved_data.at("interleaved").toBool();
    const bool needs_q = needs_input_grad(ctx, 0), needs_k = needs_input_grad(ctx, 1);
    if (needs_q && needs_k) {
      auto [grad_q, grad_k] =
          rope_qk_bwd().call(unit_last_stride(grads[0]), unit_last_stride(grads[1]), cos, sin, interleaved);
      return {grad_q, grad_k, Tensor(), Tensor(), Tensor()};
    }
    if (needs_q) {
      return {rope_bwd().call(unit_last_stride(grads[0]), cos, sin, interleaved), Tensor(), Tensor(), Tensor(),
              Tensor()};
    }
    return {Tensor(), rope_bwd().call(unit_last_stride(grads[1]), cos, sin, interleaved), Tensor(), Tensor(),
            Tensor()};
  }
};

tensor_pair rope_qk_kernel(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin, bool interleaved) {
  if (!builds_graph(q, k, cos, sin)) return below_autograd(rope_qk(), q, k, cos, sin, interleaved);
  const variable_list outputs = rope_qk_autograd::apply(q, k, cos, sin, interleaved);
  return {outputs[0], outputs[1]};
}

// -------------------------------------------------------------- causal linear attention, Based

// One Function for both ops (tk_ops/ops/linear_attention.py: setup_context, make_backward), named by
// each op (Self). The denominator is marked non-differentiable there; here it leaves the Function
// beside out (see "norms"). The backward reads out and the denominator only when normalising.
template <typename Self, typename Op>
struct causal_linear_autograd : traceable_function<Self> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, double eps,
                               bool normalize, Tensor* denominator) {
    auto [out, denominator_out] = below_autograd(Op::forward(), q, k, v, eps, normalize);
    *denominator = denominator_out;
    ctx->save_for_backward(normalize ? variable_list{q, k, v, out, denominator_out} : variable_list{q, k, v});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["normalize"] = normalize;
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const bool normalize = ctx->saved_data.at("normalize").toBool();
    const Tensor& grad_out = grads[0];
    const Tensor out = normalize ? saved[3] : at::empty({0}, grad_out.options());
    const Tensor denominator = normalize ? saved[4] : at::empty({0}, grad_out.options());
    auto [grad_q, grad_k, grad_v] = Op::backward().call(unit_last_stride(grad_out), saved[0], saved[1], saved[2], out,
                                                        denominator, ctx->saved_data.at("eps").toDouble(), normalize);
    return {grad_q, grad_k, grad_v, Tensor(), Tensor(), Tensor()};
  }
};

struct linear_attention_ops {
  static const auto& forward() { return linear_attention(); }
  static const auto& backward() { return linear_attention_bwd(); }
};
struct based_attention_ops {
  static const auto& forward() { return based_attention(); }
  static const auto& backward() { return based_attention_bwd(); }
};
struct linear_attention_autograd : causal_linear_autograd<linear_attention_autograd, linear_attention_ops> {};
struct based_attention_autograd : causal_linear_autograd<based_attention_autograd, based_attention_ops> {};

template <typename Autograd, typename Op>
tensor_pair causal_linear_kernel(const Tensor& q, const Tensor& k, const Tensor& v, double eps, bool normalize) {
  if (!builds_graph(q, k, v)) return below_autograd(Op::forward(), q, k, v, eps, normalize);
  Tensor denominator;
  const variable_list out = Autograd::apply(q, k, v, eps, normalize, &denominator);
  return {out[0], denominator};
}

// ----------------------------------------------------------------------------- causal_conv1d

// tk_ops/ops/causal_conv1d.py's in_accepted_layout: (B, D, L) read in place when channel-first
// (unit stride along L) or channel-last (unit stride along D), else copied.
Tensor in_accepted_layout(const Tensor& t) {
  const bool channel_last = t.size(2) > 1 && t.stride(2) != 1 && t.stride(1) == 1;
  return t.size(2) == 1 || t.stride(2) == 1 || channel_last ? t : t.contiguous();
}

struct causal_conv1d_autograd : traceable_function<causal_conv1d_autograd> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const optional_tensor& bias,
                        bool silu) {
    ctx->save_for_backward({x, weight, or_undefined(bias)});
    ctx->saved_data["silu"] = silu;
    return below_autograd(causal_conv1d(), x, weight, bias, silu);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor& bias = saved[2];
    auto [grad_x, grad_weight, grad_bias] = causal_conv1d_bwd().call(
        in_accepted_layout(grads[0]), saved[0], saved[1], or_none(bias), ctx->saved_data.at("silu").toBool());
    return {grad_x, grad_weight, if_needed(bias.defined(), grad_bias), Tensor()};
  }
};

Tensor causal_conv1d_kernel(const Tensor& x, const Tensor& weight, const optional_tensor& bias, bool silu) {
  if (!builds_graph(x, weight, bias)) return below_autograd(causal_conv1d(), x, weight, bias, silu);
  return causal_conv1d_autograd::apply(x, weight, bias, silu);
}

// ----------------------------------------------------------------------------------- fftconv

struct fftconv_autograd : traceable_function<fftconv_autograd> {
  static Tensor forward(AutogradContext* ctx, const Tensor& u, const Tensor& k, const optional_tensor& D) {
    ctx->save_for_backward({u, k, or_undefined(D)});
    return below_autograd(fftconv(), u, k, D);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor& D = saved[2];
    auto [grad_u, grad_k, grad_D] = fftconv_bwd().call(unit_last_stride(grads[0]), saved[0], saved[1], or_none(D));
    return {grad_u, grad_k, if_needed(D.defined(), grad_D)};
  }
};

Tensor fftconv_kernel(const Tensor& u, const Tensor& k, const optional_tensor& D) {
  if (!builds_graph(u, k, D)) return below_autograd(fftconv(), u, k, D);
  return fftconv_autograd::apply(u, k, D);
}

// -------------------------------------------------------------------------------- mamba2_ssd

// chunk_states is marked non-differentiable in tk_ops/ops/mamba2_ssd.py; here it leaves the
// Function beside y and final_states (see "norms"). needs_input_grad bit i is the i-th input whose
// gradient tk::mamba2_ssd_bwd returns: x, dt, A, B, C, D, z, dt_bias, initial_states.
struct mamba2_ssd_autograd : traceable_function<mamba2_ssd_autograd> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& dt, const Tensor& A,
                               const Tensor& B, const Tensor& C, int64_t chunk_size, const optional_tensor& D,
                               const optional_tensor& z, const optional_tensor& dt_bias, bool dt_softplus,
                               const optional_tensor& initial_states, Tensor* chunk_states) {
    save_needs_input_grad(ctx, x, dt, A, B, C, D, z, dt_bias, initial_states);
    auto [y, final_states, chunks] =
        below_autograd(mamba2_ssd(), x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, initial_states);
    *chunk_states = chunks;
    // An output that receives no gradient arrives undefined, not as a tensor of zeros.
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({x, dt, A, B, C, or_undefined(D), or_undefined(z), or_undefined(dt_bias),
                            or_undefined(initial_states), chunks});
    ctx->saved_data["chunk_size"] = chunk_size;
    ctx->saved_data["dt_softplus"] = dt_softplus;
    return {y, final_states};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    const Tensor& x = s[0];
    const Tensor grad_y = grads[0].defined() ? grads[0] : at::zeros_like(x);
    auto [grad_x, grad_dt, grad_A, grad_B, grad_C, grad_D, grad_z, grad_dt_bias, grad_initial_states] =
        mamba2_ssd_bwd().call(grad_y, or_none(grads[1]), x, s[1], s[2], s[3], s[4],
                              ctx->saved_data.at("chunk_size").toInt(), or_none(s[5]), or_none(s[6]), or_none(s[7]),
                              ctx->saved_data.at("dt_softplus").toBool(), or_none(s[8]), s[9]);
    const auto needed = [&](int gradient, const Tensor& t) { return if_needed(needs_input_grad(ctx, gradient), t); };
    return {needed(0, grad_x), needed(1, grad_dt), needed(2, grad_A), needed(3, grad_B), needed(4, grad_C),
            Tensor(),          needed(5, grad_D),  needed(6, grad_z), needed(7, grad_dt_bias), Tensor(),
            needed(8, grad_initial_states),        Tensor()};
  }
};

mamba2_outputs mamba2_ssd_kernel(const Tensor& x, const Tensor& dt, const Tensor& A, const Tensor& B, const Tensor& C,
                                 int64_t chunk_size, const optional_tensor& D, const optional_tensor& z,
                                 const optional_tensor& dt_bias, bool dt_softplus,
                                 const optional_tensor& initial_states) {
  if (!builds_graph(x, dt, A, B, C, D, z, dt_bias, initial_states)) {
    return below_autograd(mamba2_ssd(), x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, initial_states);
  }
  Tensor chunk_states;
  const variable_list out = mamba2_ssd_autograd::apply(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus,
                                                       initial_states, &chunk_states);
  return {out[0], out[1], chunk_states};
}

}  // namespace tk::autograd

TORCH_LIBRARY_IMPL(tk, TK_OPS_AUTOGRAD_KEY, m) {
  m.impl("matmul", &tk::autograd::matmul_kernel);
  m.impl("linear", &tk::autograd::linear_kernel);
  m.impl("attention", &tk::autograd::attention_kernel);
  m.impl("layer_norm", &tk::autograd::layer_norm_kernel);
  m.impl("rms_norm", &tk::autograd::rms_norm_kernel);
  m.impl("rope", &tk::autograd::rope_kernel);
  m.impl("rope_qk", &tk::autograd::rope_qk_kernel);
  m.impl("linear_attention", &tk::autograd::causal_linear_kernel<tk::autograd::linear_attention_autograd,
                                                                   tk::autograd::linear_attention_ops>);
  m.impl("based_attention", &tk::autograd::causal_linear_kernel<tk::autograd::based_attention_autograd,
                                                                  tk::autograd::based_attention_ops>);
  m.impl("causal_conv1d", &tk::autograd::causal_conv1d_kernel);
  m.impl("fftconv", &tk::autograd::fftconv_kernel);
  m.impl("mamba2_ssd", &tk::autograd::mamba2_ssd_kernel);
}
