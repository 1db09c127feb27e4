"""Small FX helpers shared by the rewrites: argument binding, metadata, node insertion."""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx

_TRANSFERRED_META = ("stack_trace", "recompute", "ac_graph_id", "nn_module_stack")


def bind_arguments(node: torch.fx.Node) -> dict[str, Any]:
    """Map each schema argument of an aten call node to its value (defaults filled in)."""
    schema = node.target._schema
    bound = {}
    for index, argument in enumerate(schema.arguments):
        if index < len(node.args):
            bound[argument.name] = node.args[index]
        elif argument.name in node.kwargs:
            bound[argument.name] = node.kwargs[argument.name]
        else:
            bound[argument.name] = argument.default_value if argument.has_default_value() else None
    return bound


def is_call(node: Any, *targets) -> bool:
    """``node`` is an FX call of one of ``targets``."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def fake_value(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg


def getitem_users(node: torch.fx.Node) -> Optional[dict[int, list[torch.fx.Node]]]:
    """Users of a multi-output node grouped by output index; None if any user is not a getitem."""
    by_index: dict[int, list[torch.fx.Node]] = {}
    for user in node.users:
        if user.target is not operator.getitem:
            return None
        by_index.setdefault(user.args[1], []).append(user)
    return by_index


def _fake_call(op, args: tuple, kwargs: dict) -> Any:
    fake_args = tuple(fake_value(a) for a in args)
    # with no tensor arguments (a random draw), the fake mode comes from the tracing context
    fake_mode = torch._guards.detect_fake_mode([a for a in fake_args if isinstance(a, torch.Tensor)])
    with fake_mode:
        return op(*fake_args, **kwargs)


def _transfer_meta(nodes, like: torch.fx.Node) -> None:
    for node in nodes:
        for key in _TRANSFERRED_META:
            if key in like.meta:
                node.meta[key] = like.meta[key]


def insert_call(graph: torch.fx.Graph, before: torch.fx.Node, op, args: tuple, outputs: int, like: torch.fx.Node):
    """Insert ``op(*args)`` before ``before`` with fake metadata; return its getitem nodes."""
    fake_out = _fake_call(op, args, {})
    with graph.inserting_before(before):
        call = graph.call_function(op, args)
        call.meta["val"] = fake_out
        items = []
        for index in range(outputs):
            item = graph.call_function(operator.getitem, (call, index))
            item.meta["val"] = fake_out[index]
            items.append(item)
    _transfer_meta((call, *items), like)
    return items


def insert_single(
    graph: torch.fx.Graph, before: torch.fx.Node, op, args: tuple, like: torch.fx.Node, kwargs: Optional[dict] = None
) -> torch.fx.Node:
    """Insert the single-output ``op(*args, **kwargs)`` before ``before`` with fake metadata; return it."""
    kwargs = kwargs or {}
    fake_out = _fake_call(op, args, kwargs)
    with graph.inserting_before(before):
        call = graph.call_function(op, args, kwargs)
    call.meta["val"] = fake_out
    _transfer_meta((call,), like)
    return call


def erase_unused(graph: torch.fx.Graph, nodes) -> None:
    """Erase ``nodes`` once they have no users, and with them every producer left without users.

    A replaced chain is thus removed down to its inputs, including random ops that
    ``Graph.eliminate_dead_code`` keeps (it treats them as impure).
    """
    pending, erased = list(nodes), set()
    while pending:
        node = pending.pop()
        if node in erased or node.users or node.op != "call_function":
            continue
        producers = node.all_input_nodes
        graph.erase_node(node)
        erased.add(node)
        pending.extend(producers)
