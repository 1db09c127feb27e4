"""``F.dropout(x, p) + residual`` into ``F.layer_norm`` -> one ``tk.layer_norm`` with its hash dropout.

A hand-written node rewrite that runs after the pattern rewrites (patterns.py). Those have already
turned ``F.layer_norm(a + residual)`` (a on either side of the add; h = a + residual read
elsewhere too, pre-LN, or not, post-LN; weight and bias optional) into
``tk.layer_norm(a, weight, bias, residual, None, eps, 0.0)`` and, in training graphs, its
decomposed backward into ``tk.layer_norm_bwd``. Here ``a`` is recognised as a dropout of x and
folded in: the forward becomes ``tk.layer_norm(x, weight, bias, residual, seed, eps, p)`` with
``seed`` a 0-dim int64 tensor drawn in the graph on x's device (as ``tk_ops.layer_norm`` draws it),
each backward becomes a ``tk.layer_norm_bwd`` with the same seed, and the dropout's own backward
multiply reads that backward's grad_x. Tracing the dropout into a ``register_replacement``
pattern does not work for training graphs: the keep mask is also read by the dropout's backward.

Dropout forms matched (``a`` of x's shape and dtype, read by nothing but the norm):
  * decomposed, Inductor's default (``aten.native_dropout``'s decomposition, the same for every
    device; seen on CPU)::

        keep = gt(u, p) or ge(u, p)          u uniform in [0, 1) of x's shape, possibly cast
        a    = mul(mul(keep, x), 1 / (1 - p))    (each multiply's operands in either order)

    where u is ``prims.inductor_random(.., "rand")`` (Inductor's replace_random pass, seen on
    CPU), ``aten.rand_like`` / ``aten.rand`` (a hand-written mask), or output 0 of
    ``rngprims.philox_rand`` (functionalized RNG, CUDA only: matched by structure, not seen);
  * fused: ``a, keep = aten.native_dropout(x, p, True)`` (``inductor.config.fallback_random``).
In training graphs every other reader of keep must be the dropout's backward,
``mul(grad, mul(convert_element_type(keep), 1 / (1 - p)))`` with grad the norm backward's gradient
of ``a``; anything else reading keep or ``a`` leaves the chain alone.

Why it is exact: with 0 < p < 1 the tk op keeps each element with probability 1 - p (torch's
``u > p``; torch's draws differ, as any two dropout draws do) and scales kept ones by 1 / (1 - p);
forward and backward regenerate one mask from one seed. h = dropout(x) + residual is the op's
output 1, to which the residual stream's other readers are routed; it differs from eager's only
in that x * 1/(1-p) is not rounded to x's dtype before the add. The norm itself was checked exact
by the pattern rule (bf16/fp16, last dim, matching parameter shapes, a device the kernel serves);
x and residual must share a kernel dtype, so both gradients of the add have that dtype.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import torch
import torch.fx
from torch._inductor import inductor_prims

from tk_ops._checks import KERNEL_DTYPES
from tk_ops.inductor import _graph
from tk_ops.inductor.options import RewriteOptions
from tk_ops.ops.layer_norm import DROPOUT_SEED_BOUND

aten, prims, tk = torch.ops.aten, torch.ops.prims, torch.ops.tk

_UNIFORM_OPS = (aten.rand_like.default, aten.rand.default)
_KEEP_COMPARISONS = (aten.gt.Scalar, aten.ge.Scalar)  # u > p and u >= p: the same law


def _shape(node):
    return _graph.fake_value(node).shape


def _scaled_operand(node, scale: float) -> Optional[torch.fx.Node]:
    """t where ``node`` is ``t * scale`` (either order), else None."""
    if not _graph.is_call(node, aten.mul.Tensor):
        return None
    for tensor, number in (node.args, reversed(node.args)):
        if isinstance(tensor, torch.fx.Node) and not isinstance(number, torch.fx.Node) and number == scale:
            return tensor
    return None


def _is_uniform(node, shape) -> bool:
    """``node`` is a uniform [0, 1) draw of ``shape`` (possibly cast to another float dtype)."""
    if _graph.is_call(node, prims.convert_element_type.default):
        node = node.args[0]
    if _graph.is_call(node, inductor_prims.random):
        drawn = node.args[2] == "rand"
    elif _graph.is_call(node, operator.getitem):
        drawn = _graph.is_call(node.args[0], torch.ops.rngprims.philox_rand.default) and node.args[1] == 0
    else:
        drawn = _graph.is_call(node, *_UNIFORM_OPS)
    return drawn and _shape(node) == shape


@dataclasses.dataclass
class _Dropout:
    x: torch.fx.Node
    p: float
    keep_readers: list[torch.fx.Node]  # readers of the keep mask other than the forward multiply


def _valid_probability(p) -> bool:
    return isinstance(p, float) and 0 < p < 1


def _fused_dropout(dropped: torch.fx.Node) -> Optional[_Dropout]:
    """``dropped`` is output 0 of ``aten.native_dropout(x, p, True)``."""
    if not (_graph.is_call(dropped, operator.getitem) and dropped.args[1] == 0):
        return None
    fused = dropped.args[0]
    if not _graph.is_call(fused, aten.native_dropout.default):
        return None
    arguments = _graph.bind_arguments(fused)
    outputs = _graph.getitem_users(fused)
    if arguments["train"] is not True or not _valid_probability(arguments["p"]) or outputs is None:
        return None
    keep_readers = [reader for keep in outputs.get(1, []) for reader in keep.users]
    return _Dropout(arguments["input"], arguments["p"], keep_readers)


def _decomposed_dropout(dropped: torch.fx.Node) -> Optional[_Dropout]:
    """``dropped`` is ``mul(mul(gt(u, p), x), 1 / (1 - p))``."""
    if not _graph.is_call(dropped, aten.mul.Tensor):
        return None
    masked = next((arg for arg in dropped.args if isinstance(arg, torch.fx.Node)), None)
    if not _graph.is_call(masked, aten.mul.Tensor) or len(masked.users) != 1:
        return None
    for keep, x in (masked.args, reversed(masked.args)):
        if not (_graph.is_call(keep, *_KEEP_COMPARISONS) and isinstance(x, torch.fx.Node)):
            continue
        uniform, p = keep.args
        if not (_valid_probability(p) and _scaled_operand(dropped, 1.0 / (1.0 - p)) is masked):
            continue
        if _is_uniform(uniform, _shape(x)) and _shape(keep) == _shape(x):
            return _Dropout(x, p, [reader for reader in keep.users if reader is not masked])
    return None


def _dropout_backward(reader: torch.fx.Node, p: float) -> Optional[list[torch.fx.Node]]:
    """The multiplies ``grad * (float(keep) * 1/(1-p))`` that ``reader`` (a cast of keep) feeds."""
    if not _graph.is_call(reader, prims.convert_element_type.default):
        return None
    multiplies = []
    for scaled in reader.users:
        if _scaled_operand(scaled, 1.0 / (1.0 - p)) is not reader:
            return None
        for multiply in scaled.users:
            if not _graph.is_call(multiply, aten.mul.Tensor) or list(multiply.args).count(scaled) != 1:
                return None
            multiplies.append(multiply)
    return multiplies


@dataclasses.dataclass
class _Chain:
    norm: torch.fx.Node
    dropout: _Dropout
    residual: torch.fx.Node
    outputs: dict[int, list[torch.fx.Node]]  # the norm's getitems by output index
    backwards: list[torch.fx.Node]  # its tk.layer_norm_bwd partners
    dropout_backwards: list[torch.fx.Node]  # grad * keep * scale, fed by the partners' grad_x


def _partner_backwards(outputs: dict) -> Optional[list[torch.fx.Node]]:
    """The tk.layer_norm_bwd nodes reading this norm's h, mean and rstd."""
    h, mean, rstd = (outputs.get(index, []) for index in (1, 2, 3))
    partners = {
        user
        for item in (*h, *mean, *rstd)
        for user in item.users
        if _graph.is_call(user, tk.layer_norm_bwd.default)
        and user.args[2] in h
        and user.args[5] in mean
        and user.args[6] in rstd
    }
    if any(_graph.getitem_users(partner) is None for partner in partners):
        return None
    return list(partners)


def _gradients_of_stream(backward: torch.fx.Node) -> list[torch.fx.Node]:
    """grad_x and grad_residual of a dropout-free norm backward: both are the gradient of h."""
    grads = _graph.getitem_users(backward)
    return [*grads.get(0, []), *grads.get(1, [])]


def _exact(dropout: _Dropout, dropped: torch.fx.Node, residual: torch.fx.Node, options: RewriteOptions) -> bool:
    x, dropped, residual = (_graph.fake_value(node) for node in (dropout.x, dropped, residual))
    if x.dtype not in KERNEL_DTYPES or not (x.dtype == dropped.dtype == residual.dtype):
        return False
    return x.shape == dropped.shape == residual.shape and options.serves(x.device, "layer_norm")


def _match(norm: torch.fx.Node, arguments: dict, options: RewriteOptions) -> Optional[_Chain]:
    outputs = _graph.getitem_users(norm)
    if outputs is None:
        return None
    x, residual = arguments["x"], arguments["residual"]
    for dropped, other in ((x, residual), (residual, x)):
        if dropped is other or len(dropped.users) != 1:  # the dropped tensor feeds the norm only
            continue
        dropout = _fused_dropout(dropped) or _decomposed_dropout(dropped)
        if dropout is None or not _exact(dropout, dropped, other, options):
            continue
        backwards = _partner_backwards(outputs)
        if backwards is None:
            return None
        stream_gradients = {grad for backward in backwards for grad in _gradients_of_stream(backward)}
        dropout_backwards = []
        for reader in dropout.keep_readers:
            multiplies = _dropout_backward(reader, dropout.p)
            if multiplies is None or not all(set(m.args) & stream_gradients for m in multiplies):
                return None
            dropout_backwards.extend(multiplies)
        return _Chain(norm, dropout, other, outputs, backwards, dropout_backwards)
    return None


def _rewrite_backward(graph: torch.fx.Graph, chain: _Chain, backward: torch.fx.Node, seed: torch.fx.Node) -> None:
    """Replace one norm backward: the dropout's backward multiplies read the new grad_x, the other
    readers of the gradient of h (the residual's gradient) the new grad_residual."""
    arguments = _graph.bind_arguments(backward)
    stream_readers = {reader for grad in _gradients_of_stream(backward) for reader in grad.users}
    output_mask = list(arguments["output_mask"])
    output_mask[:2] = (
        any(reader in chain.dropout_backwards for reader in stream_readers),
        any(reader not in chain.dropout_backwards for reader in stream_readers),
    )
    grads = _graph.insert_call(
        graph,
        backward,
        tk.layer_norm_bwd.default,
        (*backward.args[:7], seed, chain.dropout.p, output_mask),
        4,
        backward,
    )
    for old in _gradients_of_stream(backward):
        for reader in list(old.users):
            if reader in chain.dropout_backwards:
                reader.replace_all_uses_with(grads[0])
            else:
                reader.replace_input_with(old, grads[1])
    for index in (2, 3):
        for old in _graph.getitem_users(backward).get(index, []):
            old.replace_all_uses_with(grads[index])


def _rewrite(graph: torch.fx.Graph, chain: _Chain, arguments: dict) -> None:
    norm, x = chain.norm, chain.dropout.x
    seed = _graph.insert_single(
        graph,
        norm,
        aten.randint.low,
        (0, DROPOUT_SEED_BOUND, []),
        norm,
        kwargs={"dtype": torch.int64, "device": _graph.fake_value(x).device},
    )
    outputs = _graph.insert_call(
        graph,
        norm,
        tk.layer_norm.default,
        (x, arguments["weight"], arguments["bias"], chain.residual, seed, arguments["eps"], chain.dropout.p),
        4,
        norm,
    )
    for index, items in chain.outputs.items():
        for item in items:
            item.replace_all_uses_with(outputs[index])
    retired = [*chain.dropout_backwards, *(item for items in chain.outputs.values() for item in items)]
    for backward in chain.backwards:
        retired.extend(item for items in _graph.getitem_users(backward).values() for item in items)
        _rewrite_backward(graph, chain, backward, seed)
    _graph.erase_unused(graph, retired)


def rewrite_layer_norm_dropout(graph: torch.fx.Graph, options: RewriteOptions) -> int:
    """Fold every exact dropout before a residual tk.layer_norm into it; return how many."""
    rewritten = 0
    for norm in list(graph.nodes):
        if not _graph.is_call(norm, tk.layer_norm.default):
            continue
        arguments = _graph.bind_arguments(norm)
        if arguments["residual"] is None or arguments["dropout_seed"] is not None or arguments["dropout_p"] != 0:
            continue
        chain = _match(norm, arguments, options)
        if chain is not None:
            _rewrite(graph, chain, arguments)
            rewritten += 1
    return rewritten
