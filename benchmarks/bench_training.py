"""Training throughput of the model presets: tk_ops vs the pure-PyTorch reference path vs the peers, eager and compiled.

    python -m benchmarks.bench_training [--steps 100] [--variants tk-compile,reference-compile] [--out DIR]
    python -m benchmarks.bench_training --models based,mamba2,hyena [--preset 1b] [--steps 60]
    python -m benchmarks.bench_training --multi-gpu [--steps 30] [--out DIR]     # on a machine of 2 GPUs

Each variant is one ``python -m models.train --model M --preset P`` run in its own process (fresh
memory and compile caches) for the same number of steps from the same initial weights on the
same batches (bf16 autocast, AdamW, no checkpoint). The variants: tk-eager and tk-compile (tk_ops),
reference-eager and reference-compile (``--reference``, plain PyTorch), and for the models whose
peers are other libraries (Based: fla, Mamba-2: mamba_ssm; models/peers.py) peer-eager and
peer-compile (``--peer``: the reference model with the mixer's op from its peer). Llama's and
Hyena's peer layers are their reference path (SDPA, torch.fft). ``--models`` (default llama) and
``--preset`` (default 1b) pick the runs: every variant of each model, or those of ``--variants``.

From each run's summary.json it keeps tokens/s and MFU (averaged over the steps after the first
three, which include compilation and autotuning), peak memory and the loss curves; a run that fails
(out of memory, a peer that does not import) leaves a row with its error (the last exception line it
wrote to stderr, or its last line). It writes DIR/training.json, one row per (model, preset, variant) with the run's date, GPU
and commit, merged with the rows already there (those of a model and preset run again are kept only
at the same --steps), and per model and preset: ``speedup``, tk-compile over reference-compile
tokens/s; ``speedup_eager``; ``speedup_vs_peer`` and ``speedup_vs_peer_eager`` against the peer
variants where they exist; ``loss_gap``, the largest difference between the variants' train losses,
each averaged over the last quarter of the steps (curves that agree within noise give a gap of a
few 0.01 nats). DIR/training.png has, per model and preset, the loss curves and the tokens/s.

``--multi-gpu`` runs the data-parallel variants instead and writes multi_gpu.json / .png: one GPU
with ``--grad-accum 2`` against two GPUs under torchrun (NCCL) with DDP and with FSDP2, which see
the same batches, so their per-step losses should agree to rounding (``max_step_gap``).

Needs the prepared data (``python -m models.data prepare``, carried as ``.data/``), a GPU, and for
the peer variants the carried peer packages (``.baselines``, see gpu_session.sh). On a CPU the same
runs go through (fp32, no MFU), which the tests use with the nano presets.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time
from typing import Optional

from benchmarks.common import RESULTS, environment
from models.peers import PEER_IS_REFERENCE, PEER_OPS, versions

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS = ("llama", "based", "mamba2", "hyena")
VARIANTS = {
    "tk-eager": [],
    "tk-compile": ["--compile"],
    "reference-eager": ["--reference"],
    "reference-compile": ["--reference", "--compile"],
    "peer-eager": ["--peer"],
    "peer-compile": ["--peer", "--compile"],
}
# The same global batch on one GPU (two micro-steps) and on two (one each, under torchrun).
MULTI_GPU_VARIANTS = {
    "tk-1gpu-accum2": ["--grad-accum", "2"],
    "tk-ddp-2gpu": ["--parallel", "ddp"],
    "tk-fsdp-2gpu": ["--parallel", "fsdp"],
}
DATA_PARALLEL_PROCESSES = 2
PATH_COLORS = {"tk_ops": "tab:orange", "reference": "tab:gray", "peer": "tab:blue"}


def has_peer_variants(model: str) -> bool:
    """Whether the model's peer layers differ from its reference path (and so get runs of their own)."""
    return model in PEER_OPS and model not in PEER_IS_REFERENCE


def peer_name(model: str) -> str:
    return PEER_OPS.get(model, "SDPA (the reference path)")


def variants_of(model: str, wanted: list[str]) -> list[str]:
    return [name for name in wanted if not name.startswith("peer-") or has_peer_variants(model)]


def launcher(train_args: list[str]) -> list[str]:
    """The interpreter, under torchrun when the run is data-parallel."""
    if "--parallel" in train_args:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={DATA_PARALLEL_PROCESSES}"]
    return [sys.executable]


# A traceback's closing line: "module.Name: message" for an exception class named ...Error, ...Exception
# or ...Unavailable (compiler errors end with source lines and a caret after it).
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Unavailable)\b")


def failure_line(stderr: str) -> str:
    """The line of a failed run's stderr that names what failed."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    exceptions = [line for line in lines if EXCEPTION_LINE.match(line)]
    return (exceptions or lines or [""])[-1]


def run_variant(model: str, name: str, args, run: dict) -> dict:
    """One models.train run; its row (with ``error`` and no timings when it failed)."""
    out = REPO_ROOT / "runs" / f"bench-training-{model}-{args.preset}-{name}"
    variant_args = {**VARIANTS, **MULTI_GPU_VARIANTS}[name]
    command = [
        *launcher(variant_args), "-m", "models.train", "--model", model, "--preset", args.preset,
        "--steps", str(args.steps), "--warmup", str(max(1, args.steps // 10)), "--eval-every", str(args.steps),
        "--data", str(args.data), "--out", str(out), "--no-save", "--no-progress", "--sample-tokens", "0",
        *variant_args, *args.train_args,
    ]  # fmt: skip
    print(f"[{model} {name}] {' '.join(command)}", flush=True)
    (out / "summary.json").unlink(missing_ok=True)
    started = time.perf_counter()
    # mamba_ssm's Triton autotuning, kept on disk for the next process (as bench_mamba2 does)
    env = {**os.environ, "TRITON_CACHE_AUTOTUNING": "1"}
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, text=True)
    sys.stderr.write(result.stderr)
    row = {
        "model": model, "preset": args.preset, "variant": name,
        "path": "peer" if "--peer" in variant_args else "reference" if "--reference" in variant_args else "tk_ops",
        "compile": "--compile" in variant_args, "tokens_per_s": None, "mfu": None, "max_memory_gib": None,
        "wall_s": round(time.perf_counter() - started, 1), "parameters": None, "tokens_per_step": None,
        "train_loss": [], "eval_loss": [], "command": " ".join(command[1:]), "steps": args.steps, **run,
    }  # fmt: skip
    if result.returncode != 0:
        return {**row, "error": failure_line(result.stderr) or f"exit status {result.returncode}"}
    summary = json.loads((out / "summary.json").read_text())
    return {
        **row,
        "tokens_per_s": summary["tokens_per_s"],
        "mfu": summary["mfu"],
        "max_memory_gib": summary["max_memory_gib"],
        "parameters": summary["parameters"],
        "tokens_per_step": summary["tokens_per_step"],
        "train_loss": [round(loss, 5) for _, loss in summary["train_loss"]],  # after steps 1, 2, ...
        "eval_loss": summary["eval_loss"],  # [step, loss]
    }


def tail_mean(row: dict) -> float:
    losses = row["train_loss"]
    tail = losses[-max(1, len(losses) // 4) :]
    return sum(tail) / len(tail)


def comparisons(rows: list[dict]) -> dict:
    """The ratios and the loss gap of the rows of one model and preset (failed runs left out)."""
    by_name = {row["variant"]: row for row in rows if row["tokens_per_s"]}
    pairs = {
        "speedup": ("tk-compile", "reference-compile"),
        "speedup_eager": ("tk-eager", "reference-eager"),
        "speedup_vs_peer": ("tk-compile", "peer-compile"),
        "speedup_vs_peer_eager": ("tk-eager", "peer-eager"),
    }
    result = {
        key: round(by_name[ours]["tokens_per_s"] / by_name[theirs]["tokens_per_s"], 3)
        for key, (ours, theirs) in pairs.items()
        if {ours, theirs} <= by_name.keys()
    }
    finished = [row for row in rows if row["train_loss"]]
    if len(finished) > 1 and all(row["variant"] in MULTI_GPU_VARIANTS for row in finished):
        steps = zip(*(row["train_loss"] for row in finished))
        result["max_step_gap"] = round(max(max(losses) - min(losses) for losses in steps), 4)
    tails = [tail_mean(row) for row in finished]
    if len(tails) > 1:
        result["loss_gap"] = round(max(tails) - min(tails), 4)
    return result


def group_key(row: dict) -> tuple[str, str]:
    return row["model"], row["preset"]


def groups(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    found: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        found.setdefault(group_key(row), []).append(row)
    return found


def group_summary(key: tuple[str, str], rows: list[dict]) -> dict:
    done = next((row for row in rows if row["parameters"]), rows[0])
    return {
        "model": key[0], "preset": key[1], "parameters": done["parameters"],
        "tokens_per_step": done["tokens_per_step"], "steps": rows[0]["steps"], "peer": peer_name(key[0]),
        **comparisons(rows),
    }  # fmt: skip


def previous_rows(path: pathlib.Path) -> list[dict]:
    """The rows of an earlier results file; rows written before the file held several models get the
    model, preset, date, GPU and commit of that file's header."""
    if not path.exists():
        return []
    document = json.loads(path.read_text())
    model, _, preset = (document.get("model") or "llama 1b").partition(" ")
    run = {"date": document.get("date"), "gpu": document.get("gpu"), "commit": document.get("commit")}
    return [{"model": model, "preset": preset, **run, **row} for row in document.get("rows", [])]


def merged(previous: list[dict], new_rows: list[dict], order: list[str]) -> list[dict]:
    """The new rows, and the previous ones they do not replace: every row of another model or preset,
    and those of the models and presets run now that have the same steps and another variant."""
    replaced = {(*group_key(row), row["variant"]) for row in new_rows}
    steps = {group_key(row): row["steps"] for row in new_rows}
    kept = [
        row for row in previous
        if (*group_key(row), row["variant"]) not in replaced and steps.get(group_key(row), row["steps"]) == row["steps"]
    ]  # fmt: skip
    def position(row: dict) -> tuple:
        model, variant = row["model"], row["variant"]
        return (
            MODELS.index(model) if model in MODELS else len(MODELS), model, row["preset"],
            order.index(variant) if variant in order else len(order), variant,
        )  # fmt: skip

    return sorted(kept + new_rows, key=position)


def plot(rows: list[dict], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = groups(rows)
    fig, axes = plt.subplots(
        len(found), 2, figsize=(12, 4.5 * len(found)), gridspec_kw={"width_ratios": [3, 2]}, squeeze=False
    )
    for (curves, bars), (key, group) in zip(axes, found.items()):
        summary = group_summary(key, group)
        for row in group:
            if row["train_loss"]:
                curves.plot(range(1, len(row["train_loss"]) + 1), row["train_loss"], lw=1.2, label=row["variant"])
        curves.set_xlabel("step")
        curves.set_ylabel("train loss (nats / token)")
        parameters = summary["parameters"] or 0
        size = f" ({parameters / 1e9:.2f}B)" if parameters >= 1e9 else f" ({parameters / 1e6:.1f}M)"
        size = size if parameters else ""
        devices = ", ".join(sorted({row["gpu"] or "CPU" for row in group}))
        curves.set_title(
            f"{key[0]} {key[1]}{size}, {summary['tokens_per_step']} tokens/step, {summary['steps']} steps, {devices}\n"
            f"peer: {summary['peer']}",
            fontsize=10,
        )
        curves.grid(alpha=0.3)
        if any(row["train_loss"] for row in group):
            curves.legend()
        speeds = [(row["tokens_per_s"] or 0) / 1e3 for row in group]
        drawn = bars.bar([row["variant"] for row in group], speeds, color=[PATH_COLORS[row["path"]] for row in group])
        for bar, row in zip(drawn, group):
            if row["tokens_per_s"]:
                label = f"{row['tokens_per_s'] / 1e3:.1f}k" + (f"\nMFU {row['mfu']:.0%}" if row["mfu"] else "")
            else:
                label = "failed" if "error" in row else "not timed"
            bars.annotate(
                label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8
            )
        bars.set_ylabel("thousand tokens / s")
        bars.set_title("throughput")
        bars.tick_params(axis="x", labelrotation=20)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument(
        "--models", action="append", help=f"comma-separated subset of {', '.join(MODELS)}, repeatable (default llama)"
    )
    parser.add_argument("--preset", default="1b", help="the models.train preset of every model run")
    parser.add_argument(
        "--variants", action="append",
        help=f"comma-separated subset of {', '.join(VARIANTS)}, repeatable (default: all of a model's; peer-* only "
        "where the peer is not the reference path)",
    )  # fmt: skip
    parser.add_argument(
        "--multi-gpu", action="store_true", help=f"run {', '.join(MULTI_GPU_VARIANTS)} instead (2 GPUs)"
    )
    parser.add_argument("--data", type=pathlib.Path, default=REPO_ROOT / ".data" / "kjv")
    parser.add_argument(
        "--out", type=pathlib.Path, default=RESULTS, help="directory for training.json and training.png"
    )
    parser.add_argument("train_args", nargs="*", help="extra models.train arguments, after --")
    args = parser.parse_args(argv)
    known = MULTI_GPU_VARIANTS if args.multi_gpu else VARIANTS
    names = [name for name in ",".join(args.variants or known).split(",") if name]
    unknown = set(names) - known.keys()
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}: choose from {sorted(known)}")
    models = [model for model in ",".join(args.models or ["llama"]).split(",") if model]
    if set(models) - set(MODELS):
        parser.error(f"unknown models {sorted(set(models) - set(MODELS))}: choose from {', '.join(MODELS)}")

    stem = "multi_gpu" if args.multi_gpu else "training"
    path = args.out / f"{stem}.json"
    header = environment()
    run = {key: header[key] for key in ("date", "gpu", "commit")}
    new_rows = [run_variant(model, name, args, run) for model in models for name in variants_of(model, names)]
    rows = merged(previous_rows(path), new_rows, list(known))
    summaries = [group_summary(key, group) for key, group in groups(rows).items()]
    document = {**header, "peers": versions(), "models": summaries, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
    plot(rows, args.out / f"{stem}.png", "training throughput: each model's variants on the same weights and batches")
    for row in rows:
        if "error" in row:
            outcome = f"failed: {row['error']}"
        else:
            mfu = f"{row['mfu']:.1%}" if row["mfu"] else "-"
            speed = f"{row['tokens_per_s']:>10,.0f}" if row["tokens_per_s"] else f"{'-':>10}"
            outcome = f"{speed} tokens/s  MFU {mfu:>6}  final loss {tail_mean(row):.3f}"
        print(f"{row['model']:>7} {row['preset']:>5} {row['variant']:>18}: {outcome}")
    for summary in summaries:
        print(json.dumps(summary))
    print(f"wrote {path} and {args.out / f'{stem}.png'}")


if __name__ == "__main__":
    main()
