"""Where a training step's device time goes: a models.train run's steps under torch.profiler, by kernel.

    python -m benchmarks.profile_training [--warmup 8] [--steps 4] [--out DIR] -- MODELS.TRAIN ARGS
    e.g. python -m benchmarks.profile_training -- --model llama --preset 1b --compile
         python -m benchmarks.profile_training -- --model llama --preset 1b --compile --reference

The model, optimizer and batches are models.train's for the given arguments (same preset, seed and
data). After --warmup steps (compilation and autotuning included) it records --steps steps with
CUDA activity and sums each kernel's device time per step. Kernels fall into groups by name: tk_ops'
by the tile-core namespace they run in (``tk::attention``, ``tk::gemm``, ...), cuBLAS / cuDNN /
flash / Triton (Inductor's fused code) / the optimizer / other. Prints the groups and the top
kernels, and writes DIR/profile_training_<model>_<preset>_<path>.json (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re

import torch

from benchmarks.common import environment
from models.data import TokenData
from models.parallel import init_runtime, parallelize
from models.presets import build_model
from models.train import make_batches, make_optimizer, parse_args, train_step

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
TOP_KERNELS = 25
# (group, pattern on the kernel name), first match wins; tk_ops' kernels are grouped by namespace.
GROUPS = [
    ("optimizer", re.compile(r"multi_tensor|foreach|adam", re.I)),
    ("cuDNN", re.compile(r"cudnn|fmha|sdpa", re.I)),
    ("flash (FA2)", re.compile(r"flash", re.I)),
    ("cuBLAS", re.compile(r"gemm|nvjet|cublas|xmma|cutlass", re.I)),
    ("Triton (Inductor)", re.compile(r"^triton_|triton", re.I)),
]
TK_NAMESPACE = re.compile(r"tk::(?!pipeline::)(\w+)::")


def group_of(name: str) -> str:
    if match := TK_NAMESPACE.search(name):
        return f"tk::{match.group(1)}"
    return next((group for group, pattern in GROUPS if pattern.search(name)), "other")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    parser.add_argument("train_args", nargs="+", help="models.train arguments, after --")
    args = parser.parse_args(argv)
    config, preset = parse_args([*args.train_args, "--steps", str(args.warmup + args.steps)])
    runtime = init_runtime(config.device)
    data = TokenData.load(config.data)
    batches, _ = make_batches(data, config, config.batch_size * config.grad_accum)
    torch.manual_seed(config.seed)
    with runtime.device:
        model = build_model(config.model, preset.model, vocab_size=data.meta["vocab_size"],
                            seq_len=config.seq_len, reference=config.reference, peer=config.peer)  # fmt: skip
    model = parallelize(model, runtime, compile_blocks=config.compile, parallel=config.parallel,
                        fullgraph=not config.peer)  # fmt: skip
    optimizer = make_optimizer(model, config, runtime.device)
    for step in range(args.warmup):
        train_step(model, optimizer, batches, step, config, runtime)

    on_gpu = runtime.device.type == "cuda"  # on the CPU (the tests) the ops' own CPU time stands in
    activity = torch.profiler.ProfilerActivity.CUDA if on_gpu else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as profile:
        for step in range(args.warmup, args.warmup + args.steps):
            train_step(model, optimizer, batches, step, config, runtime)
    kernels = collections.defaultdict(float)  # name -> device us per step
    for event in profile.events():
        if on_gpu and event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += event.device_time / args.steps
        elif not on_gpu:
            kernels[event.name] += event.self_cpu_time_total / args.steps
    groups = collections.defaultdict(float)
    for name, us in kernels.items():
        groups[group_of(name)] += us
    total = sum(kernels.values())

    label = f"{config.model} {config.preset} {config.path}{' compiled' if config.compile else ''}"
    print(f"{label}: {total / 1e3:.1f} ms of {'kernels' if on_gpu else 'CPU ops'} per step ({args.steps} steps after {args.warmup})")
    for group, us in sorted(groups.items(), key=lambda item: -item[1]):
        print(f"  {group:<20} {us / 1e3:8.2f} ms  {us / max(total, 1e-9):6.1%}")
    top = sorted(kernels.items(), key=lambda item: -item[1])[:TOP_KERNELS]
    for name, us in top:
        print(f"  {us / 1e3:8.2f} ms  {group_of(name):<18} {name[:110]}")
    document = {
        **environment(),
        "run": label,
        "steps": args.steps,
        "warmup": args.warmup,
        "kernel_ms_per_step": total / 1e3,
        "groups_ms": {group: us / 1e3 for group, us in groups.items()},
        "top_kernels_ms": [[name, us / 1e3] for name, us in top],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"profile_training_{config.model}_{config.preset}_{config.path}.json"
    path.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
