"""Training throughput of the model presets: tk_ops vs the pure-PyTorch reference path vs the peers, eager and compiled.

    python -m benchmarks.bench_training [--steps 100] [--variants tk-compile,reference-compile] [--out DIR]
    python -m benchmarks.bench_training --models based,mamba2,hyena [--preset 1b] [--steps 60]
    python -m benchmarks.bench_training --multi-gpu [--steps 30] [--out DIR]     # on a machine of 2 GPUs
    python -m benchmarks.bench_training --dry-run --data DIR [--models ...] [--out DIR]  # CPU, nano presets, 2 steps
    python -m benchmarks.bench_training --plot-from benchmarks/results/training.json

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
wrote to stderr, or its last line). On benchmarks/common.py's harness for runs of whole models:
after each run it writes training.json into benchmarks/results and --out (a dry run into --out
only), one row per (model, preset, variant) with the date, GPU and commit of its run, merged with the
rows of the file there (those of a model and preset run again are kept only at the same --steps),
and per model and preset: ``speedup``, tk-compile over reference-compile
tokens/s; ``speedup_eager``; ``speedup_vs_peer`` and ``speedup_vs_peer_eager`` against the peer
variants where they exist; ``loss_gap``, the largest difference between the variants' train losses,
each averaged over the last quarter of the steps (curves that agree within noise give a gap of a
few 0.01 nats). training.png has, per model and preset, the loss curves and the tokens/s.

``--multi-gpu`` runs the data-parallel variants instead and writes multi_gpu.json / .png: one GPU
with ``--grad-accum 2`` against two GPUs under torchrun (NCCL) with DDP and with FSDP2, which see
the same batches, so their per-step losses should agree to rounding (``max_step_gap``).

Needs the prepared data (``python -m models.data prepare``: ``.data/``), a GPU, and for the peer
variants the peer packages (``benchmarks/wheels/baselines.sh`` puts them in ``.baselines``). ``--dry-run`` runs
them on the CPU (fp32, no MFU; the nano presets for 2 steps unless --preset and --steps say
otherwise, every step timed).
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
from typing import Optional

from benchmarks import common
from models.peers import PEER_IS_REFERENCE, PEER_OPS, versions

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
ROW_KEY = ("model", "preset", "variant")
DEFAULTS = dict(preset="1b", steps=100)
DRY_RUN = dict(preset="nano", steps=2)
# models.train on the CPU, with every step in the tokens/s average (a dry run has too few to leave some out)
DRY_RUN_TRAIN_ARGS = ["--device", "cpu", "--timing-warmup", "0"]
TITLE = "training throughput: each model's variants on the same weights and batches"
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


def run_variant(model: str, name: str, args) -> dict:
    """One models.train run; its row (with ``error`` and no timings when it failed)."""
    out = common.ROOT / "runs" / f"bench-training-{model}-{args.preset}-{name}"
    variant_args = {**VARIANTS, **MULTI_GPU_VARIANTS}[name]
    command = [
        *launcher(variant_args), "-m", "models.train", "--model", model, "--preset", args.preset,
        "--steps", str(args.steps), "--warmup", str(max(1, args.steps // 10)), "--eval-every", str(args.steps),
        "--data", str(args.data), "--out", str(out), "--no-save", "--no-progress", "--sample-tokens", "0",
        *variant_args, *(DRY_RUN_TRAIN_ARGS if args.dry_run else []), *args.train_args,
    ]  # fmt: skip
    print(f"[{model} {name}] {' '.join(command)}", flush=True)
    (out / "summary.json").unlink(missing_ok=True)
    started = time.perf_counter()
    status, failure = common.run_process(command)
    row = {
        "model": model, "preset": args.preset, "variant": name,
        "path": "peer" if "--peer" in variant_args else "reference" if "--reference" in variant_args else "tk_ops",
        "compile": "--compile" in variant_args, "tokens_per_s": None, "mfu": None, "max_memory_gib": None,
        "wall_s": round(time.perf_counter() - started, 1), "parameters": None, "tokens_per_step": None,
        "train_loss": [], "eval_loss": [], "command": " ".join(command[1:]), "steps": args.steps,
    }  # fmt: skip
    if status != 0:
        return {**row, "error": failure or f"exit status {status}"}
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


def in_order(rows: list[dict], variants: list[str]) -> list[dict]:
    """The rows by model (MODELS' order), preset and variant (the order of variants)."""
    def position(row: dict) -> tuple:
        model, variant = row["model"], row["variant"]
        return (
            MODELS.index(model) if model in MODELS else len(MODELS), model, row["preset"],
            variants.index(variant) if variant in variants else len(variants), variant,
        )  # fmt: skip

    return sorted(rows, key=position)


def plot(document: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = groups(document["rows"])
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
    fig.suptitle(TITLE)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Optional[list[str]] = None):
    parser = common.arguments(__doc__, check=False, dry_run="CPU, the nano presets for 2 steps, timed on the CPU")
    parser.add_argument("--steps", type=int, help="default 100; --dry-run: 2")
    parser.add_argument(
        "--models", action="append", help=f"comma-separated subset of {', '.join(MODELS)}, repeatable (default llama)"
    )
    parser.add_argument("--preset", help="the models.train preset of every model run (default 1b; --dry-run: nano)")
    parser.add_argument(
        "--variants", action="append",
        help=f"comma-separated subset of {', '.join(VARIANTS)}, repeatable (default: all of a model's; peer-* only "
        "where the peer is not the reference path)",
    )  # fmt: skip
    parser.add_argument(
        "--multi-gpu", action="store_true", help=f"run {', '.join(MULTI_GPU_VARIANTS)} instead (2 GPUs)"
    )
    parser.add_argument("--data", type=pathlib.Path, default=common.ROOT / ".data" / "kjv")
    parser.add_argument("train_args", nargs="*", help="extra models.train arguments, after --")
    args = common.with_defaults(parser.parse_args(argv), DEFAULTS, DRY_RUN)
    known = list(MULTI_GPU_VARIANTS if args.multi_gpu else VARIANTS)
    args.variants = common.names_of(parser, args.variants, known, known, "variants")
    args.models = common.names_of(parser, args.models, MODELS, ["llama"], "models")
    return args


def print_rows(document: dict) -> None:
    for row in document["rows"]:
        if "error" in row:
            outcome = f"failed: {row['error']}"
        else:
            mfu = f"{row['mfu']:.1%}" if row["mfu"] else "-"
            speed = f"{row['tokens_per_s']:>10,.0f}" if row["tokens_per_s"] else f"{'-':>10}"
            outcome = f"{speed} tokens/s  MFU {mfu:>6}  final loss {tail_mean(row):.3f}"
        print(f"{row['model']:>7} {row['preset']:>5} {row['variant']:>18}: {outcome}")
    for summary in document["models"]:
        print(json.dumps(summary))


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.plot_from:
        return common.replot(args.plot_from, plot)
    name = "multi_gpu" if args.multi_gpu else "training"
    out_dirs = common.results_dirs(args.out, args.dry_run)
    order = list({**VARIANTS, **MULTI_GPU_VARIANTS})
    new_rows, document = [], None

    def kept(row: dict) -> bool:  # a stored row of a model and preset run again only at the same --steps
        return group_key(row) not in map(group_key, new_rows) or row["steps"] == args.steps

    for model, variant in [(model, variant) for model in args.models for variant in variants_of(model, args.variants)]:
        new_rows.append(run_variant(model, variant, args))  # the file rewritten after each: a cut-short call keeps it
        rows = in_order(common.merged_rows(name, new_rows, out_dirs, ROW_KEY, kept), order)
        summaries = [group_summary(key, group) for key, group in groups(rows).items()]
        document = common.write_and_plot(name, rows, out_dirs, plot, peers=versions(), models=summaries)
    if document is not None:
        print_rows(document)


if __name__ == "__main__":
    main()
