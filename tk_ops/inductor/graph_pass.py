"""The passes that apply the tk rewrites, each chained after a user's own pass in its slot: the joint-graph
pass (attention, patterns, dropout, matmul) and the pass over Dynamo's graph before autograd (the LM-head
loss, which needs F.cross_entropy's call as written)."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Optional

import torch
import torch.fx
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from tk_ops.inductor import _graph, attention, layer_norm_dropout, linear_cross_entropy, matmul, patterns
from tk_ops.inductor.options import RewriteOptions

_SOURCES = (
    attention.__file__,
    layer_norm_dropout.__file__,
    linear_cross_entropy.__file__,
    matmul.__file__,
    patterns.__file__,
    _graph.__file__,
    __file__,
)


class _ChainedPass(CustomGraphPass):
    """Runs ``previous`` (the pass installed in the slot before us, if any), then ``rewrite``; its uuid
    covers our sources, the options, ``cache_key_extra()`` and the wrapped pass's uuid."""

    def __init__(self, options: RewriteOptions, previous: Optional[Any] = None):
        self.options = options
        self.previous = previous

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.previous is not None:
            self.previous(graph)
        self.rewrite(graph)

    @abc.abstractmethod
    def rewrite(self, graph: torch.fx.Graph) -> None:
        """The slot's tk rewrites, in place."""

    def cache_key_extra(self) -> tuple:
        return ()

    def uuid(self) -> Optional[Any]:
        """Stable across processes, for the FX graph and AOTAutograd caches."""
        previous_uuid = None
        if self.previous is not None:
            previous_uuid = self.previous.uuid() if hasattr(self.previous, "uuid") else None
            if previous_uuid is None:
                return None  # the wrapped pass cannot be cached, so neither can we
        options = tuple(sorted(dataclasses.asdict(self.options).items()))
        return (get_hash_for_files(_SOURCES), options, *self.cache_key_extra(), previous_uuid)


class TkGraphPass(_ChainedPass):
    """The joint-graph slot: attention, the patterns, dropout into layer_norm, matmul."""

    def rewrite(self, graph: torch.fx.Graph) -> None:
        attention_rewrites = attention.rewrite_attention(graph, self.options)
        if attention_rewrites:
            counters["tk_ops"]["attention"] += attention_rewrites
            graph.eliminate_dead_code()
        pattern_rewrites = patterns.rewrite_patterns(graph, self.options)
        if pattern_rewrites:
            counters["tk_ops"]["patterns"] += pattern_rewrites
        # after the patterns: it folds dropout into the residual tk.layer_norm they produce
        dropout_rewrites = layer_norm_dropout.rewrite_layer_norm_dropout(graph, self.options)
        if dropout_rewrites:
            counters["tk_ops"]["layer_norm_dropout"] += dropout_rewrites
        matmul_rewrites = matmul.rewrite_matmul(graph, self.options)
        if matmul_rewrites:
            counters["tk_ops"]["matmul"] += matmul_rewrites

    def cache_key_extra(self) -> tuple:
        return (attention.sdpa_settings(),)  # the SDPA backend settings the attention rule reads


class TkPreGradPass(_ChainedPass):
    """The pre-grad slot (Dynamo's graph before autograd): the LM-head loss rewrite."""

    def rewrite(self, graph: torch.fx.Graph) -> None:
        rewrites = linear_cross_entropy.rewrite_linear_cross_entropy(graph, self.options)
        if rewrites:
            counters["tk_ops"]["linear_cross_entropy"] += rewrites
