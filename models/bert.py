"""A BERT encoder with a masked-language-model head on tk_ops: post-LN blocks, GELU, learned positions.

``BertForMaskedLM(BertConfig(...))`` has the module tree and state_dict keys of Hugging Face's
``BertForMaskedLM`` (``bert.embeddings.*``, ``bert.encoder.layer.{i}.attention.self.query``, ...,
``cls.predictions.*``; no pooler, as there), so a Hugging Face state_dict loads with
``load_state_dict`` and gives the same logits (``BertConfig.from_hf`` converts the config).
``config.reference=True`` runs the same parameters on standard PyTorch ops only.

On the tk path each post-LN sublayer output ``LayerNorm(dropout(dense(x)) + residual)`` is one
``tk_ops.layer_norm(dense(x), w, b, residual=residual, dropout_p=p)``. Under autocast the tk path
keeps the residual stream (the LayerNorm outputs) in the autocast dtype, where the reference path's
``F.layer_norm`` returns fp32. ``tk_ops.attention`` has no dropout: the tk path accepts
``attention_probs_dropout_prob > 0`` only in eval mode. There is no attention mask (full
bidirectional attention over packed sequences).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

import torch
import torch.nn.functional as F

import tk_ops
from models.layers import at_least_fp32, init_weights, make_linear, reference_attention, to_autocast_dtype


@dataclasses.dataclass
class BertConfig:
    """The fields of Hugging Face's ``BertConfig`` that the model uses, plus ``reference``."""

    vocab_size: int = 8192
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int = 1024
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.0
    initializer_range: float = 0.02
    reference: bool = False  # True: standard PyTorch ops only

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, hf_config, **overrides) -> "BertConfig":
        """The config of a Hugging Face ``BertConfig`` (exact GELU, absolute positions, tied decoder)."""
        if hf_config.hidden_act != "gelu":
            raise ValueError(f"hidden_act must be 'gelu', got {hf_config.hidden_act!r}")
        position_type = getattr(hf_config, "position_embedding_type", None) or "absolute"
        if position_type != "absolute":
            raise ValueError(f"position_embedding_type must be 'absolute', got {position_type!r}")
        if not getattr(hf_config, "tie_word_embeddings", True):
            raise ValueError("the MLM decoder must be tied to the word embeddings (tie_word_embeddings=True)")
        fields = {f.name for f in dataclasses.fields(cls)} - {"reference"}
        values = {name: getattr(hf_config, name) for name in fields if hasattr(hf_config, name)}
        return cls(**{**values, **overrides})

    def to_hf_dict(self) -> dict:
        """A Hugging Face ``config.json`` for this model (``transformers`` loads it as BertForMaskedLM)."""
        values = dataclasses.asdict(self)
        del values["reference"]
        return {
            **values,
            "hidden_act": "gelu",
            "position_embedding_type": "absolute",
            "tie_word_embeddings": True,
            "model_type": "bert",
            "architectures": ["BertForMaskedLM"],
        }

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


class BertLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` whose forward fuses the sublayer's dropout and residual add in front:
    ``forward(x, residual=None, dropout_p=0.0) = LayerNorm(dropout(x) + residual)``."""

    def __init__(self, hidden_size: int, eps: float, *, reference: bool) -> None:
        super().__init__(hidden_size, eps=eps)
        self.reference = reference

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, dropout_p: float = 0.0):
        dropout_p = dropout_p if self.training else 0.0
        if self.reference:
            if dropout_p > 0:
                x = F.dropout(x, dropout_p)
            if residual is not None:
                x = x + residual
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return tk_ops.layer_norm(
            to_autocast_dtype(x),
            self.weight,
            self.bias,
            self.eps,
            residual=to_autocast_dtype(residual),
            dropout_p=dropout_p,
        )


class BertEmbeddings(torch.nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = torch.nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = torch.nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = BertLayerNorm(config.hidden_size, config.layer_norm_eps, reference=config.reference)
        self.dropout_p = config.hidden_dropout_prob

    def forward(self, input_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor]) -> torch.Tensor:
        if token_type_ids is None:  # every token of type 0, as Hugging Face's default buffer
            x = self.word_embeddings(input_ids) + self.token_type_embeddings.weight[0]
        else:
            x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(torch.arange(input_ids.shape[1], device=input_ids.device))
        return F.dropout(self.LayerNorm(x), self.dropout_p, self.training)


class BertSelfAttention(torch.nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.reference = config.reference
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.dropout_p = config.attention_probs_dropout_prob
        hidden = config.hidden_size
        self.query = make_linear(hidden, hidden, bias=True, reference=config.reference)
        self.key = make_linear(hidden, hidden, bias=True, reference=config.reference)
        self.value = make_linear(hidden, hidden, bias=True, reference=config.reference)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # (B, N, H * D) -> (B, H, N, D), a view
            return t.view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        dropout_p = self.dropout_p if self.training else 0.0
        if self.reference:
            out = reference_attention(q, k, v, causal=False, dropout_p=dropout_p)
        elif dropout_p > 0:
            raise ValueError(
                f"attention_probs_dropout_prob must be 0 to train on the tk path (tk_ops.attention has no "
                f"dropout), got {dropout_p}"
            )
        else:
            out = tk_ops.attention(q, k, v)
        return out.transpose(1, 2).reshape(batch, seq_len, -1)


class BertSublayerOutput(torch.nn.Module):
    """``LayerNorm(dropout(dense(x)) + residual)``: Hugging Face's BertSelfOutput and BertOutput."""

    def __init__(self, config: BertConfig, in_features: int) -> None:
        super().__init__()
        self.dense = make_linear(in_features, config.hidden_size, bias=True, reference=config.reference)
        self.LayerNorm = BertLayerNorm(config.hidden_size, config.layer_norm_eps, reference=config.reference)
        self.dropout_p = config.hidden_dropout_prob

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x), residual, self.dropout_p)


class BertAttention(torch.nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSublayerOutput(config, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x), x)


class BertIntermediate(torch.nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = make_linear(config.hidden_size, config.intermediate_size, bias=True, reference=config.reference)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))


class BertLayer(torch.nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertSublayerOutput(config, config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attended = self.attention(x)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(torch.nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = torch.nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x)
        return x


class BertModel(torch.nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def forward(self, input_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.encoder(self.embeddings(input_ids, token_type_ids))


class BertPredictionHeadTransform(torch.nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = make_linear(config.hidden_size, config.hidden_size, bias=True, reference=config.reference)
        self.LayerNorm = BertLayerNorm(config.hidden_size, config.layer_norm_eps, reference=config.reference)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(F.gelu(self.dense(x)))


class BertLMPredictionHead(torch.nn.Module):
    """transform, then the decoder tied to the word embeddings; ``bias`` is also ``decoder.bias``."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = make_linear(config.hidden_size, config.vocab_size, bias=True, reference=config.reference)
        self.bias = self.decoder.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(x))


class BertOnlyMLMHead(torch.nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.predictions(x)


class BertForMaskedLM(torch.nn.Module):
    """``forward(input_ids)`` -> logits (B, N, vocab); ``forward(input_ids, labels)`` -> mean
    cross-entropy over the labels that are not -100 (the masked positions)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.cls = BertOnlyMLMHead(config)
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight
        self.apply(lambda module: init_weights(module, config.initializer_range))

    @property
    def tied_weights(self) -> dict[str, str]:
        """state_dict key -> the key it shares its tensor with (dropped from checkpoints)."""
        return {
            "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
            "cls.predictions.decoder.bias": "cls.predictions.bias",
        }

    @property
    def blocks(self) -> torch.nn.ModuleList:
        """The repeated blocks (the units of per-block compile and FSDP sharding)."""
        return self.bert.encoder.layer

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        token_type_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        logits = self.cls(self.bert(input_ids, token_type_ids))
        if labels is None:
            return logits
        return F.cross_entropy(at_least_fp32(logits).flatten(0, 1), labels.flatten(), ignore_index=-100)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 3 x (2 x matmul parameters + bidirectional attention scores)."""
        c = self.config
        per_layer = 4 * c.hidden_size * c.hidden_size + 2 * c.hidden_size * c.intermediate_size
        matmul_params = c.num_hidden_layers * per_layer + c.hidden_size * c.hidden_size + c.hidden_size * c.vocab_size
        # q k^T and p v: 2 x 2 x (N x D) per query and head
        attention_scores = c.num_hidden_layers * c.num_attention_heads * 4 * seq_len * c.head_dim
        return 3.0 * (2.0 * matmul_params + attention_scores)
