"""SDPA -> tk.attention: a hand-written rewrite of the fused aten attention nodes.

Dynamo/AOT lower ``F.scaled_dot_product_attention`` to one fused forward node per backend
(flash, efficient, cuDNN, flash-for-CPU) and, in training graphs, one partner backward node that
reads the forward's output and logsumexp. Both are replaced: the forward by ``tk.attention``
(which returns out and lse) and each partner backward by ``tk.attention_bwd`` reading our out and
lse. The rewrite is exact only when: dropout 0, bf16/fp16, a head dim the kernels take (as the
extension declares it, ``_library.kernel_support``: 64 or 128 today), and either
  * no mask, or ``is_causal`` with Nq == Nk (SDPA's causal mask is top-left aligned, tk's
    bottom-right; the two agree only on square problems), or
  * an explicit mask (boolean, or additive: 0 or at most _MASKED_BIAS) that reads no graph input,
    e.g. one built from aranges as Hugging Face models do under torch.compile before torch 2.14.
    Such a mask is a constant of the graph: it is evaluated on the CPU at compile time and accepted
    when every query sees every key (no mask), when it is the bottom-right causal mask with no
    empty row, or when it is a bottom-right sliding-window causal mask: query i sees key j iff
    i + Nk - Nq - left <= j <= i + Nk - Nq, for one left >= 0 (Mistral's window W is left = W - 1;
    with Nq <= Nk no row is empty), which runs as tk's window=(left, 0). A window is proven from
    the mask's values, whatever ops built it (``(j <= i) & (j > i - W)`` on aranges, Hugging Face's
    sliding-window masks).

A proven window is always rewritten: SDPA runs a window as a dense mask, every key of every row, where the
window kernels skip the key blocks outside it (the ``sdpa_masked`` rows of
benchmarks/results/attention_features.json measure the two).

A softcap (``c * tanh(s / c)`` between q k^T and the softmax) is not rewritten: SDPA has no softcap,
so a softcapped attention is hand-written matmuls, tanh and softmax, and this pass matches only
the fused SDPA nodes (matching the decomposed math and its backward is a separate rewrite).

K and V expanded from fewer heads by Hugging Face's ``repeat_kv`` (unsqueeze, expand, copy,
reshape) are read from the unexpanded tensors, as GQA, so the copies disappear. Their gradients
then go back as the expanded shape that the graph's own ``repeat_kv`` backward (a sum over each
group) expects: our per-group gradient in the first copy of the group, zeros in the others, so the
sum is exact.

An exact node is rewritten only where tk measured at least as fast as the backend SDPA lowered it
to (``SPEEDUP_OVER_BACKEND``, from one H200 run; ``RewriteOptions.always_rewrite_attention``
skips this rule, for benchmarking):
  * flash (FA2): tk is 1.12-1.95x in the forward, 1.45-2.33x forward + backward: rewritten;
  * cuDNN: without a mask tk is 0.63-0.79x in the forward and 0.90-0.91x forward + backward at
    the worst lengths: kept. With a constant mask proven causal cuDNN reads the bias and computes
    every block while tk runs its causal kernel: cuDNN's non-causal time, a lower bound for the
    masked run, is at least 1.16x tk's causal forward + backward (rewritten in training graphs),
    and in the forward alone 1.07x at head dim 128 (rewritten in inference graphs too) but 0.85x
    at 64 (N = 512; kept there);
  * efficient, and the CPU flash node: not measured; rewritten. SDPA picks efficient over flash
    only when flash refuses the inputs (a mask, as above), and the CPU node is only reached with
    ``any_device`` (no tk kernel there: the CPU suite exercises the rewrite through it);
  * the math decomposition (matmuls and softmax, no fused node) is not matched: Hugging Face BERT
    lowers there and keeps it (benchmarks/results/compile.md).
A graph with the partner backward is judged by forward + backward, an inference graph by the
forward; each figure is the minimum over the measured lengths (N 512..16384, B*N = 16384, causal
and not), bf16 (fp16 runs the same kernels), tk's backward the default method for the shape
(``deterministic=True``'s recompute method gives the same decisions: 0.88x and 1.06x where the
default gives 0.90x and 1.16x at head dim 64). GQA (32 query / 8 key-value heads, N = 4096,
D = 128) measured as MHA does: against cuDNN 1.01-1.04x forward + backward causal or not, against
FA2 1.8x; it is judged as MHA.

Which fused node a graph holds, and so what the rule decides, follows torch's SDPA backend settings
at compile time (``sdpa_kernel``, ``torch.backends.cuda.enable_*_sdp``), which the FX graph and
AOTAutograd caches leave out of their keys: a graph compiled with flash allowed (rewritten) would
be served again, from the cache, to the same SDPA call compiled with only cuDNN allowed (kept).
``sdpa_settings()`` is therefore part of the tk pass's cache key (``TkGraphPass.uuid``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from tk_ops._checks import KERNEL_DTYPES
from tk_ops.inductor import _graph
from tk_ops.inductor.options import RewriteOptions

aten = torch.ops.aten

# Fused forward -> the backward nodes that may partner it (cuDNN's has two names, the one used
# depends on the torch version). Each forward returns (output, logsumexp, ...).
_FORWARD_TO_BACKWARD = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: (
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    ),
    aten._scaled_dot_product_flash_attention.default: (aten._scaled_dot_product_flash_attention_backward.default,),
    aten._scaled_dot_product_efficient_attention.default: (
        aten._scaled_dot_product_efficient_attention_backward.default,
    ),
    aten._scaled_dot_product_cudnn_attention.default: (
        aten._scaled_dot_product_cudnn_attention_backward.default,
        aten._cudnn_attention_backward.default,
    ),
}
_GRADS = 3  # grad_query, grad_key, grad_value
# The most memory one intermediate of a constant mask may take when it is evaluated at compile time.
_CONSTANT_MASK_BYTES = 1 << 28
# An additive bias at or below this masks its key exactly: exp of it underflows to 0 in fp32 unless
# two scores of a row differ by ~65000. torch's cuDNN path turns a boolean mask into -65504 (the
# largest fp16), Hugging Face fills with the dtype's lowest value; -inf qualifies too.
_MASKED_BIAS = -65504.0
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


@dataclasses.dataclass(frozen=True)
class Speedup:
    """The SDPA backend's time over tk's (above 1: tk is faster), the minimum over the lengths."""

    forward: float
    forward_and_backward: float


SPEEDUP_MEASURED_IN = "benchmarks/results/attention.json"
# (backend forward node, head dim, the node's mask is a constant that tk runs as causal) -> Speedup,
# from the "grid" rows of SPEEDUP_MEASURED_IN (bench_attention on the H200 at b80f2f8; passes "fwd" and "bwd",
# tk's default backward; baselines sdpa_cudnn and sdpa_flash, tk's time from the same row as the
# backend's). With a causal constant mask the backend's non-causal time stands for its masked run
# (a lower bound: it computes every block and reads the bias besides) against tk's causal time. Backends absent from the table were not
# measured and are rewritten. tests/test_inductor.py recomputes the table from the file.
SPEEDUP_OVER_BACKEND = {
    (aten._scaled_dot_product_cudnn_attention.default, 128, False): Speedup(0.79, 0.91),
    (aten._scaled_dot_product_cudnn_attention.default, 128, True): Speedup(1.07, 1.26),
    (aten._scaled_dot_product_cudnn_attention.default, 64, False): Speedup(0.63, 0.90),
    (aten._scaled_dot_product_cudnn_attention.default, 64, True): Speedup(0.85, 1.16),
    (aten._scaled_dot_product_flash_attention.default, 128, False): Speedup(1.54, 1.70),
    (aten._scaled_dot_product_flash_attention.default, 128, True): Speedup(1.95, 2.33),
    (aten._scaled_dot_product_flash_attention.default, 64, False): Speedup(1.12, 1.45),
    (aten._scaled_dot_product_flash_attention.default, 64, True): Speedup(1.23, 1.80),
}
_MEASURED_BACKENDS = {forward for forward, _, _ in SPEEDUP_OVER_BACKEND}


def _constant_value(node: torch.fx.Node) -> Optional[torch.Tensor]:
    """The value of a node that reads no graph input, computed on the CPU; None for any other node,
    and for random ops, symbolic shapes or intermediates over _CONSTANT_MASK_BYTES."""
    ancestors, pending = set(), [node]
    while pending:
        current = pending.pop()
        if current in ancestors:
            continue
        if current.op != "call_function" or not isinstance(current.target, torch._ops.OpOverload):
            return None
        if torch.Tag.nondeterministic_seeded in current.target.tags:
            return None
        value = current.meta.get("val")
        if not isinstance(value, torch.Tensor) or not all(isinstance(size, int) for size in value.shape):
            return None
        if value.untyped_storage().nbytes() > _CONSTANT_MASK_BYTES:
            return None
        ancestors.add(current)
        pending.extend(current.all_input_nodes)
    values = {}
    for current in (n for n in node.graph.nodes if n in ancestors):
        args, kwargs = torch.fx.node.map_arg((current.args, current.kwargs), values.__getitem__)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        values[current] = current.target(*args, **kwargs)
    return values[node]


@dataclasses.dataclass(frozen=True)
class _Masking:
    """The mask of an SDPA node as tk's arguments: causal, and the window's left edge (-1: none)."""

    causal: bool
    window_left: int = -1


_NO_MASK, _CAUSAL = _Masking(False), _Masking(True)


def _constant_mask_masking(mask: torch.fx.Node, q_len: int, k_len: int) -> Optional[_Masking]:
    """What tk computes for a constant mask (module docstring): no mask, causal, or causal with a
    window; None if the mask is none of them or not a constant."""
    with unset_fake_temporarily():  # real tensors, computed now, while the pass runs under fake mode
        return _mask_masking(_constant_value(mask), q_len, k_len)


def _mask_masking(value: Optional[torch.Tensor], q_len: int, k_len: int) -> Optional[_Masking]:
    if value is None or value.dim() < 2:
        return None
    for dim in range(value.dim() - 2):  # broadcast copies (stride 0) are checked once
        if value.stride(dim) == 0:
            value = value.narrow(dim, 0, 1)
    if value.dtype == torch.bool:
        attends = value
    elif value.is_floating_point():
        attends = value == 0
        if not bool(torch.all(attends | (value <= _MASKED_BIAS))):
            return None
    else:
        return None
    try:
        attends = attends.expand(*attends.shape[:-2], q_len, k_len)
    except RuntimeError:
        return None
    if bool(attends.all()):
        return _NO_MASK
    if q_len > k_len:  # the first rows would see no key under a bottom-right causal mask
        return None
    # distance of key j from query i's diagonal key i + Nk - Nq: 0 on it, negative before it
    distance = torch.arange(k_len)[None, :] - (torch.arange(q_len)[:, None] + (k_len - q_len))
    causal = distance <= 0
    if torch.equal(attends, causal.expand_as(attends)):
        return _CAUSAL
    # the window's left edge from the last row, whose keys left of the diagonal are never cut off by
    # the start of the keys in a window narrower than the row; then the whole mask must match it
    last_row_seen = attends[(0,) * (attends.dim() - 2) + (-1,)].nonzero()
    if last_row_seen.numel() == 0:
        return None
    left = k_len - 1 - int(last_row_seen[0])
    if torch.equal(attends, (causal & (distance >= -left)).expand_as(attends)):
        return _Masking(True, left)
    return None


def _mask(arguments: dict) -> Optional[torch.fx.Node]:
    return arguments.get("attn_mask", arguments.get("attn_bias"))


def _masking_if_rewritable(arguments: dict, options: RewriteOptions) -> Optional[_Masking]:
    """tk's causal flag and window for an SDPA node it computes exactly, None if it does not."""
    q, k, v = (_graph.fake_value(arguments[name]) for name in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return None
    if arguments.get("dropout_p", 0.0) != 0.0:
        return None
    if not (q.dtype == k.dtype == v.dtype and q.dtype in KERNEL_DTYPES):
        return None
    # Both directions' kernels must take the head dim: the forward alone takes 192 and 256, whose gradients
    # would run the backward's reference in a training graph; 96's backward runs the D = 128 kernels on padded
    # copies (not declared as a backward head dim); none of the three was measured against SDPA there.
    head_dim = q.shape[-1]
    if not (head_dim == k.shape[-1] == v.shape[-1]
            and all(options.kernel_takes(op, "head_dims", head_dim) for op in ("attention", "attention_bwd"))):
        return None
    if q.shape[1] % k.shape[1] != 0 or not options.serves(q.device, "attention"):
        return None
    mask = _mask(arguments)
    if mask is not None:
        if not all(isinstance(size, int) for size in (q.shape[2], k.shape[2])):
            return None
        return _constant_mask_masking(mask, q.shape[2], k.shape[2])
    causal = bool(arguments.get("is_causal", False))
    if causal and not torch.fx.experimental.symbolic_shapes.statically_known_true(q.shape[2] == k.shape[2]):
        return None
    return _Masking(causal)


def _unrepeated(node: torch.fx.Node) -> tuple[torch.fx.Node, int]:
    """(x, n) when ``node`` is x of shape (B, H, N, D) with each head repeated n times along dim 1
    (Hugging Face's repeat_kv: unsqueeze(2), expand, copy, reshape); (node, 1) otherwise."""
    not_repeated = (node, 1)
    if not _graph.is_call(node, *_VIEWS):
        return not_repeated
    expanded = node.args[0]
    if _graph.is_call(expanded, aten.clone.default):
        expanded = expanded.args[0]
    if not _graph.is_call(expanded, aten.expand.default):
        return not_repeated
    unsqueezed = expanded.args[0]
    if not (_graph.is_call(unsqueezed, aten.unsqueeze.default) and unsqueezed.args[1] == 2):
        return not_repeated
    source = unsqueezed.args[0]
    shapes = [tuple(_graph.fake_value(n).shape) for n in (node, expanded, source)]
    if [len(shape) for shape in shapes] != [4, 5, 4]:
        return not_repeated
    (batch, heads, n, d), (_, _, copies, _, _), source_shape = shapes
    if source_shape != (batch, heads // copies, n, d) or heads != source_shape[1] * copies:
        return not_repeated
    return source, copies


def _as_repeated_grad(graph: torch.fx.Graph, grad: torch.fx.Node, copies: int, like: torch.fx.Node) -> torch.fx.Node:
    """A gradient for the repeated tensor whose sum over each group of copies is ``grad`` exactly."""
    batch, heads, n, d = _graph.fake_value(grad).shape
    grouped = _graph.insert_single(graph, like, aten.unsqueeze.default, (grad, 2), like)
    padding = [0, 0, 0, 0, 0, copies - 1]  # (D, N, copies) from the last dim: zeros after the first copy
    padded = _graph.insert_single(graph, like, aten.constant_pad_nd.default, (grouped, padding, 0.0), like)
    return _graph.insert_single(graph, like, aten.view.default, (padded, [batch, heads * copies, n, d]), like)


def sdpa_settings() -> tuple:
    """The settings that pick SDPA's backend when a graph is traced: each backend's switch and
    their priority order (``sdpa_kernel(..., set_priority=True)``)."""
    cuda = torch.backends.cuda
    switches = (
        cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.cudnn_sdp_enabled(), cuda.math_sdp_enabled()
    )
    return switches, tuple(int(backend) for backend in torch._C._get_sdp_priority_order())


def _tk_is_faster(forward: torch.fx.Node, arguments: dict, masking: _Masking, training: bool) -> bool:
    """The rule of the module docstring: tk measured at least as fast as this node's backend (a window
    always: SDPA runs it as a dense mask)."""
    if forward.target not in _MEASURED_BACKENDS or masking.window_left >= 0:
        return True
    head_dim = _graph.fake_value(arguments["query"]).shape[-1]
    causal_mask = masking.causal and _mask(arguments) is not None
    speedup = SPEEDUP_OVER_BACKEND.get((forward.target, head_dim, causal_mask))
    if speedup is None:  # a head dim the kernels take that was not measured against this backend
        return True
    return (speedup.forward_and_backward if training else speedup.forward) >= 1.0


def _partner_backwards(forward: torch.fx.Node, users: dict) -> list[torch.fx.Node] | None:
    """Backward nodes reading this forward; None if a secondary output escapes elsewhere."""
    backward_targets = _FORWARD_TO_BACKWARD[forward.target]
    query, key, value = forward.args[:3]
    partners = set()
    for index, items in users.items():
        for item in items:
            for user in item.users:
                is_partner = user.target in backward_targets and tuple(user.args[1:4]) == (query, key, value)
                if is_partner:
                    grads = _graph.getitem_users(user)
                    if grads is None or any(i >= _GRADS for i in grads):
                        return None  # e.g. a used attn_bias gradient: not ours to produce
                    partners.add(user)
                elif index != 0:
                    return None
    return sorted(partners, key=lambda n: list(n.graph.nodes).index(n))


def rewrite_attention(graph: torch.fx.Graph, options: RewriteOptions) -> int:
    """Replace every exact SDPA forward (and its backward) by tk ops; return how many."""
    rewritten = 0
    for forward in list(graph.nodes):
        if forward.op != "call_function" or forward.target not in _FORWARD_TO_BACKWARD:
            continue
        arguments = _graph.bind_arguments(forward)
        users = _graph.getitem_users(forward)
        if users is None:
            continue
        masking = _masking_if_rewritable(arguments, options)
        if masking is None:
            continue
        backwards = _partner_backwards(forward, users)
        if backwards is None:
            continue
        if not (options.always_rewrite_attention or _tk_is_faster(forward, arguments, masking, bool(backwards))):
            continue
        query = arguments["query"]
        (key, key_copies), (value, value_copies) = _unrepeated(arguments["key"]), _unrepeated(arguments["value"])
        scale = arguments.get("scale")
        if scale is None:
            scale = 1.0 / math.sqrt(_graph.fake_value(query).shape[-1])
        # SDPA's backends follow torch's deterministic switch at run time; the rewrite at compile time.
        deterministic = torch.are_deterministic_algorithms_enabled()
        trailing_arguments = (masking.causal, scale, deterministic)
        if masking.window_left >= 0:  # (left, right = unbounded): with causal the right edge is 0
            trailing_arguments += (masking.window_left, -1)
        out, lse = _graph.insert_call(
            graph, forward, torch.ops.tk.attention.default, (query, key, value, *trailing_arguments), 2, forward
        )
        for item in users.get(0, []):
            item.replace_all_uses_with(out)
        for backward in backwards:
            backward_users = _graph.getitem_users(backward)
            grad_out = backward.args[0]
            grads = _graph.insert_call(
                graph,
                backward,
                torch.ops.tk.attention_bwd.default,
                (grad_out, None, query, key, value, out, lse, *trailing_arguments),
                _GRADS,
                backward,
            )
            copies = (1, key_copies, value_copies)
            for index, items in backward_users.items():
                grad = grads[index]
                if copies[index] > 1:
                    grad = _as_repeated_grad(graph, grad, copies[index], items[0])
                for item in items:
                    item.replace_all_uses_with(grad)
                    graph.erase_node(item)
            graph.erase_node(backward)
        for items in users.values():
            for item in items:
                graph.erase_node(item)
        graph.erase_node(forward)
        rewritten += 1
    return rewritten
