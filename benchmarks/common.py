"""Shared benchmark helpers: GPU timing and the results file.

Timing: CUDA events around a batch of back-to-back calls (so the launch queue stays full and host
overhead hides behind device work whenever it is smaller), after warm-up, median over rounds.
Inputs rotate through enough sets that their bytes exceed twice the L2, so no call reads what the
previous one left in cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import pathlib
import platform
import statistics
import subprocess
import sys
from typing import Callable, Optional, Sequence

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def l2_bytes() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size


def rotation_count(bytes_per_set: int, cap: int = 16) -> int:
    """How many input sets make the rotation larger than twice the L2 (at least 2)."""
    return max(2, min(cap, math.ceil(2 * l2_bytes() / max(bytes_per_set, 1)) + 1))


def input_set_count(bytes_per_set: int, device) -> int:
    """How many input sets a bench rotates through: enough to defeat the L2 on the GPU, one on the CPU."""
    return rotation_count(bytes_per_set) if device == "cuda" else 1


def relative_difference(got: torch.Tensor, reference: torch.Tensor) -> float:
    """||got - reference|| / ||reference|| in float64; inf when got holds a NaN or an infinity."""
    got, reference = got.detach().double(), reference.detach().double()
    if not torch.isfinite(got).all():
        return math.inf
    return ((got - reference).norm() / reference.norm().clamp_min(1e-30)).item()


def time_ms(fn: Callable, input_sets: Sequence[tuple], warmup: int = 5, rounds: int = 15, batch: int = 10) -> float:
    """Median milliseconds per call of fn(*inputs), cycling through input_sets."""
    for i in range(warmup):
        fn(*input_sets[i % len(input_sets)])
    torch.cuda.synchronize()
    per_call = []
    for r in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(batch):
            fn(*input_sets[(r * batch + i) % len(input_sets)])
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / batch)
    return statistics.median(per_call)


def time_graph_ms(fn: Callable, input_sets: Sequence[tuple], rounds: int = 15, batch: int = 20) -> float:
    """Median milliseconds per call with `batch` calls captured in one CUDA graph: device time
    alone, free of host overhead (what a captured training step or torch.compile's
    reduce-overhead mode sees)."""
    for inputs in input_sets:
        fn(*inputs)  # warm-up outside capture (lazy initialisation, descriptor caches)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(batch):
            fn(*input_sets[i % len(input_sets)])
    graph.replay()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / batch)
    del graph
    return statistics.median(per_call)


def host_us_per_call(fn: Callable, inputs: tuple, calls: int = 300) -> float:
    """Host microseconds per call on a problem too small to keep the GPU busy (launch-bound)."""
    import time

    for _ in range(20):
        fn(*inputs)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn(*inputs)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def source_commit() -> dict:
    """The commit of the tree these benchmarks run from, and whether the tree differs from it (results
    files aside): from the environment variables TK_OPS_COMMIT and TK_OPS_DIRTY (0 or 1) when set --
    the device copy of a tree carries a .git frozen at the session's first commit, so git there names
    the wrong commit -- otherwise from git when the tree is a checkout of its own; None if unknown."""
    if commit := os.environ.get("TK_OPS_COMMIT"):
        return {"commit": commit, "dirty": {"0": False, "1": True}.get(os.environ.get("TK_OPS_DIRTY", ""))}

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()

    try:
        if pathlib.Path(git("rev-parse", "--show-toplevel")).resolve() == ROOT:
            changes = git("status", "--porcelain", "--", ".", ":(exclude)benchmarks/results")
            return {"commit": git("rev-parse", "HEAD"), "dirty": bool(changes)}
    except (OSError, subprocess.CalledProcessError):  # no git, or not a checkout
        pass
    return {"commit": None, "dirty": None}


def environment() -> dict:
    """The run's machine, versions, command and commit (the device fields None without a CUDA device:
    a CPU dry run)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device()) if torch.cuda.is_available() else None
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit", "--format=csv,noheader"],
            capture_output=True, text=True, check=False,
        ).stdout.strip()
    except FileNotFoundError:
        smi = ""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": props and props.name,
        "sm_count": props and props.multi_processor_count,
        "l2_mb": props and round(props.L2_cache_size / 2**20, 1),
        "nvidia_smi": smi,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "command": " ".join([pathlib.Path(sys.executable).name, *sys.argv]),
        **source_commit(),
    }


def write_results(name: str, rows: list[dict], out_dirs: Sequence[pathlib.Path] = (RESULTS,), **header) -> list[pathlib.Path]:
    """Write {header..., environment, rows} as <dir>/<name>.json; returns the paths."""
    document = {**environment(), **header, "rows": rows}
    paths = []
    for directory in out_dirs:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{name}.json"
        path.write_text(json.dumps(document, indent=1) + "\n")
        paths.append(path)
    return paths


# ------------------------------------------------------------------ rows of a comparison against a floor
# For benches whose shapes are dataclasses with a `label` and `hbm_bytes(pass_, element_bytes)`: one row
# per (shape, pass, baseline), times in ms or None (a dry run, a baseline that could not run).


def rounded(value: Optional[float], digits: int = 5) -> Optional[float]:
    return None if value is None else round(value, digits)


def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    return None if numerator is None or not denominator else round(numerator / denominator, 3)


def describe_error(error: Exception) -> str:
    """An exception as one line for a result row."""
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def floor_row(shape, pass_: str, baseline: str, ours_ms: Optional[float], baseline_ms: Optional[float],
              copy_gbps: Optional[float], element_bytes: int, rel_diff: Optional[float] = None,
              error: Optional[str] = None) -> dict:
    """One result row: both times, baseline / ours, the HBM floor (the shape's bytes over the copy
    bandwidth measured in the run) and each side's fraction of it, and the shape's fields."""
    moved = shape.hbm_bytes(pass_, element_bytes)
    floor_ms = moved / copy_gbps / 1e6 if copy_gbps else None
    row = {
        "shape": shape.label, "pass": pass_, "baseline": baseline,
        "ours_ms": rounded(ours_ms), "baseline_ms": rounded(baseline_ms), "ratio": ratio(baseline_ms, ours_ms),
        "floor_ms": rounded(floor_ms), "ours_of_floor": ratio(floor_ms, ours_ms),
        "baseline_of_floor": ratio(floor_ms, baseline_ms), "hbm_bytes": moved,
        "rel_diff_vs_ours": None if rel_diff is None else float(f"{rel_diff:.2e}"),
        **dataclasses.asdict(shape),
    }
    if error:
        row["error"] = error
    return row


def print_floor_rows(rows: Sequence[dict], shape_width: int, baseline_width: int, extra: Sequence[str] = ()) -> None:
    """One line per row: shape, pass, baseline, ours_ms, baseline_ms, ratio, floor_ms, then `key=value`
    for each key in `extra`, then the row's error."""
    for row in rows:
        cells = [f"{row[key]:9.4f}" if row[key] is not None else f"{'-':>9}" for key in ("ours_ms", "baseline_ms", "floor_ms")]
        ratio_cell = f"{row['ratio']:6.2f}" if row["ratio"] is not None else f"{'-':>6}"
        extras = "".join(f" {key}={row[key]}" for key in extra)
        note = f"  ({row['error']})" if "error" in row else ""
        print(f"{row['shape']:{shape_width}} {row['pass']:7} {row['baseline']:{baseline_width}} {cells[0]} {cells[1]} "
              f"{ratio_cell} {cells[2]}{extras}{note}", flush=True)


def run_once(fn: Callable, input_sets: Sequence[tuple]) -> None:
    """The --dry-run stand-in for time_ms: one call on every set, no time."""
    for inputs in input_sets:
        fn(*inputs)
    return None


def finish_check(summary: str, failures: Sequence[str], exit_on_failure: bool = True) -> None:
    """The end of a bench's --check sweep: the summary, each failure, and a non-zero exit on any
    (unless the caller goes on, e.g. to time what it has flagged)."""
    print(f"{summary}, {len(failures)} failures", flush=True)
    for failure in failures:
        print("  FAIL", failure)
    if failures and exit_on_failure:
        raise SystemExit(1)


def sweep_arguments(description: Optional[str], passes: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The options every bench with a correctness sweep and a CPU dry run shares, and --pass (into
    args.passes) when the bench times several `passes`."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, help="also write the results and plot into this folder")
    parser.add_argument("--check", action="store_true", help="only the correctness sweep")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, no timing: build and print the rows")
    if passes:
        parser.add_argument("--pass", dest="passes", choices=passes, action="append",
                            help="only this pass (repeatable; default: all)")
    return parser


COPY_CEILING = "torch copy_ of 1 GiB fp32, device to device, read + write, this run"


def measured_copy_ceiling() -> tuple[float, dict]:
    """This run's device-to-device copy bandwidth (GB/s, printed) and the results-header fields that
    name it: the ceiling every memory-bound bench reports its floor fractions against."""
    from benchmarks.bench_rope import copy_bandwidth_gbps

    copy = copy_bandwidth_gbps()
    print(f"device-to-device copy in this run: {copy:.0f} GB/s")
    return copy, dict(copy_gbps=round(copy, 1), ceiling=COPY_CEILING)


def sweep_shapes(name: str, shapes: Sequence, measure_shape: Callable[[object], list[dict]],
                 widths: tuple[int, int], out: Optional[pathlib.Path], plot: Callable, **header) -> list[dict]:
    """Measures shape after shape, printing each one's rows and rewriting NAME.json after each (a run
    cut short keeps what it measured), then plots NAME.png; into RESULTS and, given, `out`."""
    out_dirs = [RESULTS] + ([out] if out else [])
    rows: list[dict] = []
    for shape in shapes:
        shape_rows = measure_shape(shape)
        print_floor_rows(shape_rows, *widths)
        rows += shape_rows
        write_results(name, rows, out_dirs, **header)
    for directory in out_dirs:
        plot(rows, directory / f"{name}.png", torch.cuda.get_device_name())
    return rows


def finish_dry_run(name: str, rows: list[dict], widths: tuple[int, int], out: Optional[pathlib.Path],
                   plot: Callable) -> list[dict]:
    """A dry run's rows printed as a sweep prints them and as JSON, and plotted into `out` if given."""
    print_floor_rows(rows, *widths)
    print(json.dumps(rows, indent=1))
    if out:
        out.mkdir(parents=True, exist_ok=True)
        plot(rows, out / f"{name}.png", "CPU (dry run, nothing timed)")
    return rows


def floor_bar_panel(ax, rows: Sequence[dict], names: Sequence[str], colors: dict, title: str,
                    tick: Callable[[str], str] = lambda shape: shape) -> None:
    """One matplotlib panel of floor rows (one pass of one kind): per shape a bar of ms for ours
    ("tk_ops") and each baseline run at that shape, the HBM floor as a tick, log scale when anything was
    timed."""
    shapes = list(dict.fromkeys(row["shape"] for row in rows))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        times = []
        for shape in shapes:
            of_shape = [row for row in rows if row["shape"] == shape]
            times.append(of_shape[0]["ours_ms"] if name == "tk_ops"  # no bar for a baseline not run there
                         else next((row["baseline_ms"] for row in of_shape if row["baseline"] == name), None))
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(shapes))]
        ax.bar(xs, [math.nan if t is None else t for t in times], width, color=colors[name], label=name)
    floors = [next(row["floor_ms"] for row in rows if row["shape"] == shape) for shape in shapes]
    if all(f is not None for f in floors):
        ax.plot(range(len(shapes)), floors, "k_", markersize=30, label="HBM floor (copy bandwidth)")
    ax.set_xticks(range(len(shapes)), [tick(shape) for shape in shapes], rotation=15, fontsize=7, ha="right")
    if any(row["ours_ms"] or row["baseline_ms"] for row in rows):  # a dry run has no times
        ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)

