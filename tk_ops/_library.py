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
device. For the kernel-backed ops the extension also registers the same autograd in C++ at the
AutogradCUDA key (``csrc/torch/autograd.cpp``), which takes precedence on CUDA tensors: an eager
GPU call then never goes back to Python between the public function and the kernel.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from typing import Callable

import torch

NAMESPACE = "tk"
LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_TAGS = (torch.Tag.pt2_compliant_tag,)

_REFERENCE_WARNED: set[str] = set()
_DEFINED: list[str] = []
_PYTHON_AUTOGRAD: dict[str, Callable] = {}


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
    on the 2-core CI machine), as much as a small kernel takes. On CUDA tensors the C++ kernels of
    csrc/torch/autograd.cpp take precedence where the extension registers one (``has_cpp_autograd``);
    a change here must be made there too (tests/test_cpp_autograd.py compares the two bit for bit).

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
    op's arguments: the reference the C++ autograd kernels of csrc/torch/autograd.cpp are tested against."""
    return _PYTHON_AUTOGRAD[name]


def has_cpp_autograd(name: str, dispatch_key: str = "AutogradCUDA") -> bool:
    """True when a C++ autograd kernel (csrc/torch/autograd.cpp) serves ``tk::<name>`` at ``dispatch_key``,
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
