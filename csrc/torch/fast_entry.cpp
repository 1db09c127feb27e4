// The eager fast path of tk_ops.layer_norm and tk_ops.rms_norm in C++: the checks of a plain call
// done once here, and the fallback decision made without Python.
//
// The public functions (tk_ops/ops/layer_norm.py, rms_norm.py) call these entries first when not
// under torch.compile. An entry takes the public function's arguments and decides whether the call
// is plain: what `_plain_norm_arguments` accepts (x of a float dtype, at least 1-D and not empty;
// weight, bias, residual absent or of x's dtype, device and shape; eps a positive float), on
// TK_OPS_FAST_ENTRY_DEVICE tensors, without dropout (which draws a seed: left to Python), with
// return_residual a bool, and nothing a __torch_function__ could intercept (exact torch.Tensor or
// nn.Parameter objects, no TorchFunctionMode). A plain call does what the Python function does on
// that path (unit_last_stride, the op call, h as a copy of x when the op does not materialise it)
// and returns out or (out, h); any other call returns None, and the Python function runs its own
// checks (their errors, warnings and fallbacks) as it would without this entry. The op is called through the
// dispatcher, so its autograd (the C++ one at AutogradCUDA), dispatch modes, the profiler and CUDA
// graph capture see the call the Python function would make.
//
// TK_OPS_FAST_ENTRY_DEVICE is CUDA unless defined: tests/test_norm_fast_entry.py builds this file with
// CPU to run the entries without a GPU.
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/utils/wrap_outputs.h>

#include <optional>
#include <tuple>
#include <utility>

#include "fast_entry.h"
#include "strides.h"

#ifndef TK_OPS_FAST_ENTRY_DEVICE
#define TK_OPS_FAST_ENTRY_DEVICE CUDA
#endif

namespace tk::fast_entry {
namespace {

using at::Tensor;
using optional_tensor = std::optional<Tensor>;
using tk::strides::unit_last_stride;

constexpr c10::DeviceType plain_device = c10::DeviceType::TK_OPS_FAST_ENTRY_DEVICE;

// The ops, found on first use (they are defined from Python when tk_ops is imported).
const auto& layer_norm_op() {
  using signature = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const optional_tensor&,
                                                               const optional_tensor&, const optional_tensor&,
                                                               const optional_tensor&, double, double);
  static const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow("tk::layer_norm", "").typed<signature>();
  return handle;
}

const auto& rms_norm_op() {
  using signature =
      std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const optional_tensor&, const optional_tensor&, double);
  static const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow("tk::rms_norm", "").typed<signature>();
  return handle;
}

bool is_float(at::ScalarType dtype) {  // tk_ops._checks.FLOAT_DTYPES
  return dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kDouble;
}

// x of a plain call, or nullptr. Exact types only: a subclass may define __torch_function__.
const Tensor* plain_x(PyObject* object) {
  if (!THPVariable_CheckExact(object)) return nullptr;
  const Tensor& x = THPVariable_Unpack(object);
  const bool plain = x.device().type() == plain_device && is_float(x.scalar_type()) && x.dim() >= 1 && x.numel() > 0;
  return plain ? &x : nullptr;
}

// An optional tensor of a plain call: None (`tensor` stays nullptr) or an exact tensor of x's dtype
// and device with `sizes` (`tensor` points to it). False for anything else.
bool plain_optional(PyObject* object, const Tensor& x, at::IntArrayRef sizes, const Tensor*& tensor) {
  if (object == Py_None) return true;
  if (!THPVariable_CheckExact(object)) return false;
  const Tensor& t = THPVariable_Unpack(object);
  if (t.scalar_type() != x.scalar_type() || t.device() != x.device() || t.sizes() != sizes) return false;
  tensor = &t;
  return true;
}

bool plain_eps(PyObject* eps) { return PyFloat_CheckExact(eps) && PyFloat_AS_DOUBLE(eps) > 0; }

bool is_bool(PyObject* object) { return object == Py_True || object == Py_False; }

optional_tensor argument(const Tensor* t) {
  return t != nullptr ? optional_tensor(unit_last_stride(*t)) : std::nullopt;
}

// out, or (out, h) with return_residual; h is a contiguous copy of x where the op did not materialise it.
PyObject* outputs(Tensor&& out, PyObject* return_residual, bool materialised_h, Tensor&& h, const Tensor& x) {
  using torch::autograd::utils::wrap;
  if (return_residual == Py_False) return wrap(std::move(out));
  return wrap(std::make_tuple(std::move(out), materialised_h ? std::move(h) : x.clone(at::MemoryFormat::Contiguous)));
}

}  // namespace

PyObject* layer_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(nargs == 7, "tk_ops._C.layer_norm takes (x, weight, bias, eps, residual, dropout_p, return_residual), got ",
              nargs, " arguments");
  PyObject *eps = args[3], *dropout_p = args[5], *return_residual = args[6];
  const Tensor* x = plain_x(args[0]);
  if (x == nullptr || at::impl::torch_function_mode_enabled() || !plain_eps(eps) || !PyFloat_CheckExact(dropout_p) ||
      PyFloat_AS_DOUBLE(dropout_p) != 0.0 || !is_bool(return_residual)) {
    Py_RETURN_NONE;
  }
  const int64_t hidden = x->size(-1);
  const Tensor *weight = nullptr, *bias = nullptr, *residual = nullptr;
  if (!plain_optional(args[1], *x, hidden, weight) || !plain_optional(args[2], *x, hidden, bias) ||
      !plain_optional(args[4], *x, x->sizes(), residual)) {
    Py_RETURN_NONE;
  }
  const Tensor input = unit_last_stride(*x);
  auto [out, h, mean, rstd] = layer_norm_op().call(input, argument(weight), argument(bias), argument(residual),
                                                   std::nullopt, PyFloat_AS_DOUBLE(eps), PyFloat_AS_DOUBLE(dropout_p));
  return outputs(std::move(out), return_residual, residual != nullptr, std::move(h), input);
  END_HANDLE_TH_ERRORS
}

PyObject* rms_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(nargs == 5, "tk_ops._C.rms_norm takes (x, weight, eps, residual, return_residual), got ", nargs,
              " arguments");
  PyObject *eps = args[2], *return_residual = args[4];
  const Tensor* x = plain_x(args[0]);
  if (x == nullptr || at::impl::torch_function_mode_enabled() || !plain_eps(eps) || !is_bool(return_residual)) {
    Py_RETURN_NONE;
  }
  const int64_t hidden = x->size(-1);
  const Tensor *weight = nullptr, *residual = nullptr;
  if (!plain_optional(args[1], *x, hidden, weight) || !plain_optional(args[3], *x, x->sizes(), residual)) {
    Py_RETURN_NONE;
  }
  const Tensor input = unit_last_stride(*x);
  auto [out, h, rstd] = rms_norm_op().call(input, argument(weight), argument(residual), PyFloat_AS_DOUBLE(eps));
  return outputs(std::move(out), return_residual, residual != nullptr, std::move(h), input);
  END_HANDLE_TH_ERRORS
}

}  // namespace tk::fast_entry
