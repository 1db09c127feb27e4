"""An LM head and its loss -> ``tk_ops.linear_cross_entropy``: a rewrite of the graph Dynamo captures.

By the time the joint-graph passes run, ``F.cross_entropy`` is decomposed into a dozen nodes whose
constants (ignore_index, 1 - label_smoothing, label_smoothing / V) a traced pattern could only match
as wildcards. Dynamo's graph, before autograd (Inductor's ``pre_grad_custom_pass``), still holds the
calls as written, with every argument::

    logits = torch._C._nn.linear(x, weight, bias)        F.linear, nn.Linear (bias optional)
    logits = logits.float()                              or .to(torch.float32)
    logits = logits.view(-1, V)                          any of view, reshape, flatten, contiguous,
    loss   = F.cross_entropy(logits, target, ...)        before or after the cast, or none

and the chain becomes one call of ``tk_ops.linear_cross_entropy`` on x's rows, whose autograd puts
``tk.linear_cross_entropy`` and ``tk.linear_cross_entropy_bwd`` in the forward and backward graphs (or,
on the CUDA kernels' inputs with "mean" or "sum", ``tk.linear_cross_entropy_with_grads`` in the forward
graph and the scaling of its gradients in the backward one).

Why it is exact, node by node:
  * the linear is ``F.linear(x, weight, bias)``: logits (..., V) = x weight^T + bias;
  * the links between it and the loss are casts to fp32 and reshapes, which keep the elements in
    their logical order, so row i of the loss's (M, V) input is the i-th leading index of the
    logits, x.reshape(-1, H)'s row i;
  * the loss is ``F.cross_entropy`` on that 2-D input (classes along dim 1, V of them) with class
    indices (a 1-D int64 target of M rows), no class weights (nor the legacy size_average and
    reduce), and constant ignore_index, label_smoothing in [0, 1] and reduction, which the tk
    function takes as they are;
  * the logits are 16-bit (bf16/fp16, as the other rewrites require) and the loss's input fp32, so
    eager computes the loss in fp32 as tk does; tk's logits are the fp32 accumulator itself, where
    eager's are rounded to 16 bits before the cast (a rounding, not a change of function);
  * x, weight and bias are cast to the logits' dtype first: a no-op without autocast, and
    autocast's own cast (fp32 operands, 16-bit logits) with it, made explicit so that the new call
    does not depend on whether autocast is still on where the loss stood;
  * nothing else reads the logits or an intermediate (otherwise they must exist anyway).
Anything else (fp32 or fp64 logits, no cast, 3-D logits with dim 1 as the classes, probabilities as
targets, class weights, arguments computed in the graph) is left alone.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

import tk_ops
from tk_ops._checks import KERNEL_DTYPES
from tk_ops.inductor.options import RewriteOptions
from tk_ops.ops.linear_cross_entropy import REDUCTIONS

_LINEARS = (torch._C._nn.linear, F.linear)
_CROSS_ENTROPY_SIGNATURE = inspect.signature(F.cross_entropy)
_LINEAR_ARGUMENTS = ("input", "weight", "bias")
_RESHAPE_METHODS = ("view", "reshape", "flatten", "contiguous")
_RESHAPE_FUNCTIONS = (torch.reshape, torch.flatten)


def _value(node) -> Optional[torch.Tensor]:
    """The example value Dynamo recorded for a node (None for a constant)."""
    if not isinstance(node, torch.fx.Node):
        return None
    value = node.meta.get("example_value", node.meta.get("val"))
    return value if isinstance(value, torch.Tensor) else None


def _is_fp32_cast(node: torch.fx.Node) -> bool:
    if node.op != "call_method" or node.kwargs.keys() - {"dtype"}:
        return False
    if node.target == "float":
        return len(node.args) == 1 and not node.kwargs
    dtypes = list(node.args[1:]) + list(node.kwargs.values())
    return node.target == "to" and dtypes == [torch.float32]


def _is_reshape(node: torch.fx.Node) -> bool:
    """An op that keeps the elements in their logical (row-major) order, and their values
    (``view(dtype)``, a reinterpretation of the bits, is not one)."""
    if any(isinstance(arg, torch.dtype) for arg in (*node.args, *node.kwargs.values())):
        return False
    if node.op == "call_method":
        return node.target in _RESHAPE_METHODS
    return node.op == "call_function" and node.target in _RESHAPE_FUNCTIONS


def _linear_arguments(node: torch.fx.Node) -> Optional[dict]:
    if len(node.args) > len(_LINEAR_ARGUMENTS) or node.kwargs.keys() - set(_LINEAR_ARGUMENTS):
        return None
    arguments = dict(zip(_LINEAR_ARGUMENTS, node.args)) | dict(node.kwargs)
    arguments.setdefault("bias", None)
    return arguments if {"input", "weight"} <= arguments.keys() else None


def _loss_arguments(node: torch.fx.Node) -> Optional[tuple[object, object, dict]]:
    """(input, target, tk's options) of an F.cross_entropy call when tk computes the same loss with those
    options, else None."""
    try:
        bound = _CROSS_ENTROPY_SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    arguments = bound.arguments
    if any(arguments[name] is not None for name in ("weight", "size_average", "reduce")):
        return None
    ignore_index, label_smoothing, reduction = (arguments[n] for n in ("ignore_index", "label_smoothing", "reduction"))
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        return None
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        return None
    if not 0.0 <= label_smoothing <= 1.0 or reduction not in REDUCTIONS:
        return None
    options = dict(ignore_index=ignore_index, label_smoothing=float(label_smoothing), reduction=reduction)
    return arguments["input"], arguments["target"], options


def _only_reader(node: torch.fx.Node, reader: torch.fx.Node) -> bool:
    return list(node.users) == [reader]


def _head_chain(loss: torch.fx.Node, loss_input) -> Optional[tuple[torch.fx.Node, list[torch.fx.Node]]]:
    """(the linear, the casts and reshapes from it to the loss) when the loss's input is such a chain,
    each node read by the next one only."""
    chain, node, reader = [], loss_input, loss
    while isinstance(node, torch.fx.Node) and (_is_fp32_cast(node) or _is_reshape(node)):
        if not _only_reader(node, reader):
            return None
        chain.append(node)
        node, reader = node.args[0], node
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _LINEARS):
        return None
    return (node, chain) if _only_reader(node, reader) else None


def _fused_head_loss(x, weight, bias, target, dtype, ignore_index, label_smoothing, reduction):
    """The matched chain on tk: the linear's operands in its logits' dtype, every leading index of x a row."""
    x, weight, bias = x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
    return tk_ops.linear_cross_entropy(x.reshape(-1, x.shape[-1]), weight, target, bias=bias,
                                       ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction)


def _rewrite(graph: torch.fx.Graph, loss: torch.fx.Node, options: RewriteOptions) -> bool:
    """Replace one F.cross_entropy node and its head (see the module docstring); False where not exact."""
    loss_arguments = _loss_arguments(loss)
    if loss_arguments is None:
        return False
    loss_input_node, target_node, loss_options = loss_arguments
    head = _head_chain(loss, loss_input_node)
    linear_arguments = None if head is None else _linear_arguments(head[0])
    if linear_arguments is None:
        return False
    linear, chain = head
    operands = [linear_arguments[name] for name in _LINEAR_ARGUMENTS]
    x, weight, bias = (_value(node) for node in operands)
    logits, loss_input, target = _value(linear), _value(loss_input_node), _value(target_node)
    if any(t is None for t in (x, weight, logits, loss_input, target)) or (operands[2] is not None and bias is None):
        return False
    if logits.dtype not in KERNEL_DTYPES or loss_input.dtype != torch.float32 or weight.dim() != 2:
        return False
    if not all(t.dtype in (logits.dtype, torch.float32) for t in (x, weight, bias) if t is not None):
        return False  # operands of the logits' dtype, or fp32 ones that autocast cast to it
    if loss_input.dim() != 2 or not statically_known_true(loss_input.shape[1] == weight.shape[0]):
        return False
    rows = loss_input.shape[0]
    if target.dtype != torch.int64 or target.dim() != 1 or not statically_known_true(target.shape[0] == rows):
        return False
    if not options.serves(logits.device, "linear_cross_entropy"):
        return False
    with graph.inserting_before(loss):
        fused = graph.call_function(_fused_head_loss, (*operands, target_node, logits.dtype, *loss_options.values()))
    fused.meta.update(loss.meta)  # the same value: fp32, the loss's shape
    loss.replace_all_uses_with(fused)
    for node in (loss, *chain, linear):
        graph.erase_node(node)
    return True


def rewrite_linear_cross_entropy(graph: torch.fx.Graph, options: RewriteOptions) -> int:
    """Replace every exact LM-head loss of a Dynamo graph by tk_ops.linear_cross_entropy; return how many."""
    losses = [node for node in graph.nodes if node.op == "call_function" and node.target is F.cross_entropy]
    return sum(_rewrite(graph, loss, options) for loss in losses)
