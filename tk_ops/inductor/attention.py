"""SDPA -> tk.attention: a hand-written rewrite of the fused aten attention nodes.

Dynamo/AOT lower ``F.scaled_dot_product_attention`` to one fused forward node per backend
(flash, efficient, cuDNN, flash-for-CPU) and, in training graphs, one partner backward node that
reads the forward's output and logsumexp. Both are replaced: the forward by ``tk.attention``
(which returns out and lse) and each partner backward by ``tk.attention_bwd`` reading our out and
lse. The rewrite is exact only when: no mask or bias, dropout 0, bf16/fp16, head dim 64 or 128,
and for causal masks Nq == Nk (SDPA's causal mask is top-left aligned, tk's bottom-right; the two
agree only on square problems).
"""

from __future__ import annotations

import math

import torch
import torch.fx

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
_KERNEL_HEAD_DIMS = (64, 128)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_GRADS = 3  # grad_query, grad_key, grad_value


def _rewritable(arguments: dict, options: RewriteOptions) -> bool:
    q, k, v = (_graph.fake_value(arguments[name]) for name in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return False
    if arguments.get("attn_mask") is not None or arguments.get("attn_bias") is not None:
        return False
    if arguments.get("dropout_p", 0.0) != 0.0:
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype in _KERNEL_DTYPES):
        return False
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] in _KERNEL_HEAD_DIMS):
        return False
    if q.shape[1] % k.shape[1] != 0:
        return False
    if arguments.get("is_causal") and not torch.fx.experimental.symbolic_shapes.statically_known_true(
        q.shape[2] == k.shape[2]
    ):
        return False
    return options.serves(q.device, "attention")


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
        if users is None or not _rewritable(arguments, options):
            continue
        backwards = _partner_backwards(forward, users)
        if backwards is None:
            continue
        query, key, value = arguments["query"], arguments["key"], arguments["value"]
        causal = bool(arguments.get("is_causal", False))
        scale = arguments.get("scale")
        if scale is None:
            scale = 1.0 / math.sqrt(_graph.fake_value(query).shape[-1])
        out, lse = _graph.insert_call(
            graph, forward, torch.ops.tk.attention.default, (query, key, value, causal, scale), 2, forward
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
                (grad_out, None, query, key, value, out, lse, causal, scale),
                _GRADS,
                backward,
            )
            for index, items in backward_users.items():
                for item in items:
                    item.replace_all_uses_with(grads[index])
                    graph.erase_node(item)
            graph.erase_node(backward)
        for items in users.values():
            for item in items:
                graph.erase_node(item)
        graph.erase_node(forward)
        rewritten += 1
    return rewritten
