"""What share of a training step the sequence mixers take, and the step harness of bench_long_context.

    python -m benchmarks.mixer_share [--models llama,based,mamba2,hyena] [--preset 1b] [--impl tk|reference|peer]
                                     [--seq-len N] [--batch-size B] [--steps 5] [--warmup 3] [--out DIR]

A step is models.train's ``train_step`` (forward, backward, gradient clipping at 1.0, AdamW) of a
freshly built preset model (models.presets' ``build_model``, seed 0) on uniform random tokens,
bf16 autocast on the GPU (fp32 on the CPU), eager: module hooks and compiled graphs do not mix.
The mixer is each block's sequence mixer with its projections (Llama: ``self_attn``; the others:
``mixer``, the full-attention blocks of the Based hybrid included). Its forward runs between a
forward pre-hook and a forward hook, its backward between a full backward pre-hook (the gradient of
its output is ready) and a full backward hook (the gradients of its input are computed); every
mark is a CUDA event on the current stream (on the CPU a clock reading), so nothing synchronises
inside the step and the times are the device's, queue gaps included.

Per model: ``step_ms`` (the mean of --steps steps without hooks, after --warmup), ``hooked_step_ms``
(the same steps again with the hooks: their overhead is the difference), ``mixer_forward_ms`` and
``mixer_backward_ms`` (summed over the blocks, per step), ``mixer_share`` = their sum over
hooked_step_ms, and the peak memory. ``--impl`` picks the path: tk (tk_ops), reference (plain
PyTorch) or peer (models/peers.py; for Llama and Hyena their reference path). Writes
DIR/mixer_share.json (default benchmarks/results), merged with the rows of other models, paths and
shapes (each row with the date, GPU and commit of its run).
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import time
import warnings
from typing import Callable, Optional

import torch

from benchmarks.common import RESULTS, describe_error, merged_rows, write_results
from models import train
from models.parallel import Runtime, parallelize
from models.peers import PEER_IS_REFERENCE, PEER_OPS
from models.presets import PRESETS, build_model
from tk_ops import _library

MODELS = ("llama", "based", "mamba2", "hyena")
IMPLS = ("tk", "reference", "peer")
VOCAB = 8192  # the prepared corpus's (the presets' parameter counts assume it)


def path_flags(model: str, impl: str) -> dict:
    """build_model's reference and peer flags for a path; the peer of Llama and Hyena is their reference path."""
    peer = impl == "peer" and model in PEER_OPS and model not in PEER_IS_REFERENCE
    return {"reference": impl != "tk", "peer": peer}


class SyntheticBatches:
    """Uniform random token windows, (inputs, targets) shifted by one, a function of (seed, step) as
    models.data.Batches' are: the same batches for every model and path."""

    def __init__(self, vocab_size: int, global_batch: int, seq_len: int, seed: int = 0) -> None:
        self.vocab_size, self.global_batch, self.seq_len, self.seed = vocab_size, global_batch, seq_len, seed

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        ids = torch.randint(self.vocab_size, (self.global_batch, self.seq_len + 1), generator=generator)
        return ids[:, :-1], ids[:, 1:]


class Setup:
    """A preset model on a path, its AdamW and the models.train config its train_step reads (the command
    line of a one-process run of the shape: bf16 autocast on the GPU, fp32 on the CPU, lr 1e-4)."""

    def __init__(self, model: str, impl: str, preset: str, seq_len: int, batch_size: int, device: torch.device,
                 compile: bool = False) -> None:  # fmt: skip
        self.device = device
        self.runtime = Runtime(rank=0, world_size=1, device=device)
        shape = PRESETS[model][preset].model  # an unknown preset: a KeyError, which measure_row records
        flags = path_flags(model, impl)
        path = ["--peer"] if flags["peer"] else ["--reference"] if flags["reference"] else []
        self.config, _ = train.parse_args(
            ["--model", model, "--preset", preset, "--seq-len", str(seq_len), "--batch-size", str(batch_size),
             "--lr", "1e-4", "--device", device.type, *path, *(["--compile"] if compile else [])]
        )  # fmt: skip
        torch.manual_seed(0)
        with device:
            self.model = build_model(model, shape, vocab_size=VOCAB, seq_len=seq_len, **flags)
        self.flops_per_token = self.model.flops_per_token(seq_len)
        self.mixers = [block.mixer if hasattr(block, "mixer") else block.self_attn for block in self.model.blocks]
        self.model = parallelize(
            self.model, self.runtime, compile_blocks=compile, parallel="ddp", fullgraph=not self.config.peer
        )
        self.optimizer = train.make_optimizer(self.model, self.config, device)
        self.batches = SyntheticBatches(VOCAB, batch_size, seq_len)
        self.step = 0

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run_steps(self, count: int) -> float:
        """Seconds per step over ``count`` steps (train_step ends on the loss's .item(): a sync)."""
        self.synchronize()
        started = time.perf_counter()
        for _ in range(count):
            train.train_step(self.model, self.optimizer, self.batches, self.step, self.config, self.runtime)
            self.step += 1
        return (time.perf_counter() - started) / count


class MixerTimer:
    """Marks around every mixer's forward and backward while enabled; ``milliseconds(phase)`` sums the
    intervals of a phase ("forward" or "backward") recorded so far."""

    def __init__(self, mixers: list[torch.nn.Module], device: torch.device) -> None:
        self.device = device
        self.enabled = False
        self.intervals: dict[str, list[list]] = {"forward": [], "backward": []}
        self.handles = []
        for mixer in mixers:
            self.handles += [
                mixer.register_forward_pre_hook(lambda module, args: self._start("forward")),
                mixer.register_forward_hook(lambda module, args, out: self._end("forward")),
                mixer.register_full_backward_pre_hook(lambda module, grad_out: self._start("backward")),
                mixer.register_full_backward_hook(lambda module, grad_in, grad_out: self._end("backward")),
            ]

    def _mark(self):
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _start(self, phase: str) -> None:
        if self.enabled:
            self.intervals[phase].append([self._mark(), None])

    def _end(self, phase: str) -> None:
        if self.enabled:
            self.intervals[phase][-1][1] = self._mark()

    def milliseconds(self, phase: str) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return sum(start.elapsed_time(end) for start, end in self.intervals[phase])
        return sum(end - start for start, end in self.intervals[phase]) * 1e3

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def reference_fallbacks(run: Callable[[], object]) -> tuple[object, list[str]]:
    """``run()``'s result and the tk ops that ran their PyTorch reference on the GPU during it (tk_ops
    warns once per op and process: the record of earlier warnings is cleared first)."""
    _library._REFERENCE_WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run()
    prefix = "tk_ops: tk."
    ops = {str(w.message)[len(prefix) :].split(" ")[0] for w in caught if str(w.message).startswith(prefix)}
    return result, sorted(ops)


def measure(model: str, impl: str, preset: str, seq_len: int, batch_size: int, device: torch.device, *,
            warmup: int, steps: int, compile: bool = False, mixer_share: bool = False) -> dict:  # fmt: skip
    """One shape's row: step time, tokens/s, model TFLOP/s, peak memory, the tk ops that fell back to
    their reference, and with ``mixer_share`` the mixers' times over a second round of steps."""
    if compile and mixer_share:
        raise ValueError("the mixer timer's hooks need the eager model: no compile with the mixer share")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    setup = Setup(model, impl, preset, seq_len, batch_size, device, compile=compile)
    _, fallbacks = reference_fallbacks(lambda: setup.run_steps(warmup))
    step_s = setup.run_steps(steps)
    tokens = batch_size * seq_len
    row = {
        "step_ms": round(step_s * 1e3, 3),
        "tokens_per_s": round(tokens / step_s, 1),
        "model_tflops": round(setup.flops_per_token * tokens / step_s / 1e12, 2),
        "parameters": sum(p.numel() for p in setup.model.parameters()),
        "fallbacks": fallbacks,
    }
    if mixer_share:
        timer = MixerTimer(setup.mixers, device)
        timer.enabled = True
        hooked_s = setup.run_steps(steps)
        forward, backward = (timer.milliseconds(phase) / steps for phase in ("forward", "backward"))
        timer.remove()
        row.update(
            hooked_step_ms=round(hooked_s * 1e3, 3), mixer_forward_ms=round(forward, 3),
            mixer_backward_ms=round(backward, 3), mixer_share=round((forward + backward) / (hooked_s * 1e3), 4),
        )  # fmt: skip
    if device.type == "cuda":
        row["max_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return row


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_row(key: dict, device: torch.device, **options) -> dict:
    """``key`` (model, impl, preset, seq_len, batch_size) with measure's fields, or with ``error``:
    "out of memory" for a step that ran out of device memory, else the failure in one line."""
    arguments = {name: key[name] for name in ("model", "impl", "preset", "seq_len", "batch_size")}
    try:
        row = {**key, **measure(**arguments, device=device, **options)}
    except torch.OutOfMemoryError:
        row = {**key, "error": "out of memory"}
    except Exception as error:  # a peer that does not import, a size a path refuses: the row says so
        row = {**key, "error": describe_error(error)}
    free_memory(device)  # after the except blocks, which held the failed step's frames
    return row


def main(argv: Optional[list[str]] = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", action="append", help=f"comma-separated subset of {', '.join(MODELS)}, repeatable (default: all)"
    )
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--impl", choices=IMPLS, default="tk")
    parser.add_argument("--seq-len", type=int, help="default: the preset's")
    parser.add_argument("--batch-size", type=int, help="default: the preset's")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help="directory for mixer_share.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    for model in [m for m in ",".join(args.models or MODELS).split(",") if m]:
        preset = PRESETS[model][args.preset]
        key = {
            "model": model, "impl": args.impl, "preset": args.preset, "seq_len": args.seq_len or preset.seq_len,
            "batch_size": args.batch_size or preset.batch_size,
        }  # fmt: skip
        row = measure_row(key, device, warmup=args.warmup, steps=args.steps, mixer_share=True)
        rows.append(row)
        share = f"mixer share {row['mixer_share']:.1%}" if "mixer_share" in row else row["error"]
        print(f"{model:>7} {args.impl:>9} N={key['seq_len']:>6} B={key['batch_size']:>3}: {share}", flush=True)
    all_rows = merged_rows("mixer_share", rows, [args.out], ("model", "impl", "preset", "seq_len", "batch_size"))
    write_results("mixer_share", all_rows, [args.out])
    print(f"wrote {args.out / 'mixer_share.json'}")
    return rows


if __name__ == "__main__":
    main()
