"""Train a model of models/ (Llama, BERT, Based, Mamba-2, Hyena) on the prepared corpus
(``python -m models.data prepare``).

    python -m models.train --model llama --preset tiny                # CPU, a few minutes
    python -m models.train --model bert --preset tiny
    python -m models.train --model based --preset tiny                # also mamba2, hyena
    python -m models.train --model llama --preset 1b --compile        # one H100
    python -m models.train --model llama --preset 1b --compile --reference
    torchrun --nproc_per_node 2 -m models.train --model llama --preset 1b --compile --parallel fsdp

One process trains on one device (CPU, or the GPU of its local rank); under ``torchrun`` the
ranks train one model with DDP (``--parallel ddp``, the default) or FSDP2 (``--parallel fsdp``,
``fully_shard`` per block and at the root). The global batch of a step (``--batch-size`` rows per
rank and micro-step x ``--grad-accum`` x ranks) is the same data whatever the number of ranks,
so one GPU with ``--grad-accum 2`` and two GPUs see the same batches and the same loss.

What a run does: AdamW (weight decay on matrices only) with linear warmup and cosine decay to 10%
of the peak learning rate, gradient clipping at 1.0, bf16 autocast on GPU (fp32 master weights;
``--dtype fp32`` turns it off), a tqdm progress bar with the loss, tokens/s and MFU, an
evaluation loss every ``--eval-every`` steps, and in ``--out`` (default ``runs/<model>-<preset>``):
``checkpoint.safetensors`` (model, optimizer, step, the RNG states of every rank and the loss
history), ``loss.png`` and ``summary.json``. ``--resume`` continues from the checkpoint exactly
where it stopped: on the same device and number of ranks the losses are bit-for-bit those of an
uninterrupted run. ``--stop-at N`` stops after step N of the ``--steps`` schedule (an
interrupted job). ``--reference`` trains the pure-PyTorch path of the same model; ``--compile``
compiles each block with ``torch.compile(fullgraph=True)`` (before FSDP sharding).

MFU counts the matmul FLOPs (6 x matmul parameters per token, the output layer included) plus
each model's sequence mixing (attention scores, linear attention, SSD, FFT convolution: the
model's ``flops_per_token``), against the dense bf16 peak of the GPU (``--peak-tflops`` to set it; on
CPU it is shown only when set).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from models.based import BasedConfig, BasedForCausalLM
from models.bert import BertConfig, BertForMaskedLM
from models.data import DEFAULT_DATA_DIR, IGNORE_INDEX, REPO_ROOT, Batches, TokenData
from models.hyena import HyenaConfig, HyenaForCausalLM
from models.llama import LlamaConfig, LlamaForCausalLM
from models.mamba2 import Mamba2Config, Mamba2ForCausalLM

CHECKPOINT_FORMAT = "tk_ops-models-checkpoint-1"
# --model -> (config class, model class); all but BERT are causal language models
MODELS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "bert": (BertConfig, BertForMaskedLM),
    "based": (BasedConfig, BasedForCausalLM),
    "mamba2": (Mamba2Config, Mamba2ForCausalLM),
    "hyena": (HyenaConfig, HyenaForCausalLM),
}
MIN_LR_FRACTION = 0.1


@dataclasses.dataclass(frozen=True)
class Preset:
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


# Parameters (with this corpus's 8192-id vocabulary): llama nano 0.6M, tiny 5.2M, small 29M, base 144M,
# 1b 990M (the shape of Llama-3.2-1B: 16 layers, d=2048, 32 query / 8 key-value heads of 64, MLP 8192,
# rope theta 5e5); bert nano 0.6M, tiny 5.5M, small 30M, base 92M (BERT-base's shape); based nano 0.6M,
# tiny 5.1M, small 29M, base 148M, 1b 950M (every 4th block full attention, as the Based paper's hybrids);
# mamba2 nano 0.6M, tiny 5.6M, small 32M, base 167M, 1b 1.05B (Mamba2-1.3B's width, 40 layers instead of 48);
# hyena nano 0.6M, tiny 5.6M, small 32M, base 164M, 1b 945M.
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
    # Based heads of 64 value channels (the kernels' Dv); the GPU presets are not yet run
    "based": {  #   hidden, layers, heads, mlp, attention every
        "nano": Preset(based_shape(64, 2, 2, 160, 2),                    32,   4,    8, 3e-3,   2,    4, "CPU (tests)"),
        "tiny": Preset(based_shape(256, 4, 4, 768, 0),                  128,  16,  300, 2e-3,  30,   25, "CPU"),
        "small": Preset(based_shape(512, 8, 8, 1536, 4),                512,  32, 1000, 1e-3, 100,  100, "GPU, not yet run"),
        "base": Preset(based_shape(1024, 12, 16, 2816, 4),             1024,  16, 1000, 6e-4, 100,  100, "GPU, not yet run"),
        "1b": Preset(based_shape(2048, 20, 32, 5632, 4),               2048,   8,  300, 3e-4,  30,   50, "H100, not yet run"),
    },
    # no MLP: twice the layers of a transformer of the same width; the GPU presets are not yet run
    "mamba2": {  #  hidden, layers, state, chunk
        "nano": Preset(mamba2_shape(64, 2, 16, 16),                      32,   4,    8, 3e-3,   2,    4, "CPU (tests)"),
        "tiny": Preset(mamba2_shape(256, 8, 64, 64),                    128,  16,  300, 2e-3,  30,   25, "CPU"),
        "small": Preset(mamba2_shape(512, 16, 128, 128),                512,  32, 1000, 1e-3, 100,  100, "GPU, not yet run"),
        "base": Preset(mamba2_shape(1024, 24, 128, 256),               1024,  16, 1000, 6e-4, 100,  100, "GPU, not yet run"),
        "1b": Preset(mamba2_shape(2048, 40, 128, 256),                 2048,   8,  300, 3e-4,  30,   50, "H100, not yet run"),
    },
    # sequence lengths of the GPU presets are powers of two (tk.fftconv's kernels); not yet run
    "hyena": {  #   hidden, layers, mlp
        "nano": Preset(hyena_shape(64, 2, 160),                          32,   4,    8, 3e-3,   2,    4, "CPU (tests)"),
        "tiny": Preset(hyena_shape(256, 4, 768),                        128,  16,  300, 2e-3,  30,   25, "CPU"),
        "small": Preset(hyena_shape(512, 8, 1536),                      512,  32, 1000, 1e-3, 100,  100, "GPU, not yet run"),
        "base": Preset(hyena_shape(1024, 12, 2816),                    1024,  16, 1000, 6e-4, 100,  100, "GPU, not yet run"),
        "1b": Preset(hyena_shape(2048, 18, 5632),                      2048,   8,  300, 3e-4,  30,   50, "H100, not yet run"),
    },
}
# fmt: on

# dense bf16 tensor-core peaks, FLOP/s per GPU (matched against the device name in this order)
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("H800", 989e12), ("A100", 312e12))


# ------------------------------------------------------------------------------------ set-up


@dataclasses.dataclass
class Runtime:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_runtime(args) -> Runtime:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    use_cuda = args.device == "cuda" or (args.device is None and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    return Runtime(rank, world_size, device)


def build_model(kind: str, model_fields: dict, *, vocab_size: int, seq_len: int, reference: bool):
    config_class, model_class = MODELS[kind]
    context = max(512, seq_len) if kind == "bert" else seq_len
    config = config_class(
        **{"max_position_embeddings": context, **model_fields}, vocab_size=vocab_size, reference=reference
    )
    return model_class(config)


def parallelize(model: torch.nn.Module, args, runtime: Runtime) -> torch.nn.Module:
    """Compile each block (before sharding, as FSDP2 needs), then wrap for DDP or shard with FSDP2."""
    if args.compile:
        for block in model.blocks:
            block.compile(fullgraph=True)
    if runtime.world_size == 1:
        return model
    if args.parallel == "ddp":
        device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def make_optimizer(model: torch.nn.Module, args, device: torch.device) -> torch.optim.AdamW:
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": args.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def learning_rate(step: int, args) -> float:
    """Linear warmup over args.warmup steps, then cosine decay to MIN_LR_FRACTION x args.lr."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * (MIN_LR_FRACTION + (1.0 - MIN_LR_FRACTION) * cosine)


def peak_flops(args, device: torch.device) -> Optional[float]:
    """Peak FLOP/s of one device: --peak-tflops, else the bf16 peak of a known GPU, else None."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if device.type != "cuda" or args.dtype != "bf16":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)


# ------------------------------------------------------------------------------ train, eval


def autocast(args, device: torch.device):
    if args.dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def gradient_sync(model: torch.nn.Module, enabled: bool):
    """Skip the gradient all-reduce / reduce-scatter on all but the last micro-step."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if enabled else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # an FSDP2 module
        model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def _shares(targets: torch.Tensor, parts: list[slice]) -> list[float]:
    """Each part's share of the targets (labels other than -100) of the global batch."""
    counted = targets != IGNORE_INDEX
    total = counted.sum().item()
    return [counted[part].sum().item() / total for part in parts]


def train_step(model, optimizer, batches: Batches, step: int, args, runtime: Runtime) -> float:
    """One optimizer step on the global batch of ``step``; returns its loss (mean over all targets)."""
    inputs, targets = batches.global_batch_at(step)
    first = runtime.rank * args.batch_size * args.grad_accum
    parts = [slice(first + i * args.batch_size, first + (i + 1) * args.batch_size) for i in range(args.grad_accum)]
    # Each micro-batch loss is a mean over its targets; weighting it by its share of all the
    # targets of the global batch (x ranks, which DDP/FSDP average over) gives the global mean.
    total = torch.zeros((), device=runtime.device)
    for micro, (part, share) in enumerate(zip(parts, _shares(targets, parts))):
        x, y = inputs[part].to(runtime.device), targets[part].to(runtime.device)
        with gradient_sync(model, micro == args.grad_accum - 1):
            with autocast(args, runtime.device):
                loss = model(x, y) * share
            (loss * runtime.world_size).backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if runtime.world_size > 1:
        dist.all_reduce(total)
    return total.item()


@torch.no_grad()
def evaluate(model, batches: Batches, args, runtime: Runtime) -> float:
    """The loss over the first ``args.eval_batches`` global batches of ``batches`` (in order), each
    rank taking its rows in micro-batches of ``args.batch_size``."""
    model.eval()
    steps = min(args.eval_batches, batches.steps_per_epoch)
    rows = batches.global_batch // runtime.world_size
    first = runtime.rank * rows
    parts = [
        slice(start, min(start + args.batch_size, first + rows))
        for start in range(first, first + rows, args.batch_size)
    ]
    total = torch.zeros((), device=runtime.device)
    for step in range(steps):
        inputs, targets = batches.global_batch_at(step)
        for part, share in zip(parts, _shares(targets, parts)):
            with autocast(args, runtime.device):
                loss = model(inputs[part].to(runtime.device), targets[part].to(runtime.device))
            total += loss.float() * share / steps
    if runtime.world_size > 1:
        dist.all_reduce(total)
    model.train()
    return total.item()


def sample_text(model, data: TokenData, args, runtime: Runtime, prompt: str = "And God said") -> str:
    """A short continuation of ``prompt`` (causal models), sampled identically on every rank."""
    tokenizer = data.tokenizer()
    ids = torch.tensor([tokenizer.encode(prompt)], device=runtime.device)
    generator = torch.Generator(device=runtime.device).manual_seed(args.seed)
    # compiled blocks would recompile for every new length: sample eagerly
    with torch.compiler.set_stance("force_eager"), autocast(args, runtime.device):
        model.eval()
        out = unwrap(model).generate(ids, args.sample_tokens, temperature=0.8, top_k=40, generator=generator)
        model.train()
    return tokenizer.decode(out[0].tolist())


# ------------------------------------------------------------------------------- checkpoints


def _rng_states(runtime: Runtime) -> dict[str, torch.Tensor]:
    """The RNG states of every rank (gathered on all ranks), keyed ``rng.<device>.<rank>``."""
    local = {"cpu": torch.get_rng_state()}
    if runtime.device.type == "cuda":
        local["cuda"] = torch.cuda.get_rng_state(runtime.device)
    gathered = [local]
    if runtime.world_size > 1:
        gathered = [None] * runtime.world_size
        dist.all_gather_object(gathered, local)
    return {f"rng.{kind}.{rank}": state for rank, states in enumerate(gathered) for kind, state in states.items()}


def save_checkpoint(path: Path, model, optimizer, step: int, history: dict, args, runtime: Runtime) -> None:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
    rng = _rng_states(runtime)
    if runtime.is_main:
        tied = unwrap(model).tied_weights
        tensors = {f"model.{k}": v.contiguous() for k, v in model_state.items() if k not in tied}
        for name, state in optimizer_state["state"].items():
            tensors.update({f"optimizer.{name}.{k}": v.contiguous() for k, v in state.items()})
        tensors.update(rng)
        metadata = {
            "format": CHECKPOINT_FORMAT,
            "step": str(step),
            "world_size": str(runtime.world_size),
            "model": args.model,
            "config": unwrap(model).config.to_json(),
            "param_groups": json.dumps(optimizer_state["param_groups"]),
            "data": json.dumps({"position": step, "seed": args.seed, "text_sha256": args.data_sha256}),
            "history": json.dumps(history),
        }
        temporary = path.with_suffix(".tmp")
        save_file(tensors, str(temporary), metadata=metadata)
        os.replace(temporary, path)  # a crash while writing leaves the previous checkpoint intact
    if runtime.world_size > 1:
        dist.barrier()


def load_model(path: Path, *, reference: bool = False) -> torch.nn.Module:
    """The model of a checkpoint written by this script, on CPU in eval mode (e.g. to sample from it)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
        state = {key.removeprefix("model."): f.get_tensor(key) for key in f.keys() if key.startswith("model.")}
    fields = {**json.loads(metadata["config"]), "reference": reference}
    config_class, model_class = MODELS[metadata["model"]]
    model = model_class(config_class(**fields))
    for key, source in model.tied_weights.items():
        state[key] = state[source]
    model.load_state_dict(state)
    return model.eval()


def load_checkpoint(path: Path, model, optimizer, args, runtime: Runtime) -> tuple[int, dict]:
    """Restore model, optimizer and RNG states from ``path``; return (step, history)."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    if not path.exists():
        raise SystemExit(f"--resume: no checkpoint at {path}")
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    if metadata.get("format") != CHECKPOINT_FORMAT:
        raise SystemExit(f"{path} is not a checkpoint of this script (format {metadata.get('format')!r})")
    config = unwrap(model).config
    if json.loads(metadata["config"]) != json.loads(config.to_json()):
        raise SystemExit(f"{path} holds another model config: {metadata['config']}")
    data = json.loads(metadata["data"])
    if (data["seed"], data["text_sha256"]) != (args.seed, args.data_sha256):
        raise SystemExit(f"{path} was trained on other data or with another --seed: {data}")
    tensors = load_file(str(path))
    model_state = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    for key, source in unwrap(model).tied_weights.items():
        model_state[key] = model_state[source]
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    optimizer_state: dict = {"state": {}, "param_groups": json.loads(metadata["param_groups"])}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            name, state_key = key.removeprefix("optimizer.").rsplit(".", 1)
            optimizer_state["state"].setdefault(name, {})[state_key] = value
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)
    if f"rng.cpu.{runtime.rank}" in tensors and int(metadata["world_size"]) == runtime.world_size:
        torch.set_rng_state(tensors[f"rng.cpu.{runtime.rank}"])
        if runtime.device.type == "cuda" and f"rng.cuda.{runtime.rank}" in tensors:
            torch.cuda.set_rng_state(tensors[f"rng.cuda.{runtime.rank}"], runtime.device)
    return int(metadata["step"]), json.loads(metadata["history"])


# -------------------------------------------------------------------------------------- plot


def plot_losses(history: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    if history["train"]:
        steps, losses = zip(*history["train"])
        ax.plot(steps, losses, lw=1, alpha=0.8, label="train")
    if history["eval"]:
        steps, losses = zip(*history["eval"])
        ax.plot(steps, losses, "o-", ms=4, label="eval")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -------------------------------------------------------------------------------------- main


def parse_args(argv: Optional[list[str]] = None):
    parser = argparse.ArgumentParser(
        prog="python -m models.train",
        description="\n\n".join(__doc__.split("\n\n")[:2]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", choices=sorted(PRESETS), required=True)
    parser.add_argument(
        "--preset", default="tiny", help="nano (tests) | tiny (CPU demo) | small | base | 1b (not bert): see PRESETS"
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR, help="prepared data directory")
    parser.add_argument("--out", type=Path, help="run directory (default runs/<model>-<preset>[-reference])")
    parser.add_argument("--steps", type=int, help="length of the learning-rate schedule (preset default)")
    parser.add_argument("--stop-at", type=int, help="stop (and save) after this step of the schedule")
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--batch-size", type=int, help="rows per rank and micro-step")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    parser.add_argument("--lr", type=float, help="peak learning rate")
    parser.add_argument("--warmup", type=int, help="warmup steps")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--eval-every", type=int)
    parser.add_argument("--eval-batches", type=int, default=4, help="global batches per evaluation")
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: at the end only)")
    parser.add_argument("--no-save", action="store_true", help="write no checkpoint (benchmarks)")
    parser.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint.safetensors")
    parser.add_argument("--reference", action="store_true", help="train the pure-PyTorch path")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block (fullgraph)")
    parser.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp", help="under torchrun")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), help="autocast dtype (default bf16 on GPU, fp32 on CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peak-tflops", type=float, help="peak of one device for MFU")
    parser.add_argument("--timing-warmup", type=int, default=3, help="steps left out of the tokens/s average")
    parser.add_argument("--sample-tokens", type=int, default=48, help="causal models: sample this many tokens at the end")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.preset not in PRESETS[args.model]:
        parser.error(f"--preset for {args.model} must be one of {sorted(PRESETS[args.model])}, got {args.preset!r}")
    preset = PRESETS[args.model][args.preset]
    for name in ("seq_len", "batch_size", "steps", "lr", "warmup", "eval_every"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    args.stop_at = min(args.stop_at or args.steps, args.steps)
    if args.out is None:
        args.out = REPO_ROOT / "runs" / f"{args.model}-{args.preset}{'-reference' if args.reference else ''}"
    return args, preset


def make_batches(data: TokenData, args, world_batch: int) -> tuple[Batches, Batches]:
    """(train, eval) batches: shuffled training windows, the first validation windows in order."""
    common = dict(
        kind="mlm" if args.model == "bert" else "lm",
        seq_len=args.seq_len,
        global_batch=world_batch,
        seed=args.seed,
        vocab_size=data.meta["vocab_size"],
        mask_id=data.meta["mask_token_id"],
    )
    return Batches(data.train, **common), Batches(data.val, **common, shuffle=False)


def train_loop(
    model, optimizer, batches: Batches, eval_batches: Batches, step: int, history: dict, args, runtime, speed
):
    """Steps ``step`` .. ``args.stop_at``, appending to history; returns (tokens, seconds) of the
    timed steps (all but the first ``args.timing_warmup``). ``speed(tokens_per_s)`` -> progress postfix."""
    from tqdm import tqdm

    log = tqdm.write if runtime.is_main else (lambda _: None)
    if step == 0 and not history["eval"]:
        history["eval"].append([0, evaluate(model, eval_batches, args, runtime)])
        log(f"step {0:>6}  eval loss {history['eval'][-1][1]:.4f}")
    tokens_per_step = batches.global_batch * args.seq_len
    timed_tokens, timed_seconds, first_step = 0, 0.0, step
    progress = tqdm(
        total=args.stop_at,
        initial=step,
        desc=f"{args.model}-{args.preset}",
        dynamic_ncols=True,
        disable=args.no_progress or not runtime.is_main,
    )
    while step < args.stop_at:
        lr = learning_rate(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        started = time.perf_counter()
        loss = train_step(model, optimizer, batches, step, args, runtime)  # .item() syncs the device
        seconds = time.perf_counter() - started
        step += 1
        history["train"].append([step, loss])
        if step - first_step > args.timing_warmup:
            timed_tokens, timed_seconds = timed_tokens + tokens_per_step, timed_seconds + seconds
        progress.set_postfix(
            {"loss": f"{loss:.3f}", "lr": f"{lr:.1e}", **speed(tokens_per_step / seconds)}, refresh=False
        )
        progress.update()
        if step % args.eval_every == 0 or step == args.stop_at:
            history["eval"].append([step, evaluate(model, eval_batches, args, runtime)])
            log(f"step {step:>6}  train loss {loss:.4f}  eval loss {history['eval'][-1][1]:.4f}")
        if not args.no_save and (step == args.stop_at or (args.save_every and step % args.save_every == 0)):
            save_checkpoint(args.out / "checkpoint.safetensors", model, optimizer, step, history, args, runtime)
    progress.close()
    return timed_tokens, timed_seconds


def main(argv: Optional[list[str]] = None) -> dict:
    """Train; return the summary (also written to <out>/summary.json)."""
    from tqdm import tqdm

    args, preset = parse_args(argv)
    runtime = init_runtime(args)
    if args.dtype is None:
        args.dtype = "bf16" if runtime.device.type == "cuda" else "fp32"
    data = TokenData.load(args.data)
    args.data_sha256 = data.meta["text_sha256"]
    world_batch = args.batch_size * args.grad_accum * runtime.world_size
    batches, eval_batches = make_batches(data, args, world_batch)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    with runtime.device:
        model = build_model(
            args.model, preset.model, vocab_size=data.meta["vocab_size"], seq_len=args.seq_len, reference=args.reference
        )
    parameters = sum(p.numel() for p in model.parameters())
    flops_per_token = model.flops_per_token(args.seq_len)
    model = parallelize(model, args, runtime)
    optimizer = make_optimizer(model, args, runtime.device)
    args.out.mkdir(parents=True, exist_ok=True)
    step, history = 0, {"train": [], "eval": []}
    if args.resume:
        step, history = load_checkpoint(args.out / "checkpoint.safetensors", model, optimizer, args, runtime)
    else:
        torch.manual_seed(args.seed + 1 + runtime.rank)  # dropout masks differ between ranks

    peak = peak_flops(args, runtime.device)

    def mfu(tokens_per_s: float) -> Optional[float]:
        return flops_per_token * tokens_per_s / (peak * runtime.world_size) if peak else None

    def speed(tokens_per_s: float) -> dict:
        shown = {"tok/s": f"{tokens_per_s:,.0f}"}
        return {**shown, "mfu": f"{mfu(tokens_per_s):.1%}"} if peak else shown

    title = f"{args.model} {args.preset} ({parameters / 1e6:.1f}M), {'reference' if args.reference else 'tk_ops'}"
    log = tqdm.write if runtime.is_main else (lambda _: None)
    parallel = f" {args.parallel}" if runtime.world_size > 1 else ""
    mode = "compiled" if args.compile else "eager"
    log(
        f"{title}: {runtime.world_size} x {runtime.device.type}{parallel}, {args.dtype}, {mode}; "
        f"{world_batch * args.seq_len} tokens/step ({world_batch} x {args.seq_len}), "
        f"steps {step}..{args.stop_at} of {args.steps}"
    )
    timed_tokens, timed_seconds = train_loop(
        model, optimizer, batches, eval_batches, step, history, args, runtime, speed
    )
    tokens_per_s = timed_tokens / timed_seconds if timed_seconds else None
    summary = {
        "model": args.model,
        "preset": args.preset,
        "path": "reference" if args.reference else "tk_ops",
        "compile": args.compile,
        "parameters": parameters,
        "config": json.loads(unwrap(model).config.to_json()),
        "device": torch.cuda.get_device_name(runtime.device) if runtime.device.type == "cuda" else "cpu",
        "world_size": runtime.world_size,
        "parallel": args.parallel if runtime.world_size > 1 else None,
        "dtype": args.dtype,
        "seq_len": args.seq_len,
        "global_batch": world_batch,
        "tokens_per_step": world_batch * args.seq_len,
        "steps": args.stop_at,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token,
        "peak_flops_per_device": peak,
        "mfu": mfu(tokens_per_s) if tokens_per_s else None,
        "max_memory_gib": torch.cuda.max_memory_allocated(runtime.device) / 2**30
        if runtime.device.type == "cuda"
        else None,
        "train_loss": history["train"],
        "eval_loss": history["eval"],
        "torch": torch.__version__,
    }
    if args.model != "bert" and args.sample_tokens > 0:
        summary["sample"] = sample_text(model, data, args, runtime)
    if runtime.is_main:
        plot_losses(history, args.out / "loss.png", title)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        timing = f"{tokens_per_s:,.0f} tokens/s" if tokens_per_s else "too few steps to time"
        if summary["mfu"]:
            timing += f", MFU {summary['mfu']:.1%}"
        log(
            f"done: step {args.stop_at}, train loss {history['train'][0][1]:.3f} -> {history['train'][-1][1]:.3f}, "
            f"eval loss {history['eval'][0][1]:.3f} -> {history['eval'][-1][1]:.3f}; {timing}; "
            f"plot {args.out / 'loss.png'}"
        )
        if "sample" in summary:
            log(f"sample: {summary['sample']!r}")
    if runtime.world_size > 1:
        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
