"""A Mamba-2 language model on tk_ops: pre-norm blocks of ``tk_ops.nn.Mamba2Mixer`` (``tk.causal_conv1d``,
``tk.mamba2_ssd``, ``tk.rms_norm``) with RMSNorm, no MLP, as Mamba-2 has none.

``Mamba2ForCausalLM(Mamba2Config(...))`` has the module tree and state_dict keys of Hugging Face's
``Mamba2ForCausalLM`` (``backbone.embeddings``, ``backbone.layers.{i}.norm``,
``backbone.layers.{i}.mixer.in_proj`` / ``conv1d`` / ``dt_bias`` / ``A_log`` / ``D`` / ``norm`` /
``out_proj``, ``backbone.norm_f``, ``lm_head``), so a Hugging Face state_dict loads with
``load_state_dict`` and gives the same logits (``Mamba2Config.from_hf`` converts the config). As in
Hugging Face (``residual_in_fp32``), the residual stream stays fp32 under autocast. Full sequences
only: no cache, no padding mask.

The gated norm normalises per group of intermediate_size // n_groups channels, as mamba_ssm does and
as Hugging Face does from transformers 5.23. Before 5.23 Hugging Face's normalises over all
intermediate channels whatever n_groups: with n_groups > 1 those releases compute other logits from
the same weights (n_groups = 1, the default here, is the same in every release).

``config.reference=True`` runs the same parameters on standard PyTorch ops: the projections,
``F.conv1d``, the SSD by chunks (within a chunk its quadratic form, between chunks the state
recurrence, in fp32), the gated RMSNorm in fp32. ``config.peer=True`` (with reference=True) runs the
SSD on mamba_ssm's Triton kernels instead (``mamba_chunk_scan_combined``, ``models.peers``).
"""

from __future__ import annotations

import dataclasses
import json

import torch
import torch.nn.functional as F

import tk_ops
from models import peers
from models.layers import CausalLM, MixerBlock, ResidualRMSNorm, at_least_fp32


@dataclasses.dataclass
class Mamba2Config:
    """The fields of Hugging Face's ``Mamba2Config`` that the model uses, plus ``max_position_embeddings``
    (the context generate() keeps), ``reference`` and ``peer``."""

    vocab_size: int = 8192
    hidden_size: int = 256
    num_hidden_layers: int = 8
    num_heads: int = 8  # expand * hidden_size == num_heads * head_dim
    head_dim: int = 64
    state_size: int = 64
    n_groups: int = 1
    expand: int = 2
    conv_kernel: int = 4
    chunk_size: int = 64
    use_bias: bool = False
    use_conv_bias: bool = True
    hidden_act: str = "silu"
    layer_norm_epsilon: float = 1e-5
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    max_position_embeddings: int = 2048
    reference: bool = False  # True: standard PyTorch ops only
    peer: bool = False  # True (with reference): the SSD on mamba_ssm's Triton kernels

    def __post_init__(self) -> None:
        self.time_step_limit = tuple(float(v) for v in self.time_step_limit)
        peers.check_flags(self.reference, self.peer)

    @classmethod
    def from_hf(cls, hf_config, **overrides) -> "Mamba2Config":
        """The config of a Hugging Face ``Mamba2Config`` (residual in fp32, no prenorm-residual rescaling)."""
        if not hf_config.residual_in_fp32:
            raise ValueError("residual_in_fp32=False is not implemented (the residual stream is fp32)")
        fields = {f.name for f in dataclasses.fields(cls)} - {"max_position_embeddings", "reference", "peer"}
        values = {name: getattr(hf_config, name) for name in fields if hasattr(hf_config, name)}
        return cls(**{**values, **overrides})

    def to_hf_dict(self) -> dict:
        """A Hugging Face ``config.json`` for this model (``transformers`` loads it as Mamba2ForCausalLM)."""
        values = dataclasses.asdict(self)
        del values["reference"], values["peer"], values["max_position_embeddings"]
        return {**values, "residual_in_fp32": True, "model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"]}

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def reference_ssd(x, dt, A, B, C, chunk_size: int) -> torch.Tensor:
    """y (Bt, L, H, P) of the SSD recurrence h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t,
    for x (Bt, L, H, P), dt (Bt, L, H) (after bias and softplus), A (H,), B, C (Bt, L, G, N); by chunks."""
    batch, seq_len, heads, _ = x.shape
    B = B.repeat_interleave(heads // B.shape[2], dim=2)
    C = C.repeat_interleave(heads // C.shape[2], dim=2)
    padding = -seq_len % chunk_size  # zero steps (dt = 0) at the end leave the earlier outputs alone

    def chunked(t: torch.Tensor) -> torch.Tensor:  # (Bt, L, ...) -> (Bt, chunks, chunk_size, ...)
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, padding))
        return t.unflatten(1, (-1, chunk_size))

    x, dt, B, C = chunked(x), chunked(dt), chunked(B), chunked(C)
    log_decay = (dt * A).cumsum(2)  # (Bt, chunks, Q, H): log of the decay from the chunk's start
    # within a chunk: y_t += sum_{s<=t} (C_t . B_s) exp(log_decay_t - log_decay_s) dt_s x_s
    gaps = log_decay[:, :, :, None, :] - log_decay[:, :, None, :, :]  # (Bt, chunks, t, s, H)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()[:, :, None]
    decay = torch.exp(gaps.masked_fill(~causal, float("-inf")))
    scores = torch.einsum("bcthn,bcshn->bctsh", C, B) * decay * dt[:, :, None, :, :]
    y = torch.einsum("bctsh,bcshp->bcthp", scores, x)
    # between chunks: the state at each chunk's end, carried to the next chunks
    to_end = torch.exp(log_decay[:, :, -1:, :] - log_decay) * dt
    chunk_states = torch.einsum("bcsh,bcshp,bcshn->bchpn", to_end, x, B)
    state = torch.zeros_like(chunk_states[:, 0])
    states_before = []
    for chunk in range(chunk_states.shape[1]):
        states_before.append(state)
        state = torch.exp(log_decay[:, chunk, -1])[..., None, None] * state + chunk_states[:, chunk]
    y = y + torch.einsum("bcthn,bchpn,bcth->bcthp", C, torch.stack(states_before, 1), torch.exp(log_decay))
    return y.flatten(1, 2)[:, :seq_len]


class Mamba2Mixer(tk_ops.nn.Mamba2Mixer):
    """tk_ops.nn.Mamba2Mixer with a pure-PyTorch path (``reference``) and a peer path (``peer``: the
    reference path with mamba_ssm's SSD, which takes x, B, C in the activations' dtype, as mamba_ssm's
    Mamba2 layer hands them over, and returns y in x's dtype)."""

    def __init__(self, config: Mamba2Config, layer_idx: int) -> None:
        fields = {f.name for f in dataclasses.fields(config)} - {
            "vocab_size", "num_hidden_layers", "tie_word_embeddings", "initializer_range",
            "max_position_embeddings", "reference", "peer",
        }  # fmt: skip
        super().__init__(**{name: getattr(config, name) for name in fields}, layer_idx=layer_idx)
        self.reference = config.reference
        self.peer_ssd = peers.mamba_chunk_scan_combined() if config.peer else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.reference:
            return super().forward(hidden_states)
        seq_len = hidden_states.shape[1]
        groups_times_state = self.n_groups * self.ssm_state_size
        projected = F.linear(hidden_states, self.in_proj.weight, self.in_proj.bias)
        gate, xBC, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        conv = self.conv1d
        xBC = F.conv1d(xBC.transpose(1, 2), conv.weight, conv.bias, padding=conv.padding, groups=self.conv_dim)
        xBC = F.silu(xBC[..., :seq_len]).transpose(1, 2)
        x, B, C = xBC.split([self.intermediate_size, groups_times_state, groups_times_state], dim=-1)
        heads = x.unflatten(-1, (self.num_heads, self.head_dim))
        groups = (-1, (self.n_groups, self.ssm_state_size))
        B, C, A = B.unflatten(*groups), C.unflatten(*groups), -torch.exp(at_least_fp32(self.A_log))
        if self.peer_ssd is not None:
            y = self.peer_ssd(
                heads, dt, A, B, C, self.chunk_size, D=self.D, dt_bias=self.dt_bias, dt_softplus=True,
                dt_limit=self.time_step_limit,
            )  # fmt: skip
        else:
            heads, B, C = at_least_fp32(heads), at_least_fp32(B), at_least_fp32(C)
            dt = F.softplus(at_least_fp32(dt) + self.dt_bias).clamp(*self.time_step_limit)
            y = reference_ssd(heads, dt, A, B, C, self.chunk_size) + heads * self.D[:, None]
        y = at_least_fp32(y).flatten(2) * F.silu(at_least_fp32(gate))
        grouped = y.unflatten(-1, (self.n_groups, -1))
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.norm.variance_epsilon)
        out = self.norm.weight * grouped.flatten(2)
        return F.linear(out.to(hidden_states.dtype), self.out_proj.weight, self.out_proj.bias)


class Mamba2Model(torch.nn.Module):
    def __init__(self, config: Mamba2Config) -> None:
        super().__init__()
        self.embeddings = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(
            MixerBlock(
                Mamba2Mixer(config, layer_idx=i), config.hidden_size, None,
                eps=config.layer_norm_epsilon, reference=config.reference,
            )  # fmt: skip
            for i in range(config.num_hidden_layers)
        )
        self.norm_f = ResidualRMSNorm(config.hidden_size, config.layer_norm_epsilon, reference=config.reference)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x, residual = self.embeddings(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual)
        return self.norm_f(x, residual)[0]


class Mamba2ForCausalLM(CausalLM):
    EMBEDDING_KEY = "backbone.embeddings.weight"

    def __init__(self, config: Mamba2Config) -> None:
        super().__init__()
        self.config = config
        self.backbone = Mamba2Model(config)
        self.init_head(self.backbone.embeddings)

    @property
    def blocks(self) -> torch.nn.ModuleList:
        return self.backbone.layers

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.backbone(input_ids)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 3 x (2 x matmul parameters + the conv + the SSD).

        The SSD counts as its recurrence (the useful work; the chunked algorithm does more): the
        state update dt x B^T and the readout h C, 2 x 2 x P x N per head. The depthwise conv is
        2 x W multiply-adds per channel. Independent of seq_len."""
        c = self.config
        mixer = self.blocks[0].mixer
        in_proj = c.hidden_size * (mixer.intermediate_size + mixer.conv_dim + c.num_heads)
        out_proj = mixer.intermediate_size * c.hidden_size
        matmul_params = c.num_hidden_layers * (in_proj + out_proj) + c.hidden_size * c.vocab_size
        conv = 2 * c.conv_kernel * mixer.conv_dim
        ssd = c.num_heads * 2 * 2 * c.head_dim * c.state_size
        return 3.0 * (2.0 * matmul_params + c.num_hidden_layers * (conv + ssd))
