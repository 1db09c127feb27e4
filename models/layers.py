"""What the models share: linear layers, autocast casts for the norms, rotary tables, the pre-norm
residual block (RMSNorm, a sequence mixer, RMSNorm, SwiGLU MLP) and the causal-LM head, loss and sampling.

Every model module has a ``reference`` flag. ``reference=False`` runs on tk_ops (``tk_ops.linear``,
``tk_ops.attention``, ``tk_ops.rms_norm``, ``tk_ops.layer_norm``, ``tk_ops.rope_qk``, the mixers of
``tk_ops.nn``, and for a causal LM's training loss ``tk_ops.linear_cross_entropy`` where it does not
fall back to its reference on a GPU);
``reference=True`` runs on standard PyTorch ops only (``F.linear``,
``F.scaled_dot_product_attention``, ``F.layer_norm``, ...). Both paths have the same parameters
and state_dict keys, so one checkpoint serves both.

Under ``torch.autocast``, tk_ops.linear / matmul / attention / linear_cross_entropy cast fp32 inputs
to the autocast dtype themselves, as their torch counterparts do. The norms are not autocast (in
torch either); the tk path hands them activations in the autocast dtype (``to_autocast_dtype``) so
the fused residual stream and the kernels run in 16-bit, with the fp32 master weights.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

import tk_ops


def autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The dtype ``torch.autocast`` computes in on ``device`` now, or None outside autocast."""
    if not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


def to_autocast_dtype(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` cast to the autocast dtype of its device when autocast is on there, else ``t`` itself."""
    if t is None or not t.is_floating_point():
        return t
    dtype = autocast_dtype(t.device)
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 upcast to fp32 (the loss, the reference RMSNorm); fp32 and fp64 unchanged."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def make_linear(in_features: int, out_features: int, *, bias: bool, reference: bool) -> torch.nn.Linear:
    """``nn.Linear`` on the reference path, ``tk_ops.nn.Linear`` on the tk path (same parameters and keys)."""
    cls = torch.nn.Linear if reference else tk_ops.nn.Linear
    return cls(in_features, out_features, bias=bias)


def init_weights(module: torch.nn.Module, std: float) -> None:
    """Hugging Face's init of one module (``model.apply``): linear and embedding weights from N(0, std^2),
    linear biases zero; other modules untouched."""
    if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
        torch.nn.init.normal_(module.weight, mean=0.0, std=std)
    if isinstance(module, torch.nn.Linear) and module.bias is not None:
        torch.nn.init.zeros_(module.bias)


def rotary_inverse_frequencies(rotary_dim: int, theta: float) -> torch.Tensor:
    """``theta ** (-2i / rotary_dim)`` for i < rotary_dim / 2, in fp32 (Hugging Face's default rope)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (theta**exponents)


def rotary_tables(inverse_frequencies: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (seq_len, rotary_dim / 2) in fp32: the half form ``tk_ops.rope_qk`` takes."""
    return rotary_tables_at(inverse_frequencies, torch.arange(seq_len, device=inverse_frequencies.device))


def rotary_tables_at(inverse_frequencies: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of the angles at ``positions`` (any shape P), each (*P, rotary_dim / 2) in fp32."""
    angles = positions.to(torch.float32)[..., None] * inverse_frequencies.float()
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``apply_rotary_pos_emb`` for one of q, k (B, H, N, D), full rotary; cos, sin
    (N, D / 2) or, with a position per row, (B, 1, N, D / 2)."""
    cos = torch.cat((cos, cos), dim=-1).to(x.dtype)
    sin = torch.cat((sin, sin), dim=-1).to(x.dtype)
    return x * cos + rotate_half(x) * sin


def reference_attention(
    q, k, v, *, causal: bool, dropout_p: float = 0.0, mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with GQA (k, v may have fewer heads than q); ``mask`` (boolean,
    True where a query sees a key) replaces ``causal``."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal and mask is None,
        enable_gqa=k.shape[1] != q.shape[1],
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PackedDocuments:
    """Documents packed into the rows of a batch (B, N) of token ids, none attending to another.

    ``positions`` (B, N) int64: each token's position in its document, 0 where a document begins
    (and at every row's first token: a document cut by the row's start continues as a new piece).
    ``cu_seqlens`` (S + 1,) int32 and ``max_seqlen``: the same S pieces as rows of the flattened
    B * N tokens, in ``tk_ops.attention_varlen``'s layout.
    """

    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int

    @staticmethod
    def from_positions(positions: torch.Tensor) -> "PackedDocuments":
        """The packing of ``positions`` (B, N), which must restart at 0 or count up by one at every
        token and start each row at 0. Reads the positions on the host: build it where the batch is made."""
        if positions.dim() != 2 or positions.shape[1] == 0:
            raise ValueError(f"positions must be (B, N) with N >= 1, got shape {tuple(positions.shape)}")
        positions = positions.cpu()
        continues = positions[:, 1:] == positions[:, :-1] + 1
        if bool((positions[:, 0] != 0).any()) or not bool((continues | (positions[:, 1:] == 0)).all()):
            raise ValueError("positions must start every row at 0 and then restart at 0 or count up by one")
        starts = torch.nonzero(positions.flatten() == 0).flatten()
        cu_seqlens = torch.cat((starts, torch.tensor([positions.numel()]))).to(torch.int32)
        return PackedDocuments(positions, cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))

    def to(self, device: torch.device) -> "PackedDocuments":
        return dataclasses.replace(self, positions=self.positions.to(device), cu_seqlens=self.cu_seqlens.to(device))

    def same_document(self) -> torch.Tensor:
        """(B, 1, N, N) bool: True where query i and key j are tokens of the same piece of a row."""
        pieces = torch.cumsum(self.positions == 0, dim=1)
        return (pieces[:, :, None] == pieces[:, None, :]).unsqueeze(1)


def causal_mask(
    seq_len: int, device: torch.device, *, window: Optional[int] = None, documents: Optional[PackedDocuments] = None
) -> torch.Tensor:
    """(1 or B, 1, N, N) bool, True where query i sees key j: j <= i, and with ``window`` W also
    i - j < W (Mistral's sliding window: the token itself and the W - 1 before it), and with
    ``documents`` only keys of the query's own document."""
    query = torch.arange(seq_len, device=device)[:, None]
    key = torch.arange(seq_len, device=device)[None, :]
    sees = key <= query
    if window is not None:
        sees = sees & (key > query - window)
    sees = sees[None, None]
    return sees if documents is None else sees & documents.same_document()


class ResidualRMSNorm(torch.nn.Module):
    """RMSNorm with the residual add in front: ``forward(x, residual) -> (norm(h), h)``, h = residual + x.

    ``residual=None`` (the first block) normalises x and returns x as the stream. This is Hugging
    Face's LlamaRMSNorm (and Mamba2RMSNorm) applied to the residual stream.
    """

    def __init__(self, hidden_size: int, eps: float, *, reference: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.reference = reference

    def scale(self) -> torch.Tensor:
        """The per-channel factor of the normalised stream (a subclass may parametrise it otherwise)."""
        return self.weight

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if self.reference:
            stream = x if residual is None else residual + x
            normed = at_least_fp32(stream)
            normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.scale() * normed.to(stream.dtype), stream
        if residual is None:
            return tk_ops.rms_norm(to_autocast_dtype(x), self.scale(), self.eps), x
        return tk_ops.rms_norm(to_autocast_dtype(x), self.scale(), self.eps, residual=residual, return_residual=True)


class SwiGLUMLP(torch.nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool, reference: bool) -> None:
        super().__init__()
        self.gate_proj = make_linear(hidden_size, intermediate_size, bias=bias, reference=reference)
        self.up_proj = make_linear(hidden_size, intermediate_size, bias=bias, reference=reference)
        self.down_proj = make_linear(intermediate_size, hidden_size, bias=bias, reference=reference)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MixerBlock(torch.nn.Module):
    """Pre-norm block around a sequence mixer, with a SwiGLU MLP when ``intermediate_size`` is set
    (Mamba-2's blocks have none). ``forward(x, residual, **mixer_args) -> (x, residual)``: the
    block's output x is added to the residual stream by the next norm (the next block's, or the
    final one)."""

    def __init__(
        self, mixer: torch.nn.Module, hidden_size: int, intermediate_size: Optional[int], *, eps: float, reference: bool
    ) -> None:
        super().__init__()
        self.norm = ResidualRMSNorm(hidden_size, eps, reference=reference)
        self.mixer = mixer
        self.mlp_norm = self.mlp = None
        if intermediate_size:
            self.mlp_norm = ResidualRMSNorm(hidden_size, eps, reference=reference)
            self.mlp = SwiGLUMLP(hidden_size, intermediate_size, bias=False, reference=reference)

    def forward(self, x, residual, **mixer_args):
        normed, residual = self.norm(x, residual)
        x = self.mixer(normed, **mixer_args)
        if self.mlp is None:
            return x, residual
        normed, residual = self.mlp_norm(x, residual)
        return self.mlp(normed), residual


# Whether this build has a CUDA kernel for tk.linear_cross_entropy (fixed once the extension is loaded).
LINEAR_CROSS_ENTROPY_KERNEL = tk_ops.backends()["linear_cross_entropy"] == "cuda kernel"


def fuses_head_and_loss(device: torch.device) -> bool:
    """Whether the tk path's training loss on ``device`` is tk_ops.linear_cross_entropy: on the CPU (every
    op runs its reference there; the fused one never holds the logits) and where its kernel serves. On a
    GPU without that kernel its tiled fp32 reference would cost far more than the lm_head's GEMM kernel
    and F.cross_entropy, so the tk path keeps those."""
    return device.type == "cpu" or LINEAR_CROSS_ENTROPY_KERNEL


class CausalLM(torch.nn.Module):
    """What the causal language models share: ``forward(input_ids)`` -> logits (B, N, vocab);
    ``forward(input_ids, targets)`` -> mean cross-entropy over the targets that are not -100 (on the tk
    path ``tk_ops.linear_cross_entropy``, without the logits, where ``fuses_head_and_loss``);
    ``forward(..., documents=PackedDocuments)`` for rows of packed documents (where implemented);
    ``generate``; the weight initialisation; the tied embedding.

    A subclass sets ``config`` (with vocab_size, hidden_size, initializer_range, tie_word_embeddings,
    max_position_embeddings, reference), builds its body as ``self.model`` (embed_tokens, layers, a
    final norm: Hugging Face's Llama layout) and calls ``init_head(embedding)``; a body laid out
    otherwise overrides ``hidden_states(input_ids)``, ``blocks`` and ``EMBEDDING_KEY`` (the
    embedding's state_dict key, the tied lm_head's source).
    """

    EMBEDDING_KEY = "model.embed_tokens.weight"

    @property
    def blocks(self) -> torch.nn.ModuleList:
        """The repeated blocks (the units of per-block compile and FSDP sharding)."""
        return self.model.layers

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def packed_hidden_states(self, input_ids: torch.Tensor, documents: PackedDocuments) -> torch.Tensor:
        """``hidden_states`` with each token attending only within its document (models that implement it)."""
        raise NotImplementedError(f"{type(self).__name__} does not take packed documents")

    def init_head(self, embedding: torch.nn.Embedding, *, keep: tuple[type, ...] = ()) -> None:
        """Add lm_head (tied to ``embedding`` if the config says so), then initialise every linear
        layer and embedding, except inside modules of the types in ``keep`` (which initialise
        themselves for a reason, e.g. Hyena's implicit filters)."""
        c = self.config
        self.lm_head = make_linear(c.hidden_size, c.vocab_size, bias=False, reference=c.reference)
        if c.tie_word_embeddings:
            self.lm_head.weight = embedding.weight
        kept = {id(inner) for module in self.modules() if isinstance(module, keep) for inner in module.modules()}
        self.apply(lambda module: None if id(module) in kept else init_weights(module, c.initializer_range))

    @property
    def tied_weights(self) -> dict[str, str]:
        """state_dict key -> the key it shares its tensor with (dropped from checkpoints)."""
        return {"lm_head.weight": self.EMBEDDING_KEY} if self.config.tie_word_embeddings else {}

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: Optional[torch.Tensor] = None,
        *,
        documents: Optional[PackedDocuments] = None,
    ) -> torch.Tensor:
        hidden = self.hidden_states(input_ids) if documents is None else self.packed_hidden_states(input_ids, documents)
        if targets is None:
            return self.lm_head(hidden)
        if self.config.reference:
            logits = self.lm_head(hidden)
            return F.cross_entropy(at_least_fp32(logits).flatten(0, 1), targets.flatten(), ignore_index=-100)
        if not fuses_head_and_loss(hidden.device):
            logits = self.lm_head(hidden)
            return F.cross_entropy(at_least_fp32(logits).flatten(0, 1), targets.flatten(), ignore_index=-100)
        # The head and the loss in one op: the (B N, vocab) logits, the largest activation of a small
        # model's training step, are never held. It casts under autocast as the lm_head would.
        return tk_ops.linear_cross_entropy(hidden, self.lm_head.weight, targets, bias=self.lm_head.bias,
                                           ignore_index=-100)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` continuations of input_ids (B, N), recomputing the prefix each
        step (no cache: this is for looking at what a small model learnt)."""
        for _ in range(max_new_tokens):
            context = input_ids[:, -self.config.max_position_embeddings :]
            logits = self(context)[:, -1, :].float()
            if temperature == 0:
                next_ids = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    threshold = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < threshold, float("-inf"))
                next_ids = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            input_ids = torch.cat((input_ids, next_ids), dim=1)
        return input_ids
