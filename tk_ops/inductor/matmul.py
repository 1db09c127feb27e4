"""mm / addmm -> tk.matmul / tk.linear (opt-in: ``enable(matmul=True)``).

Every GEMM of a training graph is already explicit after AOT (forward and backward alike), so a
node-for-node replacement is exact: ``mm(a, b)`` is ``tk.matmul(a, b)``, and
``addmm(bias, x, w_t)`` with unit alpha/beta and a 1-D bias is ``tk.linear(x, w_t.T, bias)``.
"""

from __future__ import annotations

import torch
import torch.fx

from tk_ops._checks import KERNEL_DTYPES
from tk_ops.inductor import _graph
from tk_ops.inductor.options import RewriteOptions

aten = torch.ops.aten


def _operands_served(tensors, options: RewriteOptions) -> bool:
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    if len({t.dtype for t in tensors}) != 1 or tensors[0].dtype not in KERNEL_DTYPES:
        return False
    return options.serves(tensors[0].device, "matmul")


def _replace(graph: torch.fx.Graph, node: torch.fx.Node, op, args: tuple) -> None:
    fake_args = tuple(_graph.fake_value(a) for a in args)
    with torch._guards.detect_fake_mode([a for a in fake_args if isinstance(a, torch.Tensor)]):
        fake_out = op(*fake_args)
    with graph.inserting_before(node):
        call = graph.call_function(op, args)
    call.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    call.meta["val"] = fake_out
    node.replace_all_uses_with(call)
    graph.erase_node(node)


def rewrite_matmul(graph: torch.fx.Graph, options: RewriteOptions) -> int:
    if not options.matmul:
        return 0
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.mm.default:
            a, b = node.args
            if _operands_served([_graph.fake_value(a), _graph.fake_value(b)], options):
                _replace(graph, node, torch.ops.tk.matmul.default, (a, b))
                rewritten += 1
        elif node.target is aten.addmm.default:
            bias, x, w_t = node.args[:3]
            unit_scales = node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1
            values = [_graph.fake_value(t) for t in (x, w_t, bias)]
            if unit_scales and _operands_served(values, options) and values[2].dim() == 1:
                with graph.inserting_before(node):
                    weight = graph.call_function(aten.permute.default, (w_t, [1, 0]))
                weight.meta["val"] = values[1].permute(1, 0)
                _replace(graph, node, torch.ops.tk.linear.default, (x, weight, bias))
                rewritten += 1
    return rewritten
