"""How a tk op is put together: schema, reference, fake impl, C++ kernel fallback.

Every public op ``tk::<name>`` is defined here from Python (so the CPU-only install has it) with
two implementations:

* the PyTorch reference, registered as CompositeExplicitAutograd: it serves CPU and any device
  for which the C++ extension registers no kernel;
* the Hopper kernel, registered from C++ under the CUDA key (``csrc/torch/<op>.cpp``), which
  takes precedence over the reference on CUDA.

For inputs the kernel does not support (fp32, a head dim, a GPU older than sm_90), the C++ side
calls ``tk::<name>_ref``, a twin op with the same schema that runs the same reference. The
reference warns once per op when it runs on an accelerator, so a silent slow path is impossible.

Autograd is a Python autograd.Function at the Autograd key (``register_autograd``), for every
device. The kernel-backed ops declare theirs as a table (``register_derivatives``), from which this
module builds that Function and which it hands, once, to the extension's C++ interpreter
(``csrc/torch/autograd.cpp``): that registers the same autograd at the AutogradCUDA key, where it
takes precedence on CUDA tensors, so an eager GPU call never goes back to Python between the public
function and the kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import re
import warnings
from typing import Callable, Optional

import torch

NAMESPACE = "tk"
LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_TAGS = (torch.Tag.pt2_compliant_tag,)

_REFERENCE_WARNED: set[str] = set()
_DEFINED: list[str] = []
_PYTHON_AUTOGRAD: dict[str, Callable] = {}
_DERIVATIVES: dict[str, str] = {}  # op name -> its table compiled for the C++ interpreter (Derivatives.encode)
_CPP_AUTOGRAD_KEYS: list[str] = []  # the keys whose C++ interpreter has been handed the tables


def _describe_tensors(args) -> str:
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append(f"{a.dtype}{tuple(a.shape)}".replace("torch.", ""))
    return ", ".join(parts)


def _reference_kernel(name: str, reference: Callable) -> Callable:
    """The kernel that runs ``reference``: with autocast off, so that its fp32 (fp64) math is not recast to
    16 bits when the op is called under torch.autocast (the public functions have already cast their
    inputs as autocast would); warning once per op when it serves an accelerator's tensors."""

    @functools.wraps(reference)
    def run(*args):
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        if device is None:
            return reference(*args)
        if name not in _REFERENCE_WARNED and device.type != "cpu":
            _REFERENCE_WARNED.add(name)
            warnings.warn(
                f"tk_ops: tk.{name} has no {device.type} kernel for these inputs "
                f"({_describe_tensors(args)}); running the PyTorch reference path",
                stacklevel=2,
            )
        if not torch.amp.is_autocast_available(device.type):
            return reference(*args)
        with torch.autocast(device.type, enabled=False):
            return reference(*args)

    return run


def define(name: str, schema: str, *, reference: Callable, fake: Callable):
    """Define ``tk::<name>`` and its fallback twin ``tk::<name>_ref``; return the op overload.

    ``schema`` is the part after the name, e.g. ``"(Tensor a, Tensor b) -> Tensor"``.
    ``reference`` computes the op with PyTorch ops and returns outputs with the kernel's
    strides (contiguous); ``fake`` returns empty tensors with the same metadata.
    """
    for op_name in (name, f"{name}_ref"):
        qualname = f"{NAMESPACE}::{op_name}"
        torch.library.define(qualname, schema, lib=LIB, tags=_TAGS)
        torch.library.register_kernel(qualname, None, _reference_kernel(name, reference), lib=LIB)
        torch.library.register_fake(qualname, fake, lib=LIB)
    _DEFINED.append(name)
    return getattr(torch.ops.tk, name).default


def register_autograd(op, backward: Callable, setup_context: Callable) -> None:
    """Make ``op`` differentiable: ``setup_context(ctx, inputs, output)`` saves what
    ``backward(ctx, *grads)`` needs, which returns one gradient (or None) per input.

    The kernel is a plain autograd.Function at the Autograd key. torch.library.register_autograd
    builds the same thing plus generic handling of defaults, keyword-only arguments and tensor
    lists, which tk schemas do not have (beyond trailing defaults, below); skipping it saves ~30 us of host time per call (measured
    on the 2-core CI machine), as much as a small kernel takes. An op whose autograd the extension
    also serves in C++ declares it with ``register_derivatives`` instead, which calls this.

    Trailing arguments may have defaults (tk::attention's options): a Python kernel receives a call
    without the trailing arguments that equal their defaults (the dispatcher drops them when it hands
    the call to Python), so the Autograd kernel puts them back and ``setup_context`` and ``backward``
    always see every input. The reference and fake impls of such an op take the same Python defaults.
    """
    schema = op._schema
    assert not any(a.kwarg_only for a in schema.arguments), f"{schema}: keyword-only arguments"
    assert not any(str(a.type) in ("Tensor[]", "Tensor?[]") for a in schema.arguments), f"{schema}: tensor list"
    first_default = next((i for i, a in enumerate(schema.arguments) if a.has_default_value()), len(schema.arguments))
    assert all(a.has_default_value() for a in schema.arguments[first_default:]), f"{schema}: defaults not trailing"
    defaults = tuple(a.default_value for a in schema.arguments[first_default:])
    arity = len(schema.arguments)

    def forward(ctx, *inputs):
        with torch._C._AutoDispatchBelowAutograd():
            output = op(*inputs)
        setup_context(ctx, inputs, output)
        return output

    function = type(
        f"{op._opname}_autograd",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )

    def autograd_kernel(*inputs):
        if len(inputs) < arity:
            inputs = inputs + defaults[len(inputs) - first_default :]
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*inputs):
            return function.apply(*inputs)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*inputs)

    LIB.impl(op._opname, autograd_kernel, "Autograd")
    _PYTHON_AUTOGRAD[op._opname] = autograd_kernel


# ------------------------------------------------------------------------ autograd as a table

_CALL = re.compile(r"(\w+)\((.*)\)\s*->\s*(.+)")
_TOKEN = re.compile(r"(\w+)(?:\s+if\s+(.+?)(?:\s+else\s+(\w+))?)?")
_NONE = ("none", 0)  # a saved slot's source when it saves nothing


def _is_tensor(argument) -> bool:
    return str(argument.type) in ("Tensor", "Optional[Tensor]")


def _tokens(text: str) -> list[tuple[str, Optional[str], Optional[str]]]:
    """``"a, b if c or d else e"`` as [("a", None, None), ("b", "c or d", "e")]."""
    tokens = []
    for part in text.split(","):
        match = _TOKEN.fullmatch(part.strip())
        assert match, f"cannot read {part.strip()!r} in {text!r}"
        tokens.append(match.groups())
    return tokens


@dataclasses.dataclass(frozen=True)
class _Call:
    op: torch._ops.OpOverload
    # ("grad", output, empty) | ("saved", slot, empty) | ("kept", index) | ("mask",); empty: an absent
    # tensor is passed as an empty tensor (the parameter is a Tensor), else as None (a Tensor?).
    arguments: tuple
    results: tuple  # per result of op: (the forward input it is the gradient of, the output whose gradient must have arrived, or -1)


class _Derivatives:
    """One op's autograd read from its register_derivatives declaration against the schemas: what the
    Python autograd.Function (setup_context, backward) and the C++ interpreter (``encode``) both run."""

    def __init__(self, op, backward, differentiable, materialize_grads, zeros, layout):
        schema = op._schema
        self.inputs = [a.name for a in schema.arguments]
        self.tensor_inputs = [i for i, a in enumerate(schema.arguments) if _is_tensor(a)]
        returns = schema.returns
        self.output_names = {r.name: o for o, r in enumerate(returns) if r.name}
        self.grads = {
            (f"grad_{r.name}" if r.name else "grad" if len(returns) == 1 else f"grad{o}"): o for o, r in enumerate(returns)
        }
        self.conditions: list[tuple[int, ...]] = []
        self.saved: list[tuple] = []  # (source, condition or -1, source when the condition is false)
        self.kept: list[int] = []  # the non-tensor inputs the backward reads
        self.materialize_grads = materialize_grads
        self.layout = layout
        self.calls = [self._call(text) for text in ((backward,) if isinstance(backward, str) else backward)]
        # Per output: -1 differentiable, -2 not, c >= 0 differentiable when condition c holds.
        self.differentiable = [-1] * len(returns)
        if differentiable is not None:
            self.differentiable = [-2] * len(returns)
            for name, condition, _ in _tokens(differentiable):
                self.differentiable[self.output_names[name]] = -1 if condition is None else self._condition(condition)
        self.zeros = []  # (output, saved slot): a missing gradient becomes zeros like the slot, in the output's dtype
        for grad, like in (part.split(" like ") for part in ([zeros] if zeros else [])):
            slot = next(s for s, (source, _, _) in enumerate(self.saved) if source == self._source(like.strip()))
            self.zeros.append((self.grads[grad.strip()], slot))

    def _condition(self, text: str) -> int:
        condition = tuple(self.inputs.index(name.strip()) for name in text.split(" or "))
        if condition not in self.conditions:
            self.conditions.append(condition)
        return self.conditions.index(condition)

    def _source(self, name: str) -> tuple[str, int]:
        return ("output", self.output_names[name]) if name in self.output_names else ("input", self.inputs.index(name))

    def _call(self, text: str) -> _Call:
        match = _CALL.fullmatch(text.strip())
        assert match, f"cannot read {text!r}: expected 'backward_op(arguments) -> inputs'"
        op_name, arguments, results = match.groups()
        op = getattr(torch.ops.tk, op_name).default
        parameters = op._schema.arguments
        assert len(_tokens(arguments)) == len(parameters), f"{text!r}: {len(parameters)} arguments expected"
        return _Call(
            op,
            tuple(self._argument(token, parameter) for token, parameter in zip(_tokens(arguments), parameters)),
            tuple((self.inputs.index(name), -1 if after is None else self.grads[after]) for name, after, _ in _tokens(results)),
        )

    def _argument(self, token, parameter) -> tuple:
        name, condition, alternative = token
        empty = str(parameter.type) == "Tensor"
        if name == "mask":
            return ("mask",)
        if name in self.grads:
            return ("grad", self.grads[name], empty)
        if name in self.inputs and self.inputs.index(name) not in self.tensor_inputs:
            if self.inputs.index(name) not in self.kept:
                self.kept.append(self.inputs.index(name))
            return ("kept", self.kept.index(self.inputs.index(name)))
        slot = (
            self._source(name),
            -1 if condition is None else self._condition(condition),
            _NONE if alternative is None else self._source(alternative),
        )
        if slot not in self.saved:
            self.saved.append(slot)
        return ("saved", self.saved.index(slot), empty)

    # ---- the Python autograd.Function's setup_context and backward

    def setup_context(self, ctx, inputs, output) -> None:
        outputs = output if isinstance(output, tuple) else (output,)
        holds = [any(inputs[i] is not None if i in self.tensor_inputs else bool(inputs[i]) for i in c) for c in self.conditions]
        non_differentiable = [out for out, d in zip(outputs, self.differentiable) if d == -2 or (d >= 0 and not holds[d])]
        if non_differentiable:
            ctx.mark_non_differentiable(*non_differentiable)
        if not self.materialize_grads:
            ctx.set_materialize_grads(False)
        sources = {"input": inputs, "output": outputs, "none": (None,)}
        ctx.save_for_backward(*(
            sources[kind][index]
            for (kind, index) in (primary if c < 0 or holds[c] else other for primary, c, other in self.saved)
        ))
        ctx.kept = [inputs[i] for i in self.kept]
        ctx.zero_dtypes = [outputs[o].dtype for o, _ in self.zeros]

    def backward(self, ctx, *grads):
        saved = ctx.saved_tensors
        arrived = [grad is not None for grad in grads]
        grads = list(grads)
        for (o, slot), dtype in zip(self.zeros, ctx.zero_dtypes):
            if grads[o] is None:
                grads[o] = torch.zeros_like(saved[slot], dtype=dtype)
        needs = ctx.needs_input_grad

        def gate(result) -> bool:
            input, after = result
            return needs[input] and (after < 0 or arrived[after])

        call = next((c for c in self.calls[:-1] if all(gate(r) for r in c.results)), self.calls[-1])
        mask = [gate(r) for r in call.results]
        arguments = []
        for kind, *where in call.arguments:
            if kind == "mask":
                arguments.append(mask)
            elif kind == "kept":
                arguments.append(ctx.kept[where[0]])
            else:
                value = (grads if kind == "grad" else saved)[where[0]]
                if value is None and where[1]:
                    value = next(grad for grad in grads if grad is not None).new_empty(0)
                elif value is not None and kind == "grad" and self.layout is not None:
                    value = self.layout(value)
                arguments.append(value)
        results = call.op(*arguments)
        gradients = [None] * len(self.inputs)
        for (input, _), wanted, gradient in zip(call.results, mask, results if isinstance(results, tuple) else (results,)):
            if wanted:
                gradients[input] = gradient
        return tuple(gradients)

    def encode(self) -> str:
        """This table for csrc/torch/autograd.cpp's ``parse``: one directive a line, indices for names."""
        lines = [
            "inputs " + " ".join(map(str, [len(self.inputs), *self.tensor_inputs])),
            "outputs " + " ".join(map(str, self.differentiable)),
            *("condition " + " ".join(map(str, c)) for c in self.conditions),
            *(f"save {p[0]} {p[1]} {c} {o[0]} {o[1]}" for p, c, o in self.saved),
            *(f"keep {i} {self.inputs[i]}" for i in self.kept),
            f"materialize {int(self.materialize_grads)}",
            *([f"layout {self.layout.__name__}"] if self.layout is not None else []),
            *(f"zeros {o} {slot}" for o, slot in self.zeros),
        ]
        for call in self.calls:
            lines.append(f"call {call.op._schema.name}")
            lines += [" ".join(str(int(x) if isinstance(x, bool) else x) for x in argument) for argument in call.arguments]
            lines += [f"result {input} {after}" for input, after in call.results]
        return "\n".join(lines)


def register_derivatives(
    op,
    backward: str | tuple[str, ...],
    *,
    differentiable: Optional[str] = None,
    materialize_grads: bool = True,
    zeros: str = "",
    layout: Optional[Callable] = None,
) -> None:
    """Make ``op`` differentiable from a table, in the spirit of PyTorch's derivatives.yaml: the one
    description of its autograd, from which both the Python autograd (``register_autograd``) and the
    extension's C++ autograd (csrc/torch/autograd.cpp, which reads it once, at registration) run.

    ``backward``: ``"backward_op(arguments) -> inputs"``. The arguments name, in the backward op's
    order, the forward's inputs and outputs (tensors are saved for the backward; the other inputs
    kept), the gradients of its outputs (``grad_<output>``; ``grad`` for a single unnamed output,
    ``grad0``, ``grad1``, ... for several) and ``mask`` (the bool[] of which results are wanted). A
    saved tensor may be chosen when it is saved: ``h if residual or dropout_p else x`` (a condition
    holds when one of the inputs it names is a tensor, true or nonzero), or ``out if normalize``
    (else nothing: None for a ``Tensor?`` parameter, an empty tensor for a ``Tensor``). The inputs
    after ``->`` are those the results are the gradients of, in order; a result is wanted (and
    returned) when its input required grad, and, with ``weight if grad_out``, when out's gradient
    arrived. Several calls: the first whose results are all wanted runs, else the last.

    ``differentiable``: the outputs that get a gradient (the rest are marked non-differentiable),
    each possibly with a condition (``h if residual``); all of them when None. ``materialize_grads``
    as ctx.set_materialize_grads; then ``zeros="grad_out like out"`` makes a missing gradient zeros
    like that saved tensor, in the output's dtype. ``layout`` (``_checks.unit_last_stride`` or
    causal_conv1d's ``in_accepted_layout``, which the C++ side knows by name) is applied to every
    gradient passed to the backward op.
    """
    table = _Derivatives(op, backward, differentiable, materialize_grads, zeros, layout)
    register_autograd(op, table.backward, table.setup_context)
    _DERIVATIVES[op._opname] = table.encode()
    for key in _CPP_AUTOGRAD_KEYS:
        getattr(torch.ops.tk_autograd, f"register_{key}")(op._opname, _DERIVATIVES[op._opname])


def register_cpp_autograd() -> None:
    """Hand every table to each C++ autograd interpreter a loaded library defines (the extension's,
    ``tk_autograd::register_AutogradCUDA``; tests/test_cpp_autograd.py's CPU build, ``..._AutogradCPU``),
    once: it registers a kernel at its key for each op it serves, which then runs without Python."""
    for key in ("AutogradCUDA", "AutogradCPU"):
        if key not in _CPP_AUTOGRAD_KEYS and hasattr(torch.ops.tk_autograd, f"register_{key}"):
            _CPP_AUTOGRAD_KEYS.append(key)
            for name, encoded in _DERIVATIVES.items():
                getattr(torch.ops.tk_autograd, f"register_{key}")(name, encoded)


def register_forward_only(op) -> None:
    """Make ``op`` an op without a gradient, like an inference kernel: its outputs never require grad
    (the Autograd key runs it below autograd, as a call into an extension that autograd does not see
    would), and the arguments its schema marks as written (``Tensor(a!)``) get their version counters
    bumped at the ADInplaceOrView key, as PyTorch's own in-place ops do, so autograd notices that a
    tensor it saved was overwritten, whichever kernel (reference or CUDA) wrote it.
    """
    written = [i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]

    def autograd_kernel(*inputs):
        with torch._C._AutoDispatchBelowAutograd():
            return op(*inputs)

    def version_kernel(keyset, *inputs):
        torch.autograd.graph.increment_version([inputs[i] for i in written])
        return op.redispatch(keyset & torch._C._after_ADInplaceOrView_keyset, *inputs)

    LIB.impl(op._opname, autograd_kernel, "Autograd")
    if written:
        LIB.impl(op._opname, version_kernel, "ADInplaceOrView", with_keyset=True)


def python_autograd(name: str) -> Callable:
    """The Python autograd kernel of ``tk::<name>`` (what the Autograd key runs), callable with the
    op's arguments: the reference the C++ autograd of csrc/torch/autograd.cpp is tested against."""
    return _PYTHON_AUTOGRAD[name]


def has_cpp_autograd(name: str, dispatch_key: str = "AutogradCUDA") -> bool:
    """True when the C++ autograd (csrc/torch/autograd.cpp) serves ``tk::<name>`` at ``dispatch_key``,
    taking precedence there over the Python one."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{name}", dispatch_key)


def has_cuda_kernel(name: str) -> bool:
    """True when the C++ extension registered a CUDA kernel for ``tk::<name>``."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{name}", "CUDA")


def kernel_support(name: str) -> dict[str, tuple[int, ...]]:
    """What the CUDA kernels of ``tk::<name>`` take, as the extension declares it from the kernels' own
    lists (csrc/torch/kernel_support.h), e.g. ``{"head_dims": (64, 128)}``; ``{}`` without the extension
    or without a declaration. Callers ask here instead of restating the kernels' limits."""
    if EXTENSION is None:
        return {}
    return dict(EXTENSION.kernel_support().get(name, {}))


def backends() -> dict[str, str]:
    """Which implementation serves each op on CUDA tensors: ``"cuda kernel"`` or ``"reference"``.

    A CUDA kernel still falls back to the reference for inputs it does not support (see each
    op's documentation); on CPU every op runs the reference. Where every op says ``"reference"``,
    ``tk_ops.extension_status()`` says why (the extension not built, and why not; or failed to load).
    """
    return {name: "cuda kernel" if has_cuda_kernel(name) else "reference" for name in _DEFINED}


EXTENSION_STATUS = "not loaded"
# tk_ops._C once loaded, else None. Besides registering the kernels it holds the norms' fast entries
# (csrc/torch/fast_entry.cpp), which tk_ops.layer_norm and tk_ops.rms_norm try first.
EXTENSION = None


def not_built_status(build_info, torch_version: str) -> str:
    """``"not built: <why>"`` from setup.py's record ``build_info`` (the module tk_ops._build_info, None
    when there is none), running under torch ``torch_version``."""
    if build_info is None:
        return (
            "not built: no build record (tk_ops/_build_info.py, which setup.py writes): this tk_ops was not "
            "installed by its setup.py; `pip install --no-build-isolation -e .` builds the extension where "
            "torch has CUDA and nvcc is found"
        )
    built_with = getattr(build_info, "TORCH", None)
    if getattr(build_info, "BUILDS_EXTENSION", False):
        why = (
            f"setup.py compiled it (against torch {built_with}), but there is no tk_ops/_C module: "
            "rebuild with `pip install --no-build-isolation -e .`"
        )
    else:
        why = getattr(build_info, "REASON", "") or "setup.py gave no reason"
    if built_with and built_with != torch_version:
        why += f" (set up under torch {built_with}, running torch {torch_version}: reinstall tk_ops to rebuild)"
    return f"not built: {why}"


def _build_record():
    try:
        return importlib.import_module("tk_ops._build_info")
    except ImportError:
        return None


def load_extension() -> None:
    """Load ``tk_ops._C`` (the CUDA kernels) when it was built; otherwise keep the references."""
    global EXTENSION, EXTENSION_STATUS
    if os.environ.get("TK_OPS_DISABLE_EXTENSION") == "1":
        EXTENSION_STATUS = "disabled by TK_OPS_DISABLE_EXTENSION=1"
        return
    try:
        extension = importlib.import_module("tk_ops._C")  # registers the CUDA kernels on import
    except ModuleNotFoundError as error:
        if error.name != "tk_ops._C":  # the extension is there, something it imports is not
            EXTENSION_STATUS = f"failed to load: {error}"
            warnings.warn(f"tk_ops: the CUDA extension failed to load ({error}); using reference paths")
            return
        EXTENSION_STATUS = not_built_status(_build_record(), torch.__version__)
        return
    except (ImportError, OSError) as error:  # built for another torch or CUDA
        EXTENSION_STATUS = f"failed to load: {error}"
        warnings.warn(f"tk_ops: the CUDA extension failed to load ({error}); using reference paths")
        return
    EXTENSION, EXTENSION_STATUS = extension, "loaded"
    register_cpp_autograd()
