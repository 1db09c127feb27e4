"""A Llama decoder on tk_ops: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention.

``LlamaForCausalLM(LlamaConfig(...))`` has the module tree and state_dict keys of Hugging Face's
``LlamaForCausalLM`` (``model.embed_tokens``, ``model.layers.{i}.self_attn.q_proj``, ...,
``model.norm``, ``lm_head``), so a Hugging Face state_dict loads with ``load_state_dict`` and gives
the same logits (``LlamaConfig.from_hf`` converts the config). ``config.reference=True`` runs the
same parameters on standard PyTorch ops only.

``sliding_window`` W (Mistral's field and meaning) limits every layer's causal attention to the token
itself and the W - 1 before it: ``tk_ops.attention(..., causal=True, window=(W - 1, 0))`` on the tk
path, SDPA with that boolean mask on the reference path. A config with a window is Hugging Face's
``MistralForCausalLM`` (same module tree and keys; ``to_hf_dict`` writes a Mistral config, ``from_hf``
reads one), without it ``LlamaForCausalLM``.

``forward(input_ids, targets, documents=PackedDocuments)`` trains on rows of packed documents: each
token attends only to the tokens before it in its own document, and its RoPE position counts from
the document's start. The tk path hands the flattened rows to ``tk_ops.attention_varlen`` with the
documents' cu_seqlens; the reference path runs SDPA with the block-diagonal causal mask.

On the tk path the residual add is fused into the RMSNorm that follows it
(``tk_ops.rms_norm(x, w, residual=r, return_residual=True)``). Under autocast the residual stream
stays fp32, as in the reference path, while the normalised activations are in the autocast dtype.
Only the default rope type (no scaling) is implemented; there is no padding mask.

Generation (``models.generate``) passes a paged KV cache (``models.kv_cache.PagedKVCache``) to
``forward(input_ids, cache=cache)``, on the tk path: the tokens are placed after those the cache
holds (rotary positions included); into an empty cache, the prefill runs the model's own causal
``tk_ops.attention`` and writes its keys and values into the cache; against a cache that holds
tokens, each layer appends its keys and values and attends with ``tk_ops.attention_with_kvcache``
(with the model's sliding window). Without a cache nothing changes (training runs exactly the code it
ran before).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

import torch

import tk_ops
from models.kv_cache import PagedKVCache
from models.layers import (
    CausalLM,
    PackedDocuments,
    ResidualRMSNorm,
    SwiGLUMLP,
    causal_mask,
    make_linear,
    reference_attention,
    reference_rope,
    rotary_inverse_frequencies,
    rotary_tables,
    rotary_tables_at,
)


@dataclasses.dataclass
class LlamaConfig:
    """The fields of Hugging Face's ``LlamaConfig`` that the model uses, Mistral's ``sliding_window``,
    plus ``reference``."""

    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: Optional[int] = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    initializer_range: float = 0.02
    sliding_window: Optional[int] = None  # W: each token sees itself and the W - 1 before it; None: all before it
    reference: bool = False  # True: standard PyTorch ops only

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be None or >= 1, got {self.sliding_window}")

    @classmethod
    def from_hf(cls, hf_config, **overrides) -> "LlamaConfig":
        """The config of a Hugging Face ``LlamaConfig`` or ``MistralConfig`` (default rope type, SiLU MLP only)."""
        rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"only the default rope type is implemented, got rope_type={rope_type!r}")
        if hf_config.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {hf_config.hidden_act!r}")
        theta = getattr(hf_config, "rope_theta", None) or rope.get("rope_theta", 10000.0)
        fields = {f.name for f in dataclasses.fields(cls)} - {"rope_theta", "reference"}
        values = {name: getattr(hf_config, name) for name in fields if hasattr(hf_config, name)}
        return cls(**values, rope_theta=theta, **overrides)

    def to_hf_dict(self) -> dict:
        """A Hugging Face ``config.json`` for this model: ``transformers`` loads it as LlamaForCausalLM,
        or with a sliding window as MistralForCausalLM (which has no biases)."""
        values = dataclasses.asdict(self)
        del values["reference"]
        theta = values.pop("rope_theta")
        rope = {"rope_type": "default", "rope_theta": theta}
        architecture = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
        if self.sliding_window is None:
            del values["sliding_window"]
        else:
            if self.attention_bias or self.mlp_bias:
                raise ValueError("a sliding-window model is a Mistral model, which has no attention or MLP biases")
            del values["attention_bias"], values["mlp_bias"]
            architecture = {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}
        return {**values, "rope_theta": theta, "rope_parameters": rope, "hidden_act": "silu", **architecture}

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


class LlamaAttention(torch.nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.reference = config.reference
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        # Based's attention layers are built from a BasedConfig, which has no window
        self.sliding_window = getattr(config, "sliding_window", None)
        # tk_ops' (left, right) window: the W - 1 keys before the query and none after it
        self.window = None if self.sliding_window is None else (self.sliding_window - 1, 0)
        hidden, bias, reference = config.hidden_size, config.attention_bias, config.reference
        self.q_proj = make_linear(hidden, self.num_heads * self.head_dim, bias=bias, reference=reference)
        self.k_proj = make_linear(hidden, self.num_kv_heads * self.head_dim, bias=bias, reference=reference)
        self.v_proj = make_linear(hidden, self.num_kv_heads * self.head_dim, bias=bias, reference=reference)
        self.o_proj = make_linear(self.num_heads * self.head_dim, hidden, bias=bias, reference=reference)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        documents: Optional[PackedDocuments] = None,
        cache=None,
    ) -> torch.Tensor:
        """cos, sin: (N, D / 2), or (B, N, D / 2) with ``documents`` (each token at its position in its
        document); ``cache``: this layer's ``models.kv_cache.LayerKVCache`` (tk path only), or None."""
        if documents is not None and cache is not None:
            raise ValueError("packed documents and a KV cache do not go together")
        if documents is not None and not self.reference:
            return self._packed_forward(x, cos, sin, documents)
        batch, seq_len, _ = x.shape
        # (B, N, H * D) -> (B, H, N, D) as strided views: tk ops take them without a copy
        q = self.q_proj(x).view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.reference:
            if cache is not None:
                raise ValueError("the KV cache runs on the tk path only (config.reference=False)")
            if documents is not None:
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # one table per row, shared by the heads
            q, k = reference_rope(q, cos, sin), reference_rope(k, cos, sin)
            mask = None
            if self.sliding_window is not None or documents is not None:
                mask = causal_mask(seq_len, x.device, window=self.sliding_window, documents=documents)
            out = reference_attention(q, k, v, causal=True, mask=mask)
            return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))
        q, k = tk_ops.rope_qk(q, k, cos, sin)
        if cache is not None and cache.length > 0:
            out = tk_ops.attention_with_kvcache(
                q.transpose(1, 2), cache.k_cache, cache.v_cache, k.transpose(1, 2), v.transpose(1, 2),
                cache_seqlens=cache.cache_seqlens, block_table=cache.block_table, causal=True, window=self.window,
                check_contents=False,  # the cache's own bookkeeping: no device sync per layer and step
            )
            return self.o_proj(out.reshape(batch, seq_len, -1))
        out = tk_ops.attention(q, k, v, causal=True, window=self.window)
        if cache is not None:  # a prefill: the prompt's keys and values fill the empty cache
            cache.write(k.transpose(1, 2), v.transpose(1, 2))
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))

    def _packed_forward(self, x, cos, sin, documents: PackedDocuments) -> torch.Tensor:
        """The tk path over the B * N tokens as one packed batch of documents (attention_varlen's layout)."""
        batch, seq_len, _ = x.shape
        tokens = batch * seq_len
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        # RoPE on (1, H, tokens, D) views; its (1, H, tokens, D) outputs read back as (tokens, H, D) without a copy
        q, k = tk_ops.rope_qk(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos.flatten(0, 1), sin.flatten(0, 1))
        cu_seqlens, longest = documents.cu_seqlens, documents.max_seqlen
        out = tk_ops.attention_varlen(
            q[0].transpose(0, 1), k[0].transpose(0, 1), v, cu_seqlens, cu_seqlens, longest, longest, causal=True,
            window=self.window,
        )  # fmt: skip
        return self.o_proj(out.view(batch, seq_len, -1))


class LlamaDecoderLayer(torch.nn.Module):
    """Pre-norm block. ``forward(x, residual, cos, sin) -> (x, residual)``: the block's output x is
    added to the residual stream by the next norm (the next block's, or the final one)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden, eps, reference = config.hidden_size, config.rms_norm_eps, config.reference
        self.input_layernorm = ResidualRMSNorm(hidden, eps, reference=reference)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = ResidualRMSNorm(hidden, eps, reference=reference)
        self.mlp = SwiGLUMLP(hidden, config.intermediate_size, bias=config.mlp_bias, reference=reference)

    def forward(self, x, residual, cos, sin, documents: Optional[PackedDocuments] = None, cache=None):
        normed, residual = self.input_layernorm(x, residual)
        x = self.self_attn(normed, cos, sin, documents, cache)
        normed, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(normed), residual


class LlamaModel(torch.nn.Module):
    inverse_frequencies: torch.Tensor

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = ResidualRMSNorm(config.hidden_size, config.rms_norm_eps, reference=config.reference)
        # not in the state_dict, as Hugging Face's rotary_emb.inv_freq
        self.register_buffer(
            "inverse_frequencies", rotary_inverse_frequencies(config.head_dim, config.rope_theta), persistent=False
        )

    def forward(
        self, input_ids: torch.Tensor, documents: Optional[PackedDocuments] = None, cache=None
    ) -> torch.Tensor:
        """Hidden states (B, N, hidden); with ``cache`` (a ``models.kv_cache.PagedKVCache``) the tokens are
        those after the ones it holds, and it holds them too afterwards."""
        if cache is None:
            if documents is None:
                cos, sin = rotary_tables(self.inverse_frequencies, input_ids.shape[1])
            else:
                cos, sin = rotary_tables_at(self.inverse_frequencies, documents.positions)
            x, residual = self.embed_tokens(input_ids), None
            for layer in self.layers:
                x, residual = layer(x, residual, cos, sin, documents)
            return self.norm(x, residual)[0]
        if documents is not None:
            raise ValueError("packed documents and a KV cache do not go together")
        new_tokens = input_ids.shape[1]
        cache.make_room(new_tokens)
        # the positions from the cache's lengths on the device (the rows share them), not from cache.length:
        # a decode step captured in a CUDA graph then takes its positions from each replay's lengths
        positions = cache.cache_seqlens[:1].long() + torch.arange(new_tokens, device=input_ids.device)
        cos, sin = rotary_tables_at(self.inverse_frequencies, positions)
        x, residual = self.embed_tokens(input_ids), None
        for index, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, cache=cache.layer(index))
        cache.advance(new_tokens)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(CausalLM):
    """``forward(input_ids)`` -> logits (B, N, vocab); ``forward(input_ids, targets)`` -> mean
    cross-entropy over the targets that are not -100; ``documents=PackedDocuments`` for packed rows."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.init_head(self.model.embed_tokens)

    def packed_hidden_states(self, input_ids: torch.Tensor, documents: PackedDocuments) -> torch.Tensor:
        return self.model(input_ids, documents)

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: Optional[torch.Tensor] = None,
        *,
        documents: Optional[PackedDocuments] = None,
        cache=None,
    ) -> torch.Tensor:
        """As CausalLM's; ``cache`` (a ``models.kv_cache.PagedKVCache``, no targets) gives the logits of the tokens
        that follow those the cache holds, and adds them to it."""
        if cache is None:
            return super().forward(input_ids, targets, documents=documents)
        if targets is not None or documents is not None:
            raise ValueError("a forward with a KV cache is for generation: it takes no targets or documents")
        return self.lm_head(self.model(input_ids, cache=cache))

    def kv_cache(self, batch: int, max_length: int, *, block_size: int = 16) -> PagedKVCache:
        """An empty paged KV cache for ``batch`` sequences of up to ``max_length`` tokens, in the dtype and on
        the device of the model's weights."""
        c, weight = self.config, self.model.embed_tokens.weight
        return PagedKVCache(layers=c.num_hidden_layers, batch=batch, kv_heads=c.num_key_value_heads,
                            head_dim=c.head_dim, max_length=max_length, block_size=block_size, dtype=weight.dtype,
                            device=weight.device)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 3 x (2 x matmul parameters + causal attention scores). Rows of
        packed documents are counted as one sequence (an upper bound: each document sees fewer keys)."""
        c = self.config
        attention_proj = c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
        mlp = 3 * c.hidden_size * c.intermediate_size
        matmul_params = c.num_hidden_layers * (attention_proj + mlp) + c.hidden_size * c.vocab_size
        # q k^T and p v: 2 x 2 x D per query, head and key seen; causal: N / 2 keys on average, and
        # under a window W < N about W (1 - W / 2N) (the first W queries see fewer)
        window = c.sliding_window
        keys_seen = seq_len / 2 if window is None or window >= seq_len else window * (1 - window / (2 * seq_len))
        attention_scores = c.num_hidden_layers * c.num_attention_heads * 4 * keys_seen * c.head_dim
        return 3.0 * (2.0 * matmul_params + attention_scores)
