"""Training tokens/s against the sequence length at a fixed number of tokens per step: Llama on tk
attention, Based, Mamba-2 and Hyena on tk_ops, and each on its peers' layers.

    python -m benchmarks.bench_long_context [--preset small] [--tokens 65536] [--seq-lens 2048,4096,...,65536]
                                            [--variants llama-tk,...] [--steps 3] [--warmup 2] [--compile]
                                            [--mixer-share] [--out DIR]
    python -m benchmarks.bench_long_context --dry-run [--variants ...] [--out DIR]   # CPU, nano preset, tiny sizes
    python -m benchmarks.bench_long_context --plot-from benchmarks/results/long_context.json

Variants (model-path): llama-tk, based-tk, mamba2-tk and hyena-tk on tk_ops; llama-reference and
hyena-reference, the reference paths that are these models' peers (SDPA, torch.fft); based-peer
(fla's parallel_based) and mamba2-peer (mamba_ssm's Triton SSD), models/peers.py. These eight run by
default; based-reference and mamba2-reference (plain PyTorch: the quadratic Based attention, the
chunked SSD) on request.

The preset: small (29-32M parameters) by default, the largest whose every model fits an H100 at
64k tokens per step. A count on the CPU of the bytes autograd saves for the backward, plus weights,
gradients and AdamW (bf16 autocast; it gives the Llama 1b preset 43 GiB against the 40 GiB the H100
measured) puts Mamba-2 base at 106 GiB there (Llama and Based 36, Hyena 51 GiB; the small presets
14-39 GiB); the base presets fit at 32k tokens per step (Mamba-2 54 GiB).

Each variant runs in a process of its own (an out-of-memory or a faulting kernel costs only its
rows, and every variant starts on empty memory) over every sequence length N, shortest first: the
preset's model shape with max_position_embeddings = N (Hyena's filters have N taps), batch
tokens / N, uniform random tokens, models.train's train_step (forward, backward, clipping, AdamW;
bf16 autocast) through benchmarks/mixer_share.py's harness: --warmup steps, then the mean wall-clock
time of --steps steps. A row: tokens/s, step_ms, model TFLOP/s (the model's flops_per_token),
peak memory, the tk ops that ran their PyTorch reference at that N (``fallbacks``: sizes no kernel
takes, e.g. tk.fftconv above N = 16384), and with --mixer-share the mixers' share of the step
(a second round of eager steps with the mixer timer). A step that runs out of memory leaves a row
with error "out of memory" and the variant goes on with the next N; any other failure leaves its
error (a peer that does not import: every row of its variant says so). On benchmarks/common.py's
harness for runs of whole models: after each variant it writes long_context.json into
benchmarks/results and --out (a dry run into --out only), the rows of the variants and lengths not
run kept from the file there, each row with the date, GPU and commit of its run, and
long_context.png: tokens/s against N (log2 axis), a model per colour, tk_ops solid, the peers dashed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
from typing import Optional

import torch

from benchmarks import common
from benchmarks.mixer_share import measure_row
from models.peers import PEER_OPS, versions

NAME = "long_context"
MODEL_COLORS = {"llama": "tab:gray", "based": "tab:orange", "mamba2": "tab:green", "hyena": "tab:purple"}
DEFAULT_VARIANTS = (
    "llama-tk", "llama-reference", "based-tk", "based-peer", "mamba2-tk", "mamba2-peer", "hyena-tk", "hyena-reference",
)  # fmt: skip
VARIANTS = DEFAULT_VARIANTS + ("based-reference", "mamba2-reference")
# the reference paths that are their model's peers: drawn as the peers are
PEER_REFERENCES = ("llama-reference", "hyena-reference")
SEQ_LENS = tuple(2**k for k in range(11, 17))  # 2k .. 64k
DEFAULTS = dict(preset="small", tokens=65536, seq_lens=SEQ_LENS, warmup=2, steps=3)
DRY_RUN = dict(preset="nano", tokens=128, seq_lens=(32, 64), warmup=1, steps=1)
ROW_KEY = ("variant", "preset", "seq_len", "tokens_per_step", "compile")


def split_variant(variant: str) -> tuple[str, str]:
    model, impl = variant.split("-")
    return model, impl


def peer_of(variant: str) -> Optional[str]:
    """What a peer variant runs on (None for the tk_ops and plain-reference variants)."""
    model, impl = split_variant(variant)
    if impl == "peer":
        return PEER_OPS[model]
    return "SDPA" if variant == "llama-reference" else PEER_OPS[model] if variant in PEER_REFERENCES else None


def row_key(variant: str, seq_len: int, args) -> dict:
    """What a row of the variant at seq_len is, before (or without) its measurement."""
    model, impl = split_variant(variant)
    return {
        "variant": variant, "model": model, "impl": impl, "peer": peer_of(variant), "preset": args.preset,
        "seq_len": seq_len, "batch_size": args.tokens // seq_len, "tokens_per_step": args.tokens, "compile": args.compile,
    }  # fmt: skip


def run_worker(variant: str, args) -> None:
    """Every sequence length of one variant, in this process; one JSON line per row into args.rows_file."""
    device = torch.device("cpu" if args.dry_run else "cuda")
    for seq_len in args.seq_lens:
        key = row_key(variant, seq_len, args)
        row = measure_row(
            key, device, warmup=args.warmup, steps=args.steps, compile=args.compile, mixer_share=args.mixer_share
        )
        with open(args.rows_file, "a") as rows_file:
            rows_file.write(json.dumps(row) + "\n")
        outcome = row.get("error") or f"{row['tokens_per_s']:>12,.0f} tokens/s  {row['step_ms']:9.1f} ms/step"
        print(f"{variant:>16} N={seq_len:>6} B={key['batch_size']:>3}: {outcome}", flush=True)


def run_variant(variant: str, args) -> list[dict]:
    """A worker process for the variant; its rows, and for the lengths it did not reach (it died) rows
    with the worker's exit status and the line of its stderr that names what failed."""
    with tempfile.TemporaryDirectory() as scratch:
        rows_file = pathlib.Path(scratch) / "rows.jsonl"
        command = [
            sys.executable, "-m", "benchmarks.bench_long_context", "--worker", variant, "--rows-file", str(rows_file),
            "--preset", args.preset, "--tokens", str(args.tokens), "--seq-lens", ",".join(map(str, args.seq_lens)),
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            *(["--compile"] if args.compile else []), *(["--mixer-share"] if args.mixer_share else []),
            *(["--dry-run"] if args.dry_run else []),
        ]  # fmt: skip
        print(f"[{variant}] {' '.join(command[1:])}", flush=True)
        status, failure = common.run_process(command)
        rows = [json.loads(line) for line in rows_file.read_text().splitlines()] if rows_file.exists() else []
    if status != 0:
        done = {row["seq_len"] for row in rows}
        error = f"worker exit status {status}: {failure}"
        rows += [{**row_key(variant, n, args), "error": error} for n in args.seq_lens if n not in done]
    return rows


def plot(document: dict, path: pathlib.Path) -> None:
    """The rows of the document's preset, tokens per step and mode (other runs' rows merged into the file
    aside): tokens/s against N, and with --mixer-share the mixers' share of the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = (document["preset"], document["tokens_per_step"], document.get("compile", False))
    rows = [row for row in document["rows"] if (row["preset"], row["tokens_per_step"], row["compile"]) == run]
    shares = [row for row in rows if "mixer_share" in row]
    fig, axes = plt.subplots(1, 2 if shares else 1, figsize=(14 if shares else 8, 5), squeeze=False)
    speed_axis = axes[0][0]
    variants = list(dict.fromkeys(row["variant"] for row in rows))
    for variant in variants:
        model, impl = split_variant(variant)
        style = dict(color=MODEL_COLORS[model], ls="-" if impl == "tk" else "--" if peer_of(variant) else ":")
        of_variant = sorted((row for row in rows if row["variant"] == variant), key=lambda row: row["seq_len"])
        done = [row for row in of_variant if "error" not in row]
        failed = [row["seq_len"] for row in of_variant if "error" in row]
        speed_axis.plot(
            [row["seq_len"] for row in done], [row["tokens_per_s"] / 1e3 for row in done], marker="o", ms=4,
            label=variant + (f" ({peer_of(variant)})" if peer_of(variant) else ""), **style,
        )  # fmt: skip
        speed_axis.plot(failed, [0] * len(failed), "x", ms=8, color=style["color"])
        if shares:
            with_share = [row for row in done if "mixer_share" in row]
            axes[0][1].plot(
                [row["seq_len"] for row in with_share], [100 * row["mixer_share"] for row in with_share],
                marker="o", ms=4, label=variant, **style,
            )  # fmt: skip
    lengths = sorted({row["seq_len"] for row in rows})
    for axis in axes[0]:
        axis.set_xscale("log", base=2)
        axis.set_xticks(lengths, [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths])
        axis.minorticks_off()
        axis.set_xlabel("sequence length N (tokens per step fixed)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    speed_axis.set_ylabel("thousand tokens / s (x: failed, e.g. out of memory)")
    speed_axis.set_title("training step throughput")
    if shares:
        axes[0][1].set_ylabel("mixers' share of the step (%)")
        axes[0][1].set_title("sequence mixers (with their projections)")
    preset, tokens, compiled = run
    per_step = f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)
    fig.suptitle(f"{preset} presets, {per_step} tokens per step, {'compiled' if compiled else 'eager'}, "
                 f"{document.get('gpu') or 'CPU (dry run)'}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Optional[list[str]] = None):
    parser = common.arguments(__doc__, check=False, dry_run="CPU, nano preset, N = 32 and 64, 128 tokens per step, timed on the CPU")
    parser.add_argument(
        "--variants", action="append",
        help=f"comma-separated subset of {', '.join(VARIANTS)}, repeatable (default: the first eight)",
    )  # fmt: skip
    parser.add_argument("--preset", help="the models.train preset of every model (default small; --dry-run: nano)")
    parser.add_argument("--tokens", type=int, help=f"tokens per step (default {DEFAULTS['tokens']})")
    parser.add_argument("--seq-lens", help="comma-separated sequence lengths (default 2048, 4096, ..., 65536)")
    parser.add_argument("--steps", type=int, help="timed steps per length (default 3)")
    parser.add_argument("--warmup", type=int, help="steps before the timed ones (default 2)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block (not with --mixer-share)")
    parser.add_argument("--mixer-share", action="store_true", help="also time the mixers (eager)")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--rows-file", type=pathlib.Path, help=argparse.SUPPRESS)
    args = common.with_defaults(parser.parse_args(argv), DEFAULTS, DRY_RUN)
    if isinstance(args.seq_lens, str):
        args.seq_lens = tuple(int(n) for n in args.seq_lens.split(",") if n)
    args.variants = common.names_of(parser, args.variants, VARIANTS, DEFAULT_VARIANTS, "variants")
    if any(args.tokens % n for n in args.seq_lens):
        parser.error(f"every sequence length must divide --tokens ({args.tokens}), got {args.seq_lens}")
    if args.compile and args.mixer_share:
        parser.error("--mixer-share times eager steps: leave out --compile")
    return args


def main(argv: Optional[list[str]] = None) -> list[dict]:
    args = parse_args(argv)
    if args.plot_from:
        common.replot(args.plot_from, plot)
        return []
    if args.worker:
        run_worker(args.worker, args)
        return []
    out_dirs = common.results_dirs(args.out, args.dry_run)
    header = dict(peers=versions(), tokens_per_step=args.tokens, preset=args.preset, compile=args.compile)
    rows: list[dict] = []
    for variant in args.variants:
        rows += run_variant(variant, args)
        common.write_and_plot(NAME, common.merged_rows(NAME, rows, out_dirs, ROW_KEY), out_dirs, plot, **header)
    return rows


if __name__ == "__main__":
    main()
