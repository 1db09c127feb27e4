"""The models ``python -m models.train`` trains and their presets: ``--model`` names a model,
``--preset`` its shape (a config's fields) and the defaults of the run (sequence length, batch,
steps, learning rate, warmup, evaluation interval).
"""

from __future__ import annotations

import dataclasses

from models.based import BasedConfig, BasedForCausalLM
from models.bert import BertConfig, BertForMaskedLM
from models.gdn import GDNConfig, GDNForCausalLM
from models.hyena import HyenaConfig, HyenaForCausalLM
from models.llama import LlamaConfig, LlamaForCausalLM
from models.mamba2 import Mamba2Config, Mamba2ForCausalLM

# --model -> (config class, model class); all but BERT are causal language models
MODELS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "bert": (BertConfig, BertForMaskedLM),
    "based": (BasedConfig, BasedForCausalLM),
    "mamba2": (Mamba2Config, Mamba2ForCausalLM),
    "hyena": (HyenaConfig, HyenaForCausalLM),
    "gdn": (GDNConfig, GDNForCausalLM),
}


@dataclasses.dataclass(frozen=True)
class Preset:
    """A model's shape, the defaults of the run flags of the same names, and where it is meant to run."""

    model: dict  # config fields
    seq_len: int
    batch_size: int  # rows per rank and micro-step
    steps: int
    lr: float
    warmup: int
    eval_every: int
    where: str


def llama_shape(hidden: int, layers: int, heads: int, kv_heads: int, mlp: int, **extra) -> dict:
    return dict(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=mlp, **extra,
    )  # fmt: skip


def bert_shape(hidden: int, layers: int, heads: int, mlp: int) -> dict:
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=mlp)


def based_shape(hidden: int, layers: int, heads: int, mlp: int, attention_every: int) -> dict:
    """Based heads of F = 16 and value dim hidden / heads; attention blocks with as many heads."""
    return dict(
        hidden_size=hidden, num_hidden_layers=layers, num_heads=heads, intermediate_size=mlp,
        attention_every=attention_every, num_attention_heads=heads, num_key_value_heads=heads,
    )  # fmt: skip


def mamba2_shape(hidden: int, layers: int, state: int, chunk: int) -> dict:
    """Heads of P = 64 (the kernels' head dim), expand 2, one B/C group."""
    return dict(
        hidden_size=hidden, num_hidden_layers=layers, num_heads=2 * hidden // 64, head_dim=64, state_size=state,
        chunk_size=chunk,
    )  # fmt: skip


def hyena_shape(hidden: int, layers: int, mlp: int) -> dict:
    return dict(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=mlp)


def gdn_shape(hidden: int, layers: int, heads: int, kv_heads: int, key_heads: int, head_dim: int, mlp: int) -> dict:
    """Every head of head_dim channels; Gated DeltaNet with twice as many value heads as key heads
    (Qwen3-Next's 16 / 32); every 4th block full attention."""
    return dict(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, linear_num_key_heads=key_heads, linear_num_value_heads=2 * key_heads,
        linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, intermediate_size=mlp,
    )  # fmt: skip


# Parameters (with this corpus's 8192-id vocabulary): llama nano 0.6M, tiny 5.2M, small 29M, base 144M,
# 1b 990M (the shape of Llama-3.2-1B: 16 layers, d=2048, 32 query / 8 key-value heads of 64, MLP 8192,
# rope theta 5e5); bert nano 0.6M, tiny 5.5M, small 30M, base 92M (BERT-base's shape); based nano 0.6M,
# tiny 4.4M, small 29M, base 148M, 1b 950M (every 4th block full attention, as the Based paper's hybrids);
# mamba2 nano 0.6M, tiny 3.8M, small 32M, base 167M, 1b 1.05B (Mamba2-1.3B's width, 40 layers instead of 48);
# hyena nano 0.6M, tiny 5.6M, small 32M, base 164M, 1b 945M.
# tiny is every model's CPU demo: 300 steps of 16 x 128 tokens (the same tokens for all). On the CPU the
# mixers run the ops' PyTorch references, so the linear-time models are as deep as keeps their fp32
# step near Llama tiny's (4 blocks) on 2 cores: Based 3 blocks, Mamba-2 4 (its chunk and state as on
# the GPU), Hyena 4. README.md has each run's minutes and eval loss.
# fmt: off
PRESETS = {
    "llama": {  #   hidden, layers, heads, kv heads, mlp             seq  batch steps  lr   warmup eval  where
        "nano": Preset(llama_shape(64, 2, 4, 2, 160),                    32,   4,    8, 3e-3,   2,    4, "CPU (tests)"),
        "tiny": Preset(llama_shape(256, 4, 4, 2, 768),                  128,  16,  300, 2e-3,  30,   25, "CPU"),
        "small": Preset(llama_shape(512, 8, 8, 4, 1536),                512,  32, 1000, 1e-3, 100,  100, "GPU"),
        "base": Preset(llama_shape(1024, 12, 16, 4, 2816),             1024,  16, 1000, 6e-4, 100,  100, "GPU"),
        "1b": Preset(llama_shape(2048, 16, 32, 8, 8192, rope_theta=5e5), 2048, 8,  300, 3e-4,  30,   50, "H100"),
    },
    "bert": {  #    hidden, layers, heads, mlp
        "nano": Preset(bert_shape(64, 2, 4, 160),                        32,   4,    8, 3e-3,   2,    4, "CPU (tests)"),
        "tiny": Preset(bert_shape(256, 4, 4, 1024),                     128,  16,  300, 1e-3,  30,   50, "CPU"),
        "small": Preset(bert_shape(512, 8, 8, 2048),                    512,  32, 1000, 5e-4, 100,  100, "GPU"),
        "base": Preset(bert_shape(768, 12, 12, 3072),                   512,  32, 1000, 2e-4, 100,  100, "GPU"),
    },
    # Based heads of 64 value channels (the kernels' Dv); small and 1b ran on the H100, base not yet
    "based": {  #   hidden, layers, heads, mlp, attention every
        "nano": Preset(based_shape(64, 2, 2, 160, 2),                    32,   4,    8, 3e-3,   2,    4, "CPU (tests)"),
        "tiny": Preset(based_shape(256, 3, 4, 768, 0),                  128,  16,  300, 2e-3,  30,   25, "CPU"),
        "small": Preset(based_shape(512, 8, 8, 1536, 4),                512,  32, 1000, 1e-3, 100,  100, "GPU (H100: bench_long_context)"),
        "base": Preset(based_shape(1024, 12, 16, 2816, 4),             1024,  16, 1000, 6e-4, 100,  100, "GPU, not yet run"),
        "1b": Preset(based_shape(2048, 20, 32, 5632, 4),               2048,   8,  300, 3e-4,  30,   50, "H100 (bench_training)"),
    },
    # no MLP: twice the layers of a transformer of the same width; small and 1b ran on the H100, base not yet
    "mamba2": {  #  hidden, layers, state, chunk
        "nano": Preset(mamba2_shape(64, 2, 16, 16),                      32,   4,    8, 3e-3,   2,    4, "CPU (tests)"),
        "tiny": Preset(mamba2_shape(256, 4, 64, 64),                    128,  16,  300, 2e-3,  30,   25, "CPU"),
        "small": Preset(mamba2_shape(512, 16, 128, 128),                512,  32, 1000, 1e-3, 100,  100, "GPU (H100: bench_long_context)"),
        "base": Preset(mamba2_shape(1024, 24, 128, 256),               1024,  16, 1000, 6e-4, 100,  100, "GPU, not yet run"),
        "1b": Preset(mamba2_shape(2048, 40, 128, 256),                 2048,   8,  300, 3e-4,  30,   50, "H100 (bench_training, batch 4 x grad-accum 2)"),
    },
    # sequence lengths of the GPU presets are powers of two (tk.fftconv's kernels); small and 1b ran on the H100
    "hyena": {  #   hidden, layers, mlp
        "nano": Preset(hyena_shape(64, 2, 160),                          32,   4,    8, 3e-3,   2,    4, "CPU (tests)"),
        "tiny": Preset(hyena_shape(256, 4, 768),                        128,  16,  300, 2e-3,  30,   25, "CPU"),
        "small": Preset(hyena_shape(512, 8, 1536),                      512,  32, 1000, 1e-3, 100,  100, "GPU (H100: bench_long_context)"),
        "base": Preset(hyena_shape(1024, 12, 2816),                    1024,  16, 1000, 6e-4, 100,  100, "GPU, not yet run"),
        "1b": Preset(hyena_shape(2048, 18, 5632),                      2048,   8,  300, 3e-4,  30,   50, "H100 (bench_training)"),
    },
    # Qwen3-Next's 3:1 hybrid without experts; the gated delta rule runs its PyTorch reference on every device
    "gdn": {  #     hidden, layers, heads, kv heads, key heads, head dim, mlp
        "nano": Preset(gdn_shape(64, 4, 4, 2, 2, 16, 160),              32,   4,    8, 3e-3,   2,    4, "CPU (tests)"),
        "tiny": Preset(gdn_shape(256, 4, 4, 2, 1, 64, 768),            128,  16,  300, 2e-3,  30,   25, "CPU"),
        "1b": Preset(gdn_shape(2048, 20, 16, 2, 8, 128, 5632),        2048,   8,  300, 3e-4,  30,   50, "GPU, not yet run"),
    },
}
# fmt: on


def build_model(kind: str, model_fields: dict, *, vocab_size: int, seq_len: int, reference: bool, peer: bool = False):
    """A ``kind`` model of config fields ``model_fields``, its positions sized for ``seq_len``; ``peer``
    (the models of ``models.peers.PEER_OPS``) the reference model with the mixer's op from its peer."""
    config_class, model_class = MODELS[kind]
    context = max(512, seq_len) if kind == "bert" else seq_len
    flags = {"reference": True, "peer": True} if peer else {"reference": reference}
    config = config_class(**{"max_position_embeddings": context, **model_fields}, vocab_size=vocab_size, **flags)
    return model_class(config)
