// Autograd of the kernel-backed tk ops in C++, registered at the AutogradCUDA key, read from the same
// table as their Python autograd.
//
// Each op declares its autograd once, as a table (tk_ops/ops/<op>.py, _library.register_derivatives:
// the backward op, which inputs and outputs it takes, which outputs are differentiable, which gradients
// it returns). tk_ops/_library.py builds the Python autograd.Function from it, registered at the
// Autograd alias key for every device, and hands the table, compiled to indices, to `parse` below
// once, when the extension loads (tk_autograd::register_<key>). The interpreter here then registers
// a boxed kernel at AutogradCUDA, which takes precedence over the alias on CUDA tensors, so an eager
// call on the GPU never re-enters Python between the public function and the CUDA kernel. Its
// Function does what the Python one does: the same saved tensors, the same outputs without a
// gradient, materialize_grads, needs_input_grad taken when the forward runs, the same backward op
// calls and output masks. Forward and backward call the tk ops through the dispatcher, so fake
// tensors, torch.compile, export, opcheck and compiled autograd see the same tk ops as with the
// Python autograd. Outputs the table marks non-differentiable leave the Function beside it (see
// `table_kernel`).
//
// Knows no CUDA: TK_OPS_AUTOGRAD_KEY (AutogradCUDA unless defined) lets a CPU-only torch build this
// file for AutogradCPU, which is how tests/test_cpp_autograd.py checks it against the Python
// autograd without a GPU.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/stack.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "strides.h"

#ifndef TK_OPS_AUTOGRAD_KEY
#define TK_OPS_AUTOGRAD_KEY AutogradCUDA
#endif
#define TK_OPS_STRINGIFY(X) #X
#define TK_OPS_NAME_OF(X) TK_OPS_STRINGIFY(X)

namespace tk::autograd {

using at::IValue;
using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using torch::jit::Stack;

namespace {

// ------------------------------------------------------------------------------ the table

// tk_ops/ops/causal_conv1d.py's in_accepted_layout: (B, D, L) read in place when channel-first
// (unit stride along L) or channel-last (unit stride along D), else copied.
Tensor in_accepted_layout(const Tensor& t) {
  const bool channel_last = t.size(2) > 1 && t.stride(2) != 1 && t.stride(1) == 1;
  return t.size(2) == 1 || t.stride(2) == 1 || channel_last ? t : t.contiguous();
}

// A tensor in the forward: input `index`, output `index`, or nothing.
struct source {
  char kind = 'n';  // 'i'nput, 'o'utput, 'n'one
  int index = 0;
};

// What the backward finds at one saved position: `primary`, or `otherwise` when `condition` (>= 0) fails.
struct saved_slot {
  source primary;
  int condition = -1;
  source otherwise;
};

// One argument of a backward op: the gradient of an output, a saved tensor, a kept non-tensor input,
// or the mask of wanted results. `empty`: an absent tensor is passed as an empty one (the parameter is
// a Tensor), else as None (a Tensor?).
struct argument {
  char kind = 'm';  // 'g'rad, 's'aved, 'k'ept, 'm'ask
  int index = 0;
  bool empty = false;
};

// A result of a backward op: the gradient of forward input `input`, wanted when that input required
// grad and, if `after` >= 0, the gradient of output `after` arrived.
struct result {
  int input = 0;
  int after = -1;
};

struct backward_call {
  c10::OperatorHandle op;
  std::vector<argument> arguments;
  std::vector<result> results;
};

// tk_ops/_library.py's _Derivatives, by index (its `encode` writes what `parse` reads).
struct table {
  std::optional<c10::OperatorHandle> op;       // the forward op
  int arity = 0;
  std::vector<int> tensor_inputs;              // positions of the Tensor and Tensor? inputs
  std::vector<int> differentiable;             // per output: -1 yes, -2 no, c: when condition c holds
  std::vector<std::vector<int>> conditions;    // each: inputs of which one is a tensor, true or nonzero
  std::vector<saved_slot> saved;
  std::vector<std::pair<int, std::string>> kept;  // non-tensor inputs the backward reads, by name
  bool materialize_grads = true;
  Tensor (*layout)(const Tensor&) = nullptr;   // applied to each gradient passed to a backward op
  std::vector<std::pair<int, int>> zeros;      // (output, slot): a missing gradient is zeros like the slot
  std::vector<backward_call> calls;            // the first whose results are all wanted runs, else the last
};

// What the forward records for the backward, as bits in one saved_data entry (keys under 16
// characters, so the std::string built for each lookup stays inline: no heap allocation):
// needs_input_grad of a Python autograd.Function: per tensor input, whether it required grad when
// the forward ran (not whether this backward pass asks for it), bit i for the input at position i;
// PRESENT: the tensor inputs that are not None, which are the Function's inputs, in order;
// DIFFERENTIABLE: the outputs the Function returned, bit o for output o.
constexpr const char* RECORD = "record";
constexpr int PRESENT = 24, DIFFERENTIABLE = 48;  // where those bits start (inputs under 24, outputs under 16)

std::vector<int> read_ints(std::istringstream& line) {
  std::vector<int> values;
  for (int value; line >> value;) values.push_back(value);
  return values;
}

// The first letter of the next word: the kinds of source and argument are told apart by it.
char read_kind(std::istringstream& line) {
  std::string word;
  line >> word;
  return word.empty() ? ' ' : word[0];
}

source read_source(std::istringstream& line) {
  source s;
  s.kind = read_kind(line);
  line >> s.index;
  return s;
}

c10::OperatorHandle find_op(const std::string& name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "");
}

table parse(const std::string& op, const std::string& text) {
  table t;
  t.op = find_op("tk::" + op);
  std::istringstream lines(text);
  for (std::string text_line; std::getline(lines, text_line);) {
    std::istringstream line(text_line);
    std::string directive;
    line >> directive;
    if (directive == "inputs") {
      line >> t.arity;
      t.tensor_inputs = read_ints(line);
      TORCH_CHECK(t.arity <= PRESENT, "tk autograd: tk::", op, " has over ", PRESENT, " inputs");
    } else if (directive == "outputs") {
      t.differentiable = read_ints(line);
      TORCH_CHECK(t.differentiable.size() <= 64 - DIFFERENTIABLE, "tk autograd: tk::", op, " has too many outputs");
    } else if (directive == "condition") {
      t.conditions.push_back(read_ints(line));
    } else if (directive == "save") {
      saved_slot& slot = t.saved.emplace_back();
      slot.primary = read_source(line);
      line >> slot.condition;
      slot.otherwise = read_source(line);
    } else if (directive == "keep") {
      auto& [index, name] = t.kept.emplace_back();
      line >> index >> name;
    } else if (directive == "materialize") {
      line >> t.materialize_grads;
    } else if (directive == "layout") {
      std::string name;
      line >> name;
      TORCH_CHECK(name == "unit_last_stride" || name == "in_accepted_layout", "tk autograd: no layout ", name);
      t.layout = name == "unit_last_stride" ? &tk::strides::unit_last_stride : &in_accepted_layout;
    } else if (directive == "zeros") {
      auto& [output, slot] = t.zeros.emplace_back();
      line >> output >> slot;
    } else if (directive == "call") {
      std::string name;
      line >> name;
      t.calls.push_back({find_op(name), {}, {}});
    } else if (directive == "result") {
      result& r = t.calls.back().results.emplace_back();
      line >> r.input >> r.after;
    } else {
      TORCH_CHECK(!t.calls.empty(), "tk autograd: an argument before any call: '", text_line, "'");
      argument& a = t.calls.back().arguments.emplace_back();
      a.kind = directive[0];
      line >> a.index >> a.empty;
    }
    TORCH_CHECK(!line.bad(), "tk autograd: cannot read '", text_line, "'");
  }
  TORCH_CHECK(!t.calls.empty(), "tk autograd: no backward op for tk::", op);
  return t;
}

// ------------------------------------------------------------------------ the interpreter

// The truth of an input in a condition: a tensor is there, a bool is true, a float is nonzero (the tables'
// conditions name tensors, bools and layer_norm's dropout_p).
bool holds(const IValue& value) {
  if (value.isTensor()) return value.toTensor().defined();
  if (value.isBool()) return value.toBool();
  if (value.isDouble()) return value.toDouble() != 0;
  return false;
}

bool has_bit(int64_t bits, int index) { return (bits >> index) & 1; }

std::string zeros_dtype_key(int output) { return "dtype" + std::to_string(output); }

}  // namespace

// The Function of the op whose name Self carries (its node's name() is
// torch::autograd::CppNode<tk::autograd::<op>_autograd>). Its backward calls tk ops only, so compiled
// autograd may trace it.
template <typename Self>
struct table_function : torch::autograd::Function<Self> {
  static constexpr bool is_traceable = true;
  static inline std::unique_ptr<const table> derivatives;  // set once, when the op's table is registered

  // `stack` holds the op's arguments, of which `inputs` are the tensors (what autograd sees); it
  // receives all the op's outputs. Returns the differentiable ones, whose positions go to `returned_at`.
  static variable_list forward(AutogradContext* ctx, at::TensorList /*inputs*/, Stack* stack,
                               std::vector<size_t>* returned_at) {
    const table& t = *derivatives;
    const std::vector<IValue> arguments(stack->end() - t.arity, stack->end());
    int64_t record = 0;
    for (int i : t.tensor_inputs) {
      if (!arguments[i].isTensor()) continue;
      record |= int64_t{1} << (PRESENT + i);
      if (arguments[i].toTensor().requires_grad()) record |= int64_t{1} << i;
    }
    std::vector<bool> condition(t.conditions.size());
    for (size_t c = 0; c < t.conditions.size(); ++c) {
      for (int i : t.conditions[c]) condition[c] = condition[c] || holds(arguments[i]);
    }
    {
      const at::AutoDispatchBelowAutograd guard;
      t.op->callBoxed(stack);
    }
    const auto outputs = torch::jit::last(*stack, static_cast<size_t>(t.differentiable.size()));
    variable_list returned;
    for (size_t o = 0; o < outputs.size(); ++o) {
      const int d = t.differentiable[o];
      if (d == -1 || (d >= 0 && condition[d])) {
        record |= int64_t{1} << (DIFFERENTIABLE + o);
        returned.push_back(outputs[o].toTensor());
        returned_at->push_back(o);
      }
    }
    const auto tensor = [&](const source& s) {
      if (s.kind == 'i') return arguments[s.index].isTensor() ? arguments[s.index].toTensor() : Tensor();
      return s.kind == 'o' ? outputs[s.index].toTensor() : Tensor();
    };
    variable_list saved;
    for (const saved_slot& slot : t.saved) {
      saved.push_back(tensor(slot.condition < 0 || condition[slot.condition] ? slot.primary : slot.otherwise));
    }
    ctx->save_for_backward(saved);
    for (const auto& [index, name] : t.kept) ctx->saved_data[name] = arguments[index];
    for (const auto& [output, slot] : t.zeros) {
      ctx->saved_data[zeros_dtype_key(output)] = static_cast<int64_t>(outputs[output].toTensor().scalar_type());
    }
    ctx->saved_data[RECORD] = record;
    // An output that gets no gradient then arrives undefined, not as a tensor of zeros.
    ctx->set_materialize_grads(t.materialize_grads);
    return returned;
  }

  static variable_list backward(AutogradContext* ctx, variable_list returned_grads) {
    const table& t = *derivatives;
    const variable_list saved = ctx->get_saved_variables();
    const int64_t record = ctx->saved_data.at(RECORD).toInt();
    const int64_t present = (record >> PRESENT) & ((int64_t{1} << (DIFFERENTIABLE - PRESENT)) - 1);
    // Per output, its gradient (undefined for the outputs the Function did not return).
    variable_list grads(t.differentiable.size());
    std::vector<bool> arrived(grads.size());
    for (size_t o = 0, next = 0; o < grads.size(); ++o) {
      if (has_bit(record, DIFFERENTIABLE + static_cast<int>(o))) grads[o] = returned_grads[next++];
      arrived[o] = grads[o].defined();
    }
    for (const auto& [output, slot] : t.zeros) {
      if (grads[output].defined()) continue;
      const auto dtype = static_cast<at::ScalarType>(ctx->saved_data.at(zeros_dtype_key(output)).toInt());
      grads[output] = at::zeros_like(saved[slot], saved[slot].options().dtype(dtype));
    }
    const auto wanted = [&](const result& r) {
      return has_bit(record, r.input) && (r.after < 0 || arrived[r.after]);
    };
    const backward_call* call = &t.calls.back();
    for (size_t c = 0; c + 1 < t.calls.size(); ++c) {
      const auto& results = t.calls[c].results;
      if (std::all_of(results.begin(), results.end(), wanted)) {
        call = &t.calls[c];
        break;
      }
    }
    const auto any_grad = [&] { return *std::find_if(grads.begin(), grads.end(), [](const Tensor& g) { return g.defined(); }); };
    Stack stack;
    stack.reserve(call->arguments.size());
    for (const argument& a : call->arguments) {
      if (a.kind == 'm') {
        c10::List<bool> mask;
        for (const result& r : call->results) mask.push_back(wanted(r));
        stack.emplace_back(std::move(mask));
      } else if (a.kind == 'k') {
        stack.push_back(ctx->saved_data.at(t.kept[a.index].second));
      } else {
        Tensor value = a.kind == 'g' ? grads[a.index] : saved[a.index];
        if (!value.defined()) {
          stack.emplace_back(a.empty ? IValue(at::empty({0}, any_grad().options())) : IValue());
        } else {
          stack.emplace_back(a.kind == 'g' && t.layout != nullptr ? t.layout(value) : value);
        }
      }
    }
    call->op.callBoxed(stack);
    // One gradient per input of the Function (the tensors present, in order), then none for `stack`
    // and `returned_at`.
    variable_list input_grads(static_cast<size_t>(__builtin_popcountll(present)) + 2);
    for (size_t j = 0; j < call->results.size(); ++j) {
      const result& r = call->results[j];
      if (!wanted(r) || !has_bit(present, r.input)) continue;
      input_grads[__builtin_popcountll(present & ((int64_t{1} << r.input) - 1))] = stack[j].toTensor();
    }
    return input_grads;
  }
};

// The boxed kernel of op Self at the autograd key, as the Python kernel of tk_ops/_library.py: below
// autograd when no graph is built, else through the Function, whose outputs replace the op's
// differentiable outputs; the others (marked non-differentiable in Python) come out beside it exactly
// as marked outputs do (no grad_fn, requires_grad False), and the node's context marks nothing:
// compiled autograd refuses C++ nodes whose context marked outputs non-differentiable
// (CppNode::compiled_args asserts it never did).
template <typename Self>
struct table_kernel final : c10::OperatorKernel {
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, Stack* stack) {
    const table& t = *Self::derivatives;
    variable_list inputs;
    bool builds_graph = false;
    for (int i : t.tensor_inputs) {
      const IValue& value = (*stack)[stack->size() - t.arity + i];
      if (!value.isTensor()) continue;
      inputs.push_back(value.toTensor());
      builds_graph = builds_graph || value.toTensor().requires_grad();
    }
    if (!at::GradMode::is_enabled() || !builds_graph) {
      const at::AutoDispatchBelowAutograd guard;
      op.callBoxed(stack);
      return;
    }
    std::vector<size_t> returned_at;
    const variable_list returned = Self::apply(at::TensorList(inputs), stack, &returned_at);
    const auto outputs = stack->end() - static_cast<std::ptrdiff_t>(t.differentiable.size());
    for (size_t r = 0; r < returned.size(); ++r) outputs[static_cast<std::ptrdiff_t>(returned_at[r])] = returned[r];
  }
};

// One Function type per op, so that each node names its op. An op listed here gets its C++ autograd
// when tk_ops/_library.py hands over its table; the others keep the Python one.
#define TK_OPS_AUTOGRAD_OPS(X)                                                                          \
  X(matmul) X(linear) X(attention) X(layer_norm) X(rms_norm) X(rope) X(rope_qk) X(linear_attention) \
      X(based_attention) X(causal_conv1d) X(fftconv) X(mamba2_ssd)

#define TK_OPS_DECLARE_FUNCTION(OP) \
  struct OP##_autograd : table_function<OP##_autograd> {};
TK_OPS_AUTOGRAD_OPS(TK_OPS_DECLARE_FUNCTION)
#undef TK_OPS_DECLARE_FUNCTION

namespace {

template <typename Self>
bool register_table(const std::string& op, const std::string& text) {
  static torch::Library library(torch::Library::IMPL, "tk", c10::DispatchKey::TK_OPS_AUTOGRAD_KEY, __FILE__,
                                __LINE__);
  if (Self::derivatives) return false;
  Self::derivatives = std::make_unique<const table>(parse(op, text));
  library.impl(op.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::make_unique<table_kernel<Self>>()));
  return true;
}

// tk_autograd::register_<key>(op, table): registers tk::<op>'s autograd at the key from the table that
// tk_ops/_library.py's register_derivatives encoded; false when this file has no Function for the op
// (it keeps its Python autograd) or already registered it.
bool register_autograd(std::string op, std::string text) {
#define TK_OPS_REGISTER(OP) \
  if (op == #OP) return register_table<OP##_autograd>(op, text);
  TK_OPS_AUTOGRAD_OPS(TK_OPS_REGISTER)
#undef TK_OPS_REGISTER
  return false;
}

}  // namespace
}  // namespace tk::autograd

TORCH_LIBRARY_FRAGMENT(tk_autograd, m) {
  m.def("register_" TK_OPS_NAME_OF(TK_OPS_AUTOGRAD_KEY) "(str op, str table) -> bool",
        &tk::autograd::register_autograd);
}
