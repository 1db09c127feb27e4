"""Training throughput of the ~1B Llama preset: tk_ops vs the pure-PyTorch reference path, eager and compiled.

    python -m benchmarks.bench_training [--steps 100] [--variants tk-compile,reference-compile] [--out DIR]
    python -m benchmarks.bench_training --multi-gpu [--steps 30] [--out DIR]     # on a machine of 2 GPUs

Each variant is one ``python -m models.train --model llama --preset 1b`` run in its own process
(fresh memory and compile caches) for the same number of steps from the same initial weights on
the same batches (bf16 autocast, AdamW, no checkpoint). From each run's summary.json it keeps
tokens/s and MFU (averaged over the steps after the first three, which include compilation), peak
memory and the loss curves. It writes DIR/training.json (merged with the variants already there,
so the four can be run in separate commands) and DIR/training.png: the train-loss curves and the
tokens/s of each variant. ``speedup`` is tk-compile over reference-compile tokens/s;
``loss_gap`` the largest difference between the variants' train losses, each averaged over the
last quarter of the steps (curves that agree within noise give a gap of a few 0.01 nats).

``--multi-gpu`` runs the data-parallel variants instead and writes multi_gpu.json / .png: one GPU
with ``--grad-accum 2`` against two GPUs under torchrun (NCCL) with DDP and with FSDP2, which see
the same batches, so their per-step losses should agree to rounding (``max_step_gap``).

Needs the prepared data (``python -m models.data prepare``, carried as ``.data/``) and a GPU.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

from benchmarks.common import RESULTS, environment

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
VARIANTS = {
    "tk-eager": [],
    "tk-compile": ["--compile"],
    "reference-eager": ["--reference"],
    "reference-compile": ["--reference", "--compile"],
}
# The same global batch on one GPU (two micro-steps) and on two (one each, under torchrun).
MULTI_GPU_VARIANTS = {
    "tk-1gpu-accum2": ["--grad-accum", "2"],
    "tk-ddp-2gpu": ["--parallel", "ddp"],
    "tk-fsdp-2gpu": ["--parallel", "fsdp"],
}
DATA_PARALLEL_PROCESSES = 2


def launcher(train_args: list[str]) -> list[str]:
    """The interpreter, under torchrun when the run is data-parallel."""
    if "--parallel" in train_args:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={DATA_PARALLEL_PROCESSES}"]
    return [sys.executable]


def run_variant(name: str, args) -> dict:
    out = REPO_ROOT / "runs" / f"bench-training-{name}"
    variant_args = {**VARIANTS, **MULTI_GPU_VARIANTS}[name]
    command = [
        *launcher(variant_args),
        "-m",
        "models.train",
        "--model",
        "llama",
        "--preset",
        args.preset,
        "--steps",
        str(args.steps),
        "--warmup",
        str(max(1, args.steps // 10)),
        "--eval-every",
        str(args.steps),
        "--data",
        str(args.data),
        "--out",
        str(out),
        "--no-save",
        "--no-progress",
        "--sample-tokens",
        "0",
        *variant_args,
        *args.train_args,
    ]
    print(f"[{name}] {' '.join(command)}", flush=True)
    started = time.perf_counter()
    subprocess.run(command, cwd=REPO_ROOT, check=True)
    summary = json.loads((out / "summary.json").read_text())
    return {
        "variant": name,
        "path": summary["path"],
        "compile": summary["compile"],
        "tokens_per_s": summary["tokens_per_s"],
        "mfu": summary["mfu"],
        "max_memory_gib": summary["max_memory_gib"],
        "wall_s": round(time.perf_counter() - started, 1),
        "parameters": summary["parameters"],
        "tokens_per_step": summary["tokens_per_step"],
        "train_loss": [round(loss, 5) for _, loss in summary["train_loss"]],  # after steps 1, 2, ...
        "eval_loss": summary["eval_loss"],  # [step, loss]
        "command": " ".join(command[1:]),
    }


def tail_mean(row: dict) -> float:
    losses = row["train_loss"]
    tail = losses[-max(1, len(losses) // 4) :]
    return sum(tail) / len(tail)


def comparisons(rows: list[dict]) -> dict:
    by_name = {row["variant"]: row for row in rows}
    result = {}
    if {"tk-compile", "reference-compile"} <= by_name.keys():
        result["speedup"] = round(
            by_name["tk-compile"]["tokens_per_s"] / by_name["reference-compile"]["tokens_per_s"], 3
        )
    if {"tk-eager", "reference-eager"} <= by_name.keys():
        result["speedup_eager"] = round(
            by_name["tk-eager"]["tokens_per_s"] / by_name["reference-eager"]["tokens_per_s"], 3
        )
    if len(rows) > 1 and all(row["variant"] in MULTI_GPU_VARIANTS for row in rows):
        steps = zip(*(row["train_loss"] for row in rows))
        result["max_step_gap"] = round(max(max(losses) - min(losses) for losses in steps), 4)
    tails = [tail_mean(row) for row in rows]
    if len(tails) > 1:
        result["loss_gap"] = round(max(tails) - min(tails), 4)
    return result


def plot(rows: list[dict], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, bars) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for row in rows:
        curves.plot(range(1, len(row["train_loss"]) + 1), row["train_loss"], lw=1.2, label=row["variant"])
    curves.set_xlabel("step")
    curves.set_ylabel("train loss (nats / token)")
    curves.set_title("loss curves")
    curves.grid(alpha=0.3)
    curves.legend()
    names = [row["variant"] for row in rows]
    speeds = [row["tokens_per_s"] / 1e3 for row in rows]
    drawn = bars.bar(names, speeds, color=["tab:orange" if row["path"] == "tk_ops" else "tab:gray" for row in rows])
    for bar, row in zip(drawn, rows):
        label = f"{row['tokens_per_s'] / 1e3:.1f}k" + (f"\nMFU {row['mfu']:.0%}" if row["mfu"] else "")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--preset", default="1b")
    parser.add_argument(
        "--variants", help=f"comma-separated subset of {', '.join(VARIANTS)} (default: all of them)"
    )
    parser.add_argument(
        "--multi-gpu", action="store_true", help=f"run {', '.join(MULTI_GPU_VARIANTS)} instead (2 GPUs)"
    )
    parser.add_argument("--data", type=pathlib.Path, default=REPO_ROOT / ".data" / "kjv")
    parser.add_argument(
        "--out", type=pathlib.Path, default=RESULTS, help="directory for training.json and training.png"
    )
    parser.add_argument("train_args", nargs="*", help="extra models.train arguments, after --")
    args = parser.parse_args()
    known = MULTI_GPU_VARIANTS if args.multi_gpu else VARIANTS
    names = [name for name in (args.variants or ",".join(known)).split(",") if name]
    unknown = set(names) - known.keys()
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}: choose from {sorted(known)}")

    stem = "multi_gpu" if args.multi_gpu else "training"
    path = args.out / f"{stem}.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    kept = [row for row in previous.get("rows", []) if row["variant"] not in names and row.get("steps") == args.steps]
    new_rows = [{**run_variant(name, args), "steps": args.steps} for name in names]
    rows = sorted(kept + new_rows, key=lambda row: list(known).index(row["variant"]))
    document = {
        **environment(),
        "model": f"llama {args.preset}",
        "parameters": rows[0]["parameters"],
        "tokens_per_step": rows[0]["tokens_per_step"],
        "steps": args.steps,
        **comparisons(rows),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
    title = (
        f"Llama {args.preset} ({rows[0]['parameters'] / 1e9:.2f}B), {rows[0]['tokens_per_step']} tokens/step, "
        f"{args.steps} steps, {document['gpu']}"
    )
    plot(rows, args.out / f"{stem}.png", title)
    for row in rows:
        mfu = f"{row['mfu']:.1%}" if row["mfu"] else "-"
        print(
            f"{row['variant']:>18}: {row['tokens_per_s']:>10,.0f} tokens/s  MFU {mfu:>6}  "
            f"final loss {tail_mean(row):.3f}"
        )
    print(json.dumps(comparisons(rows)))
    print(f"wrote {path} and {args.out / f'{stem}.png'}")


if __name__ == "__main__":
    main()
