"""Train a model of models/ (Llama, BERT, Based, Mamba-2, Hyena, the Gated DeltaNet hybrid) on the
prepared corpus (``python -m models.data prepare``).

    python -m models.train --model llama --preset tiny                # CPU, a few minutes
    python -m models.train --model llama --preset tiny --pack         # attention within each document
    python -m models.train --model bert --preset tiny
    python -m models.train --model based --preset tiny                # also mamba2, hyena, gdn
    python -m models.train --model llama --preset 1b --compile        # one H100
    python -m models.train --model llama --preset 1b --compile --reference
    python -m models.train --model based --preset 1b --compile --peer   # on fla's parallel_based
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
interrupted job). ``--reference`` trains the pure-PyTorch path of the same model; ``--peer`` (Based,
Mamba-2, Hyena) the reference path with the mixer's op from its peer library (``models.peers``);
``--compile`` compiles each block with ``torch.compile(fullgraph=True)`` (before FSDP sharding; without
fullgraph under ``--peer``, whose Triton wrappers may break the graph).

``--pack`` (Llama): the rows are the same windows of the concatenated corpus, but each token attends
only to the tokens before it in its own document (a chapter of the KJV: ``models.data``) and its RoPE
position counts from the document's first token, or from the row's first token for a document that
began in an earlier row. The tk path runs ``tk_ops.attention_varlen`` over the rows' documents, the
reference path SDPA with the block-diagonal causal mask. Every token is a real token, so the loss
counts every target as without ``--pack`` (the last token of a document predicts the first of the next).

MFU counts the matmul FLOPs (6 x matmul parameters per token, the output layer included) plus
each model's sequence mixing (attention scores, linear attention, SSD, FFT convolution, the delta rule: the
model's ``flops_per_token``), against the dense bf16 peak of the GPU (``--peak-tflops`` to set it; on
CPU it is shown only when set).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from models.checkpoint import load_checkpoint, save_checkpoint
from models.data import DEFAULT_DATA_DIR, IGNORE_INDEX, REPO_ROOT, Batches, TokenData
from models.layers import PackedDocuments
from models.parallel import Runtime, gradient_sync, init_runtime, parallelize, unwrap
from models.peers import PEER_OPS
from models.presets import PRESETS, Preset, build_model

MIN_LR_FRACTION = 0.1
# dense bf16 tensor-core peaks, FLOP/s per GPU (matched against the device name in this order)
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("H800", 989e12), ("A100", 312e12))
# flags whose default is the preset's value of the same name
PRESET_DEFAULTS = ("seq_len", "batch_size", "steps", "lr", "warmup", "eval_every")
# models whose forward takes documents=PackedDocuments (--pack)
PACKED_MODELS = ("llama",)


# ------------------------------------------------------------------------------------ config


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One run's settings: the command line with every default resolved (built once, by parse_args)."""

    model: str
    preset: str
    data: Path
    out: Path
    steps: int  # length of the learning-rate schedule
    stop_at: int  # the last step this run trains (<= steps)
    seq_len: int
    batch_size: int  # rows per rank and micro-step
    grad_accum: int
    lr: float
    warmup: int
    weight_decay: float
    eval_every: int
    eval_batches: int
    save_every: int
    no_save: bool
    resume: bool
    reference: bool
    peer: bool  # the reference model with the mixer's peer op (models.peers); build_model sets reference
    compile: bool
    parallel: str
    device: str  # "cuda" or "cpu"
    dtype: str  # "bf16" (autocast) or "fp32"
    seed: int
    peak_tflops: Optional[float]
    timing_warmup: int
    sample_tokens: int
    no_progress: bool
    pack: bool  # attention within each document (models.data's boundaries)

    @property
    def path(self) -> str:
        return implementation_path(reference=self.reference, peer=self.peer)


def implementation_path(*, reference: bool, peer: bool) -> str:
    """Which implementation trains: "tk_ops", "reference" or "peer" (the summary's path, the run
    directory's suffix)."""
    return "peer" if peer else "reference" if reference else "tk_ops"


def parse_args(argv: Optional[list[str]] = None) -> tuple[TrainConfig, Preset]:
    """The run's config and the preset it was built on."""
    parser = argparse.ArgumentParser(
        prog="python -m models.train",
        description="\n\n".join(__doc__.split("\n\n")[:2]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", choices=sorted(PRESETS), required=True)
    parser.add_argument(
        "--preset",
        default="tiny",
        help="nano (tests) | tiny (CPU demo) | small | base | 1b (not bert): see models/presets.py",
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR, help="prepared data directory")
    parser.add_argument("--out", type=Path, help="run directory (default runs/<model>-<preset>[-reference|-peer])")
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
    parser.add_argument(
        "--peer", action="store_true", help=f"{', '.join(PEER_OPS)}: the reference path with the mixer's peer op"
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile each block (fullgraph but under --peer)")
    parser.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp", help="under torchrun")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), help="autocast dtype (default bf16 on GPU, fp32 on CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peak-tflops", type=float, help="peak of one device for MFU")
    parser.add_argument("--timing-warmup", type=int, default=3, help="steps left out of the tokens/s average")
    parser.add_argument("--sample-tokens", type=int, default=48, help="causal models: sample this many tokens at the end")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--pack", action="store_true", help="llama: attend only within each document of a row (cu_seqlens)"
    )
    args = parser.parse_args(argv)
    if args.preset not in PRESETS[args.model]:
        parser.error(f"--preset for {args.model} must be one of {sorted(PRESETS[args.model])}, got {args.preset!r}")
    if args.peer and args.model not in PEER_OPS:
        parser.error(f"--peer is for {', '.join(PEER_OPS)}; {args.model}'s peer layers are its --reference path")
    if args.pack and args.model not in PACKED_MODELS:
        parser.error(f"--pack is implemented for {', '.join(PACKED_MODELS)}, not {args.model}")
    preset = PRESETS[args.model][args.preset]
    fields = vars(args) | {name: getattr(preset, name) for name in PRESET_DEFAULTS if getattr(args, name) is None}
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    path = implementation_path(reference=args.reference, peer=args.peer)
    resolved = {
        "stop_at": min(args.stop_at or fields["steps"], fields["steps"]),
        "out": args.out or REPO_ROOT / "runs" / f"{args.model}-{args.preset}{'-pack' if args.pack else ''}"
        f"{'' if path == 'tk_ops' else '-' + path}",
        "device": device,
        "dtype": args.dtype or ("bf16" if device == "cuda" else "fp32"),
    }
    return TrainConfig(**(fields | resolved)), preset


# ------------------------------------------------------------------------ optimizer, schedule


def make_optimizer(model: torch.nn.Module, config: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": config.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warmup over config.warmup steps, then cosine decay to MIN_LR_FRACTION x config.lr."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * (MIN_LR_FRACTION + (1.0 - MIN_LR_FRACTION) * cosine)


def peak_flops(config: TrainConfig, device: torch.device) -> Optional[float]:
    """Peak FLOP/s of one device: --peak-tflops, else the bf16 peak of a known GPU, else None."""
    if config.peak_tflops:
        return config.peak_tflops * 1e12
    if device.type != "cuda" or config.dtype != "bf16":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)


# ------------------------------------------------------------------------------ train, eval


def autocast(config: TrainConfig, device: torch.device):
    if config.dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _shares(targets: torch.Tensor, parts: list[slice]) -> list[float]:
    """Each part's share of the targets (labels other than -100) of the global batch."""
    counted = targets != IGNORE_INDEX
    total = counted.sum().item()
    return [counted[part].sum().item() / total for part in parts]


def packing(batches: Batches, step: int, config: TrainConfig) -> Callable[[slice, torch.device], dict]:
    """The model's extra arguments for some rows of the global batch of ``step``: documents=... under --pack."""
    if not config.pack:
        return lambda part, device: {}
    positions = batches.positions_at(step)
    return lambda part, device: {"documents": PackedDocuments.from_positions(positions[part]).to(device)}


def train_step(model, optimizer, batches: Batches, step: int, config: TrainConfig, runtime: Runtime) -> float:
    """One optimizer step on the global batch of ``step``; returns its loss (mean over all targets)."""
    inputs, targets = batches.global_batch_at(step)
    packed = packing(batches, step, config)
    first = runtime.rank * config.batch_size * config.grad_accum
    rows = config.batch_size
    parts = [slice(first + i * rows, first + (i + 1) * rows) for i in range(config.grad_accum)]
    # Each micro-batch loss is a mean over its targets; weighting it by its share of all the
    # targets of the global batch (x ranks, which DDP/FSDP average over) gives the global mean.
    total = torch.zeros((), device=runtime.device)
    for micro, (part, share) in enumerate(zip(parts, _shares(targets, parts))):
        x, y = inputs[part].to(runtime.device), targets[part].to(runtime.device)
        with gradient_sync(model, micro == config.grad_accum - 1):
            with autocast(config, runtime.device):
                loss = model(x, y, **packed(part, runtime.device)) * share
            (loss * runtime.world_size).backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if runtime.world_size > 1:
        dist.all_reduce(total)
    return total.item()


@torch.no_grad()
def evaluate(model, batches: Batches, config: TrainConfig, runtime: Runtime) -> float:
    """The loss over the first ``config.eval_batches`` global batches of ``batches`` (in order), each
    rank taking its rows in micro-batches of ``config.batch_size``."""
    model.eval()
    steps = min(config.eval_batches, batches.steps_per_epoch)
    rows = batches.global_batch // runtime.world_size
    first = runtime.rank * rows
    parts = [
        slice(start, min(start + config.batch_size, first + rows))
        for start in range(first, first + rows, config.batch_size)
    ]
    total = torch.zeros((), device=runtime.device)
    for step in range(steps):
        inputs, targets = batches.global_batch_at(step)
        packed = packing(batches, step, config)
        for part, share in zip(parts, _shares(targets, parts)):
            with autocast(config, runtime.device):
                loss = model(
                    inputs[part].to(runtime.device), targets[part].to(runtime.device), **packed(part, runtime.device)
                )
            total += loss.float() * share / steps
    if runtime.world_size > 1:
        dist.all_reduce(total)
    model.train()
    return total.item()


def sample_text(model, data: TokenData, config: TrainConfig, runtime: Runtime, prompt: str = "And God said") -> str:
    """A short continuation of ``prompt`` (causal models), sampled identically on every rank."""
    tokenizer = data.tokenizer()
    ids = torch.tensor([tokenizer.encode(prompt)], device=runtime.device)
    generator = torch.Generator(device=runtime.device).manual_seed(config.seed)
    # compiled blocks would recompile for every new length: sample eagerly
    with torch.compiler.set_stance("force_eager"), autocast(config, runtime.device):
        model.eval()
        out = unwrap(model).generate(ids, config.sample_tokens, temperature=0.8, top_k=40, generator=generator)
        model.train()
    return tokenizer.decode(out[0].tolist())


def make_batches(data: TokenData, config: TrainConfig, world_batch: int) -> tuple[Batches, Batches]:
    """(train, eval) batches: shuffled training windows, the first validation windows in order."""
    if config.pack and data.train_documents is None:
        raise SystemExit(
            f"--pack needs the document starts that `python -m models.data prepare` records; {data.directory} "
            "was prepared without them: prepare it again"
        )
    common = dict(
        kind="mlm" if config.model == "bert" else "lm",
        seq_len=config.seq_len,
        global_batch=world_batch,
        seed=config.seed,
        vocab_size=data.meta["vocab_size"],
        mask_id=data.meta["mask_token_id"],
    )
    train_documents, val_documents = (data.train_documents, data.val_documents) if config.pack else (None, None)
    return (
        Batches(data.train, **common, document_starts=train_documents),
        Batches(data.val, **common, shuffle=False, document_starts=val_documents),
    )


def train_loop(
    model,
    optimizer,
    batches: Batches,
    eval_batches: Batches,
    step: int,
    history: dict,
    config: TrainConfig,
    runtime: Runtime,
    speed: Callable[[float], dict],
    save: Callable[[int], None],
) -> tuple[int, float]:
    """Steps ``step`` .. ``config.stop_at``, appending to history; returns (tokens, seconds) of the
    timed steps (all but the first ``config.timing_warmup``). ``speed(tokens_per_s)`` -> progress
    postfix; ``save(step)`` writes the checkpoint."""
    from tqdm import tqdm

    log = tqdm.write if runtime.is_main else (lambda _: None)
    if step == 0 and not history["eval"]:
        history["eval"].append([0, evaluate(model, eval_batches, config, runtime)])
        log(f"step {0:>6}  eval loss {history['eval'][-1][1]:.4f}")
    tokens_per_step = batches.global_batch * config.seq_len
    timed_tokens, timed_seconds, first_step = 0, 0.0, step
    progress = tqdm(
        total=config.stop_at,
        initial=step,
        desc=f"{config.model}-{config.preset}",
        dynamic_ncols=True,
        disable=config.no_progress or not runtime.is_main,
    )
    while step < config.stop_at:
        lr = learning_rate(step, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        started = time.perf_counter()
        loss = train_step(model, optimizer, batches, step, config, runtime)  # .item() syncs the device
        seconds = time.perf_counter() - started
        step += 1
        history["train"].append([step, loss])
        if step - first_step > config.timing_warmup:
            timed_tokens, timed_seconds = timed_tokens + tokens_per_step, timed_seconds + seconds
        progress.set_postfix(
            {"loss": f"{loss:.3f}", "lr": f"{lr:.1e}", **speed(tokens_per_step / seconds)}, refresh=False
        )
        progress.update()
        if step % config.eval_every == 0 or step == config.stop_at:
            history["eval"].append([step, evaluate(model, eval_batches, config, runtime)])
            log(f"step {step:>6}  train loss {loss:.4f}  eval loss {history['eval'][-1][1]:.4f}")
        if not config.no_save and (step == config.stop_at or (config.save_every and step % config.save_every == 0)):
            save(step)
    progress.close()
    return timed_tokens, timed_seconds


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


def main(argv: Optional[list[str]] = None) -> dict:
    """Train; return the summary (also written to <out>/summary.json)."""
    from tqdm import tqdm

    config, preset = parse_args(argv)
    runtime = init_runtime(config.device)
    data = TokenData.load(config.data)
    text_sha256 = data.meta["text_sha256"]
    world_batch = config.batch_size * config.grad_accum * runtime.world_size
    batches, eval_batches = make_batches(data, config, world_batch)

    torch.manual_seed(config.seed)  # the same initial weights on every rank
    with runtime.device:
        model = build_model(
            config.model,
            preset.model,
            vocab_size=data.meta["vocab_size"],
            seq_len=config.seq_len,
            reference=config.reference,
            peer=config.peer,
        )
    parameters = sum(p.numel() for p in model.parameters())
    flops_per_token = model.flops_per_token(config.seq_len)
    model = parallelize(
        model, runtime, compile_blocks=config.compile, parallel=config.parallel, fullgraph=not config.peer
    )
    optimizer = make_optimizer(model, config, runtime.device)
    config.out.mkdir(parents=True, exist_ok=True)
    checkpoint_path = config.out / "checkpoint.safetensors"
    step, history = 0, {"train": [], "eval": []}
    if config.resume:
        step, history = load_checkpoint(
            checkpoint_path, model, optimizer, runtime, seed=config.seed, text_sha256=text_sha256
        )
    else:
        torch.manual_seed(config.seed + 1 + runtime.rank)  # dropout masks differ between ranks

    def save(step: int) -> None:
        save_checkpoint(
            checkpoint_path,
            model,
            optimizer,
            runtime,
            step=step,
            history=history,
            kind=config.model,
            seed=config.seed,
            text_sha256=text_sha256,
        )

    peak = peak_flops(config, runtime.device)

    def mfu(tokens_per_s: float) -> Optional[float]:
        return flops_per_token * tokens_per_s / (peak * runtime.world_size) if peak else None

    def speed(tokens_per_s: float) -> dict:
        shown = {"tok/s": f"{tokens_per_s:,.0f}"}
        return {**shown, "mfu": f"{mfu(tokens_per_s):.1%}"} if peak else shown

    title = f"{config.model} {config.preset} ({parameters / 1e6:.1f}M), {config.path}"
    log = tqdm.write if runtime.is_main else (lambda _: None)
    parallel = f" {config.parallel}" if runtime.world_size > 1 else ""
    mode = ("compiled" if config.compile else "eager") + (", packed documents" if config.pack else "")
    log(
        f"{title}: {runtime.world_size} x {runtime.device.type}{parallel}, {config.dtype}, {mode}; "
        f"{world_batch * config.seq_len} tokens/step ({world_batch} x {config.seq_len}), "
        f"steps {step}..{config.stop_at} of {config.steps}"
    )
    timed_tokens, timed_seconds = train_loop(
        model, optimizer, batches, eval_batches, step, history, config, runtime, speed, save
    )
    tokens_per_s = timed_tokens / timed_seconds if timed_seconds else None
    summary = {
        "model": config.model,
        "preset": config.preset,
        "path": config.path,
        "compile": config.compile,
        "pack": config.pack,
        "parameters": parameters,
        "config": json.loads(unwrap(model).config.to_json()),
        "device": torch.cuda.get_device_name(runtime.device) if runtime.device.type == "cuda" else "cpu",
        "world_size": runtime.world_size,
        "parallel": config.parallel if runtime.world_size > 1 else None,
        "dtype": config.dtype,
        "seq_len": config.seq_len,
        "global_batch": world_batch,
        "tokens_per_step": world_batch * config.seq_len,
        "steps": config.stop_at,
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
    if config.model != "bert" and config.sample_tokens > 0:
        summary["sample"] = sample_text(model, data, config, runtime)
    if runtime.is_main:
        plot_losses(history, config.out / "loss.png", title)
        (config.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        timing = f"{tokens_per_s:,.0f} tokens/s" if tokens_per_s else "too few steps to time"
        if summary["mfu"]:
            timing += f", MFU {summary['mfu']:.1%}"
        log(
            f"done: step {config.stop_at}, train loss {history['train'][0][1]:.3f} -> {history['train'][-1][1]:.3f}, "
            f"eval loss {history['eval'][0][1]:.3f} -> {history['eval'][-1][1]:.3f}; {timing}; "
            f"plot {config.out / 'loss.png'}"
        )
        if "sample" in summary:
            log(f"sample: {summary['sample']!r}")
    if runtime.world_size > 1:
        # Tear the group down together, after rank 0's plot and summary: a rank that tore down gloo
        # alone while the other was still in its last work aborted once on the CPU ("terminate called
        # without an active exception", 1 run in 7 of the 2-process Based test).
        dist.barrier()
        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
