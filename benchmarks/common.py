"""The benchmark harness: GPU timing, cases x providers, one row schema, the table, the plot and the
results file.

Timing: CUDA events around a batch of back-to-back calls (so the launch queue stays full and host
overhead hides behind device work whenever it is smaller), after warm-up, median over rounds.
Inputs rotate through enough sets that their bytes exceed twice the L2, so no call reads what the
previous one left in cache.

A bench (`Bench`) is its cases (frozen dataclasses with a `label`), the passes it times, a function
that makes one input set, ours and the baselines (`Provider`) it is compared with in the same run.
`run` measures every case and pass on one rotation of input sets shared by all providers: each
provider's first call on the first set gives its outputs, each baseline's are compared with ours
(the relative difference goes into the row, a mismatch past the bench's tolerance is flagged), then
each is timed. It prints a table row per (case, pass, baseline) as they come, rewrites NAME.json
(rows, commit, GPU, versions) after every case, so a run cut short keeps what it measured, and
plots NAME.png at the end. On the CPU (--dry-run) the same path runs on tiny cases with each
provider called once per set and nothing timed.

A bench may sweep a setting of every provider (`Bench.sweep`, e.g. the chunk size): rows at each value
and a row of each side at its own fastest; record each side's peak memory (`Bench.peak_memory`); and
measure a baseline in a process of its own that lives from row to row (`Worker`, `serve`).

Benches of whole training runs (bench_training, bench_long_context) have rows of their own (tokens/s
of a model variant) and share the rest: the command line (`arguments`, `with_defaults`, `names_of`),
their runs in child processes (`run_process`: a failed run's row names what failed), and a results
file that later runs add to (`merged_rows`: each row keeps the date, GPU and commit of its run;
`write_and_plot`, `replot`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib
import importlib.metadata
import itertools
import json
import math
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
from typing import Any, Callable, Optional, Sequence

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def l2_bytes() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size


def rotation_count(bytes_per_set: int, cap: int = 16) -> int:
    """How many input sets make the rotation larger than twice the L2 (at least 2)."""
    return max(2, min(cap, math.ceil(2 * l2_bytes() / max(bytes_per_set, 1)) + 1))


def input_set_count(bytes_per_set: int, device, cap: int = 16) -> int:
    """How many input sets a bench rotates through: enough to defeat the L2 on the GPU (at most cap),
    one on the CPU."""
    return min(cap, rotation_count(bytes_per_set, cap)) if device == "cuda" else 1


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


def host_us_per_call(fn: Callable, inputs: tuple, calls: int = 300, rounds: int = 1) -> float:
    """Host microseconds per call on a problem too small to keep the GPU busy (launch-bound): the
    median over `rounds` rounds of `calls` back-to-back calls closed by a synchronize, after a warm-up."""
    import time

    for _ in range(20):
        fn(*inputs)
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*inputs)
        torch.cuda.synchronize()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(per_call)


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


def write_results(name: str, rows: list[dict], out_dirs: Sequence[pathlib.Path] = (RESULTS,), **header) -> dict:
    """Write {environment, header..., rows} as <dir>/<name>.json; returns that document."""
    document = {**environment(), **header, "rows": rows}
    for directory in out_dirs:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{name}.json").write_text(json.dumps(document, indent=1) + "\n")
    return document


def results_dirs(out: Optional[pathlib.Path], dry_run: bool) -> list[pathlib.Path]:
    """Where a run writes NAME.json and NAME.png: benchmarks/results and `out`; a dry run into `out` only."""
    return ([] if dry_run else [RESULTS]) + ([out] if out else [])


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy of 1 GiB, bytes read plus bytes written."""
    source = torch.randn(2**28, device="cuda")
    target = torch.empty_like(source)
    ms = time_ms(lambda s, t: t.copy_(s), [(source, target)])
    return 2 * source.numel() * source.element_size() / ms / 1e6


COPY_CEILING = "torch copy_ of 1 GiB fp32, device to device, read + write, this run"


def measured_copy_bandwidth() -> float:
    """This run's device-to-device copy bandwidth in GB/s (printed): the ceiling every memory-bound
    bench reports its floor fractions against (`copy_ceiling_header` names it in the results)."""
    copy = copy_bandwidth_gbps()
    print(f"device-to-device copy in this run: {copy:.0f} GB/s")
    return copy


def copy_ceiling_header(copy_gbps: float) -> dict:
    """The results-header fields that name the copy ceiling of this run."""
    return dict(copy_gbps=round(copy_gbps, 1), ceiling=COPY_CEILING)


def run_once(fn: Callable, input_sets: Sequence[tuple]) -> None:
    """The dry run's stand-in for time_ms: one call on every set, no time."""
    for inputs in input_sets:
        fn(*inputs)
    return None


def tensor_bytes(inputs) -> int:
    """The bytes of the tensors in an input set (in nested tuples and lists too)."""
    if isinstance(inputs, torch.Tensor):
        return inputs.numel() * inputs.element_size()
    if isinstance(inputs, (tuple, list)):
        return sum(map(tensor_bytes, inputs))
    return 0


def step(fn: Callable, backward: bool, differentiable: Optional[Sequence[int]] = None) -> Callable:
    """The call a pass times on an input set (*arguments, grad_out): fn's output; with backward, the
    output and the gradients of the arguments at the positions ``differentiable`` (default: every one)
    for grad_out (all of them compared by the check). fn may return a tuple of outputs; grad_out is then
    a tuple with one gradient each."""
    if not backward:
        return lambda *inputs: fn(*inputs[:-1])

    def forward_backward(*inputs):
        arguments = inputs[:-1]
        out = fn(*arguments)
        leaves = arguments if differentiable is None else [arguments[i] for i in differentiable]
        outputs = out if isinstance(out, tuple) else (out,)
        return (*outputs, *torch.autograd.grad(out, leaves, inputs[-1]))

    return forward_backward


# ------------------------------------------------------------------------------ rows and their parts


def rounded(value: Optional[float], digits: int = 5) -> Optional[float]:
    return None if value is None else round(value, digits)


def mib(n: Optional[int]) -> Optional[float]:
    return None if n is None else round(n / 2**20, 1)


def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    return None if numerator is None or not denominator else round(numerator / denominator, 3)


def rate(amount: float, ms: Optional[float], unit: float) -> Optional[float]:
    """amount per second in `unit`s (1e9: flops to TFLOP/s, 1e6: bytes to GB/s), from milliseconds."""
    return None if not ms else round(amount / ms / unit, 1)


def describe_error(error: Exception) -> str:
    """An exception as one line for a result row (a Missing peer: its message alone)."""
    if isinstance(error, Missing):
        return str(error)
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


# One schema for every row of every bench: ours against one baseline on one case and pass.
#   shape, pass, baseline      the case's label, the pass, the provider ours is compared with
#   ours_ms, baseline_ms       median ms per call (None: a dry run, or that side failed: see error)
#   ratio                      baseline_ms / ours_ms: above 1 ours is faster
#   best_baseline, ratio_vs_best   the fastest baseline of the case and pass, and the ratio to it
#   rel_diff_vs_baseline       ||ours - baseline|| / ||baseline||, the largest over the outputs
#                              compared (a backward pass: the output and the gradients)
#   mismatch                   true where rel_diff_vs_baseline is past the bench's tolerance
#   ours_graph_ms, baseline_graph_ms, graph_ratio   CUDA-graph replays, where the bench times them
#   flops, ours_tflops, baseline_tflops, fraction_of_ceiling   cases with flops(pass_)
#   hbm_bytes, floor_ms, ours_of_floor, baseline_of_floor, ours_gbps, baseline_gbps,
#   ours_graph_of_floor        cases with hbm_bytes(pass_): the bytes that must cross HBM, and those
#                              bytes at the copy bandwidth measured in the run (the floor)
#   ours_peak_mib, baseline_peak_mib, peak_ratio   benches with peak_memory (on the GPU): the MiB a
#                              call allocates beyond its inputs at its peak, and ours over the baseline's
#   ours_<s>, baseline_<s>     benches with a sweep of setting s: the value each side ran at (the row
#                              of each side at its fastest: baseline "<name>@best")
#   the case's fields, the fields a side's callable reports (row_fields), then
#                              error: why a side has no time, where one has none
def comparison_row(case, pass_: str, baseline: str, ours: dict, theirs: dict, tolerance: float,
                   copy_gbps: Optional[float] = None, tflops_ceiling: Optional[float] = None) -> dict:
    """The row of ours against one baseline, from both measurements (`measure`'s dicts)."""
    ours_ms, baseline_ms, rel_diff = ours.get("ms"), theirs.get("ms"), theirs.get("rel_diff")
    row = {
        "shape": case.label, "pass": pass_, "baseline": baseline,
        "ours_ms": rounded(ours_ms), "baseline_ms": rounded(baseline_ms), "ratio": ratio(baseline_ms, ours_ms),
        "best_baseline": None, "ratio_vs_best": None,
        "rel_diff_vs_baseline": None if rel_diff is None else float(f"{rel_diff:.3g}"),
    }
    if rel_diff is not None and not rel_diff <= tolerance:
        row["mismatch"] = True
    if "graph_ms" in ours or "graph_ms" in theirs:
        row.update(ours_graph_ms=rounded(ours.get("graph_ms")), baseline_graph_ms=rounded(theirs.get("graph_ms")),
                   graph_ratio=ratio(theirs.get("graph_ms"), ours.get("graph_ms")))
    if hasattr(case, "flops"):
        flops = case.flops(pass_)
        row.update(flops=flops, ours_tflops=rate(flops, ours_ms, 1e9), baseline_tflops=rate(flops, baseline_ms, 1e9))
        if tflops_ceiling:
            row["fraction_of_ceiling"] = ratio(row["ours_tflops"], tflops_ceiling)
    if hasattr(case, "hbm_bytes"):
        moved = case.hbm_bytes(pass_)
        floor_ms = moved / copy_gbps / 1e6 if copy_gbps else None
        row.update(hbm_bytes=moved, floor_ms=rounded(floor_ms), ours_of_floor=ratio(floor_ms, ours_ms),
                   baseline_of_floor=ratio(floor_ms, baseline_ms), ours_gbps=rate(moved, ours_ms, 1e6),
                   baseline_gbps=rate(moved, baseline_ms, 1e6))
        if "graph_ms" in ours:
            row["ours_graph_of_floor"] = ratio(floor_ms, ours["graph_ms"])
    if "peak_bytes" in ours or "peak_bytes" in theirs:
        ours_peak, baseline_peak = ours.get("peak_bytes"), theirs.get("peak_bytes")
        row.update(ours_peak_mib=mib(ours_peak), baseline_peak_mib=mib(baseline_peak), peak_ratio=ratio(ours_peak, baseline_peak))
    row.update({**dataclasses.asdict(case), **ours.get("fields", {}), **theirs.get("fields", {})})
    errors = [f"{side}: {result['error']}" for side, result in (("tk_ops", ours), (baseline, theirs)) if "error" in result]
    if errors:
        row["error"] = "; ".join(errors)
    return row


def mark_best(rows: list[dict]) -> None:
    """Fill best_baseline and ratio_vs_best into the rows of one case and pass."""
    best = min((row for row in rows if row["baseline_ms"] is not None), key=lambda row: row["baseline_ms"], default=None)
    for row in rows:
        if best is not None:
            row.update(best_baseline=best["baseline"], ratio_vs_best=ratio(best["baseline_ms"], row["ours_ms"]))


# ------------------------------------------------------------------------- the harness: cases x providers


class Missing(Exception):
    """A provider that cannot run here (an optional peer that is not installed): its rows say why."""


@functools.cache
def peer(module: str, distribution: str) -> tuple[Any, str]:
    """An optional peer package (fla, liger, mamba_ssm: imported only where installed): (the module,
    "distribution version"), or (None, why it cannot be imported)."""
    try:
        found = importlib.import_module(module)
    except Exception as error:  # not installed, or a dependency of it (triton, einops) missing
        return None, f"{distribution} not importable ({describe_error(error)})"
    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        version = getattr(found, "__version__", "?")
    return found, f"{distribution} {version}"


def need(module: str, distribution: str):
    """The peer's module, or Missing (the provider's rows then say why)."""
    found, description = peer(module, distribution)
    if found is None:
        raise Missing(description)
    return found


@dataclasses.dataclass(frozen=True)
class Provider:
    """One implementation in a comparison.

    build(case, pass_): the callable timed on an input set, returning what the check compares (a
        tensor or a sequence of tensors, compared in order); None where the provider has no form of
        that case and pass (then it has no row). Raising (Missing, ...) makes its rows say why. A
        callable may set a dict `row_fields` on itself in its first call (what it found out there,
        e.g. the kernels its compiled code calls): they go into its rows.
    prepare(case, pass_, inputs): given, turns each shared input set into this provider's own before
        it is timed (another storage order, a forward run outside the timing).
    as_ours(case, pass_, outputs): given, its outputs laid out as ours are, for the check only.
    graph: also timed as CUDA-graph replays, where the bench asks (Bench.graph_below_ms).
    measured_by(case, pass_): given, measures it elsewhere (a process of its own) into measure's dict.
    """

    name: str
    build: Callable[[Any, str], Optional[Callable]]
    prepare: Optional[Callable[[Any, str, tuple], tuple]] = None
    as_ours: Optional[Callable[[Any, str, list], list]] = None
    graph: bool = False
    measured_by: Optional[Callable[[Any, str], dict]] = None


def stepped(name: str, fn: Callable, differentiable: Optional[Sequence[int]] = None, **options) -> Provider:
    """A provider that times step(fn, backward, differentiable) on sets (*arguments, grad_out), backward in
    every pass but "fwd"."""
    return Provider(name, lambda case, pass_: step(fn, pass_ != "fwd", differentiable), **options)


@dataclasses.dataclass(frozen=True)
class Bench:
    """What a bench compares. Cases are frozen dataclasses with a `label` (the rows' "shape"), and
    optionally flops(pass_) and hbm_bytes(pass_) (the rows' TFLOP/s and HBM-floor columns).

    inputs(case, pass_, device): one input set; set_bytes(case, pass_, inputs): its bytes, which set
        how many sets rotate (at most max_sets); timer(fn, sets): ms per call on the GPU.
    graph_below_ms: CUDA-graph replays of the `graph` providers where ours takes less (ours first;
        the baselines where ours was).
    tolerance: the largest relative difference from a baseline's outputs that is not a mismatch.
    case_fields(case, device): fields every row of the case gets (a check of its own).
    sweep: (s, values): every provider runs at each value of the case field s (the cases leave it
        None); a row per value and baseline, both sides at it (the baseline named "<name>@<value>"),
        then per baseline a row of each side at its own fastest value ("<name>@best").
    peak_memory: each side's peak memory in the rows (on the GPU).
    shown: row fields the printed table shows beside its columns.
    panel(row), tick(row): the plot's panel (with the pass) and x tick of a row.
    """

    name: str
    title: str
    ours: Provider
    baselines: tuple[Provider, ...]
    inputs: Callable[[Any, str, str], tuple]
    passes: tuple[str, ...] = ("fwd",)
    set_bytes: Callable[[Any, str, tuple], int] = lambda case, pass_, inputs: case.hbm_bytes(pass_)
    max_sets: int = 16
    timer: Callable = time_ms
    graph_below_ms: Optional[float] = None
    tolerance: float = 5e-2
    case_fields: Optional[Callable[[Any, str], dict]] = None
    sweep: Optional[tuple[str, tuple]] = None
    peak_memory: bool = False
    shown: tuple[str, ...] = ()
    panel: Callable[[dict], str] = lambda row: str(row.get("group", ""))
    tick: Callable[[dict], str] = lambda row: row["shape"]


def tensors_of(result) -> list[Optional[torch.Tensor]]:
    """A call's result as the list the check compares (None where it returned no tensor)."""
    if isinstance(result, (tuple, list)):
        return [t.detach() if isinstance(t, torch.Tensor) else None for t in result]
    return [result.detach()] if isinstance(result, torch.Tensor) else []


def largest_difference(got: Sequence[Optional[torch.Tensor]], reference: Sequence[Optional[torch.Tensor]]) -> Optional[float]:
    """The largest relative_difference(got[i], reference[i]) over the pairs that both have (None if none)."""
    differences = []
    for g, r in zip(got, reference):
        if g is None or r is None:
            continue
        if g.shape != r.shape:
            raise ValueError(f"outputs of shape {tuple(g.shape)} and {tuple(r.shape)}")
        differences.append(relative_difference(g, r))
    return max(differences, default=None)


def peak_bytes(fn: Callable, inputs: tuple) -> int:
    """The most memory one call allocates beyond what was allocated before it (the inputs)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(*inputs)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def measure(provider: Provider, case, pass_: str, sets: Sequence[tuple], timer: Optional[Callable],
            ours_outputs: Optional[list] = None, graph_below_ms: Optional[float] = None,
            peak: bool = False) -> Optional[dict]:
    """One provider on one case and pass: None where it has no form of them; else a dict of "ms"
    (timer(fn, sets); none without a timer), "graph_ms" (where ms < graph_below_ms), "peak_bytes" (with
    peak: peak_bytes of a call on the first set), "fields" (the callable's row_fields after its first
    call, where it sets them), "outputs" of the first call on the first set (ours, measured without
    ours_outputs) or "rel_diff" of ours_outputs from them (a baseline's outputs are the reference), and
    "error" for what failed."""
    result = {}
    try:
        fn = provider.build(case, pass_)
        if fn is None:
            return None
        if provider.measured_by is not None:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the other process's turn: leave it the memory
            return provider.measured_by(case, pass_)
        if provider.prepare is not None:
            sets = [provider.prepare(case, pass_, inputs) for inputs in sets]
        outputs = tensors_of(fn(*sets[0]))  # also the first call: lazy initialisation, compiling
        if getattr(fn, "row_fields", None):
            result["fields"] = dict(fn.row_fields)
        if provider.as_ours is not None:
            outputs = provider.as_ours(case, pass_, outputs)
        if ours_outputs is None:
            result["outputs"] = outputs
        else:
            try:
                result["rel_diff"] = largest_difference(ours_outputs, outputs)
            except Exception as error:  # the timing stands
                result["error"] = f"no relative difference: {describe_error(error)}"
        del outputs
        if peak:
            result["peak_bytes"] = peak_bytes(fn, sets[0])
        if timer is not None:
            result["ms"] = timer(fn, sets)
        if graph_below_ms is not None and result.get("ms") is not None and result["ms"] < graph_below_ms:
            result["graph_ms"] = time_graph_ms(fn, sets)
    except Exception as error:  # a provider that cannot run this case is reported, not fatal
        result["error"] = describe_error(error)
    return result


def input_sets(bench: Bench, case, pass_: str, device) -> list[tuple]:
    """The rotation of input sets of a case and pass (one on the CPU)."""
    first = bench.inputs(case, pass_, device)
    count = input_set_count(bench.set_bytes(case, pass_, first), device, bench.max_sets)
    return [first] + [bench.inputs(case, pass_, device) for _ in range(count - 1)]


def fastest(results: dict) -> tuple:
    """(value, result) of the fastest result that has a time; (None, the first result) where none has
    one (its error says why)."""
    timed = [value for value, result in results.items() if result.get("ms") is not None]
    if not timed:
        return None, next(iter(results.values()))
    value = min(timed, key=lambda v: results[v]["ms"])
    return value, results[value]


def measure_case(bench: Bench, case, passes: Sequence[str], device, timer: Callable, copy_gbps: Optional[float] = None,
                 tflops_ceiling: Optional[float] = None) -> list[dict]:
    """The rows of one case: per pass (and value of the sweep), ours and then each baseline on one shared
    rotation of input sets."""
    torch._dynamo.reset()  # each case compiles afresh, never against the recompile limit of earlier ones
    fields = bench.case_fields(case, device) if bench.case_fields else {}
    graph_below_ms = bench.graph_below_ms if device == "cuda" else None
    peak = bench.peak_memory and device == "cuda"
    setting, values = bench.sweep or (None, (None,))

    def row(name: str, ours: dict, theirs: dict, ours_value=None, theirs_value=None) -> dict:
        compared = comparison_row(case, pass_, name, ours, theirs, bench.tolerance, copy_gbps, tflops_ceiling)
        if setting is not None:
            del compared[setting]
            compared.update({f"ours_{setting}": ours_value, f"baseline_{setting}": theirs_value})
        return {**compared, **fields}

    rows = []
    for pass_ in passes:
        sets = input_sets(bench, case, pass_, device)
        ours_at, theirs_at, pass_rows = {}, {provider.name: {} for provider in bench.baselines}, []
        for value in values:
            at = case if setting is None else dataclasses.replace(case, **{setting: value})
            ours = ours_at[value] = measure(bench.ours, at, pass_, sets, timer, peak=peak,
                                            graph_below_ms=graph_below_ms if bench.ours.graph else None)
            ours_outputs = ours.pop("outputs", [])
            baseline_graph = math.inf if "graph_ms" in ours else None  # the baselines' replays where ours has one
            for provider in bench.baselines:
                theirs = measure(provider, at, pass_, sets, timer, ours_outputs, baseline_graph if provider.graph else None,
                                 peak)
                if theirs is not None:
                    theirs_at[provider.name][value] = theirs
                    pass_rows.append(row(provider.name if setting is None else f"{provider.name}@{value}", ours, theirs,
                                         value, value))
            del ours_outputs
        for name, results in theirs_at.items() if setting is not None else ():
            (ours_value, ours), (theirs_value, theirs) = fastest(ours_at), fastest(results)
            pass_rows.append(row(f"{name}@best", ours, theirs, ours_value, theirs_value))
        mark_best(pass_rows)
        rows += pass_rows
        del sets
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def run(bench: Bench, cases: Sequence, *, device="cuda", passes: Optional[Sequence[str]] = None,
        out: Optional[pathlib.Path] = None, copy_gbps: Optional[float] = None, tflops_ceiling: Optional[float] = None,
        **header) -> list[dict]:
    """Measures every case (printing its rows, rewriting NAME.json after each), then plots NAME.png:
    into benchmarks/results and `out`; on the CPU (a dry run: each provider called once per set,
    nothing timed) into `out` only. `header`: the results file's fields beside the environment's."""
    if not cases:
        print("no cases selected")
        return []
    dry_run = device != "cuda"
    timer = run_once if dry_run else bench.timer
    out_dirs = results_dirs(out, dry_run)
    passes = passes or bench.passes
    if copy_gbps is not None:
        header = {**copy_ceiling_header(copy_gbps), **header}
    names, shown = [provider.name for provider in bench.baselines], bench.shown
    if bench.sweep:
        names = [f"{name}@{value}" for name in names for value in (*bench.sweep[1], "best")]
        shown += (f"ours_{bench.sweep[0]}", f"baseline_{bench.sweep[0]}")
    if bench.peak_memory and not dry_run:
        shown += ("ours_peak_mib", "baseline_peak_mib", "peak_ratio")
    table = Table(cases, passes, names, graph=bench.graph_below_ms is not None, extra=shown)
    print(table.header(), flush=True)
    rows = []
    for case in cases:
        case_rows = measure_case(bench, case, passes, device, timer, copy_gbps, tflops_ceiling)
        table.print(case_rows)
        rows += case_rows
        write_results(bench.name, rows, out_dirs, rel_diff_tolerance=bench.tolerance, **header)
    mismatches = sum(bool(row.get("mismatch")) for row in rows)
    if mismatches:
        print(f"MISMATCH: {mismatches} rows whose outputs differ from the baseline's by more than {bench.tolerance:g}")
    device_name = "CPU (dry run, nothing timed)" if dry_run else torch.cuda.get_device_name()
    for directory in out_dirs:
        plot(rows, directory / f"{bench.name}.png", bench.title, device_name, bench.panel, bench.tick)
    return rows


# ------------------------------------------------------------------------ a baseline in a process of its own


class Worker:
    """A bench's baselines measured in a process of its own that lives from row to row (what they compile
    and autotune stays warm): `python -m MODULE --worker [--dry-run]`, whose main calls `serve`. A call
    that fails or kills the process costs only its row (the process leaves after a failure; the next
    request starts a new one). `missing` says why none can run: the peer does not import (a new process
    would fare no better), or GIVE_UP_AFTER failures in a row without a time (each new process pays
    seconds of imports and CUDA start-up). Protocol, a line each on the process's stdout: READY <what
    serve's ready() says, JSON> or UNAVAILABLE <why>, then RESULT <measure's dict, JSON> per request (a
    JSON line on its stdin); its other output passes through."""

    PROTOCOL = ("READY", "UNAVAILABLE", "RESULT")
    GIVE_UP_AFTER = 3

    def __init__(self, module: str, dry_run: bool, env: Optional[dict] = None):
        self.command = [sys.executable, "-m", module, "--worker"] + (["--dry-run"] if dry_run else [])
        self.env = {**(env or {}), **os.environ}  # env: defaults the caller's environment may override
        self.process: Optional[subprocess.Popen] = None
        self.ready: Optional[dict] = None
        self.missing: Optional[str] = None
        self.failures_in_a_row = 0

    @property
    def about(self):
        """What the process said of itself when ready (versions), else why none can run (starts one)."""
        if self.ready is None and self.missing is None:
            self._start()
        return self.ready or self.missing

    def provider(self, provider: Provider) -> Provider:
        """provider, measured in the process."""
        return dataclasses.replace(provider, measured_by=functools.partial(self.measure, provider.name))

    def _reply(self) -> tuple[str, str]:
        """The process's next protocol line, passing its other output through; ("EXIT", why) when it ends."""
        for line in self.process.stdout:
            kind, _, payload = line.rstrip("\n").partition(" ")
            if kind in self.PROTOCOL:
                return kind, payload
            print(line, end="", flush=True)
        return "EXIT", f"worker exited with status {self.process.wait()}"

    def _start(self) -> None:
        self.process = subprocess.Popen(self.command, cwd=ROOT, env=self.env, text=True, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE)
        kind, payload = self._reply()
        if kind == "READY":
            self.ready = json.loads(payload)
        else:  # not importable, or the import itself crashed
            self.missing = payload
            self.close()

    def measure(self, name: str, case, pass_: str) -> dict:
        """measure's dict of the baseline `name` on a case and pass, from the process."""
        if self.process is None and self.missing is None:
            self._start()
        if self.missing is not None:
            return {"error": self.missing}
        try:
            self.process.stdin.write(json.dumps({"provider": name, "case": dataclasses.asdict(case), "pass": pass_}) + "\n")
            self.process.stdin.flush()
            kind, payload = self._reply()
        except BrokenPipeError:  # it died after its last reply
            kind, payload = "EXIT", f"worker exited with status {self.process.wait()}"
        result = json.loads(payload) if kind == "RESULT" else {"error": payload}
        if "error" in result:  # the process has left, or is leaving
            self.close()
        self.failures_in_a_row = 0 if "ms" in result else self.failures_in_a_row + 1
        if self.failures_in_a_row == self.GIVE_UP_AFTER:
            self.missing = f"not run after {self.GIVE_UP_AFTER} failures in a row, the last: {result['error']}"
        return result

    def close(self) -> None:
        if self.process is not None:
            try:
                self.process.stdin.close()
            except BrokenPipeError:
                pass
            self.process.wait()
            self.process = None


def serve(bench: Bench, case_type: type, dry_run: bool, ready: Callable[[], dict]) -> None:
    """A Worker's process: READY with ready()'s dict (UNAVAILABLE where it raises: the peer does not
    import), then per request on stdin the named baseline measured as `run` measures it, against ours'
    outputs computed here on the same inputs; it leaves after a failure (the CUDA context may be unusable)."""
    try:
        about = ready()
    except Exception as error:
        print("UNAVAILABLE", describe_error(error), flush=True)
        return
    print("READY", json.dumps(about), flush=True)
    device, timer = ("cpu", run_once) if dry_run else ("cuda", bench.timer)
    for line in sys.stdin:
        request = json.loads(line)
        case, pass_ = case_type(**request["case"]), request["pass"]
        provider = next(p for p in bench.baselines if p.name == request["provider"])
        try:
            sets = input_sets(bench, case, pass_, device)
            ours = measure(bench.ours, case, pass_, sets[:1], None)
            result = measure(provider, case, pass_, sets, timer, ours.pop("outputs", []),
                             peak=not dry_run and bench.peak_memory) or {"error": "no form of this case and pass"}
            if "error" in ours:  # the baseline's time stands
                result.setdefault("error", f"no relative difference: tk_ops: {ours['error']}")
            del sets, ours
        except Exception as error:
            result = {"error": describe_error(error)}
        print("RESULT", json.dumps(result), flush=True)
        if "error" in result:
            return
        if not dry_run:
            torch.cuda.empty_cache()  # the other process's turn next: leave it the memory


# ------------------------------------------------------- benches of whole runs (training, long context)

# Each row of a results file that later runs add to keeps the date, GPU and commit of the run that wrote it.
RUN_FIELDS = ("date", "gpu", "commit")


def merged_rows(name: str, rows: list[dict], out_dirs: Sequence[pathlib.Path], key_fields: Sequence[str],
                keep: Callable[[dict], bool] = lambda row: True) -> list[dict]:
    """The rows of NAME.json in the first of out_dirs that `rows` do not replace (the same values of
    key_fields) and `keep` accepts, then `rows` with this run's RUN_FIELDS (a stored row without its own
    gets its file's)."""
    path = out_dirs[0] / f"{name}.json" if out_dirs else None
    stored = []
    if path is not None and path.exists():
        document = json.loads(path.read_text())
        stored = [row | {field: document.get(field) for field in RUN_FIELDS if field not in row} for row in document["rows"]]
    run = {field: value for field, value in environment().items() if field in RUN_FIELDS}
    replaced = {tuple(row.get(field) for field in key_fields) for row in rows}
    kept = [row for row in stored if tuple(row.get(field) for field in key_fields) not in replaced and keep(row)]
    return kept + [row | run for row in rows]


def write_and_plot(name: str, rows: list[dict], out_dirs: Sequence[pathlib.Path],
                   plot_document: Callable[[dict, pathlib.Path], None], **header) -> dict:
    """write_results, then plot_document(the document, NAME.png) in each of out_dirs; the document."""
    document = write_results(name, rows, out_dirs, **header)
    for directory in out_dirs:
        plot_document(document, directory / f"{name}.png")
    return document


# Triton's autotuning results kept on disk, so that the next process (a worker, a training run) tunes
# only the kernels it has not met (mamba_ssm's).
TRITON_AUTOTUNING_CACHE = {"TRITON_CACHE_AUTOTUNING": "1"}
# A traceback's closing line: "module.Name: message" for an exception class named ...Error, ...Exception
# or ...Unavailable (compiler errors end with source lines and a caret after it).
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Unavailable)\b")


def failure_line(stderr: str) -> str:
    """The line of a failed process's stderr that names what failed."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    exceptions = [line for line in lines if EXCEPTION_LINE.match(line)]
    return (exceptions or lines or [""])[-1]


def run_process(command: Sequence[str]) -> tuple[int, str]:
    """A bench's child process (a training run, a worker) from the repository root, with
    TRITON_AUTOTUNING_CACHE (the environment may override it) and its stderr passed through: its exit
    status and, where it failed, failure_line of its stderr."""
    result = subprocess.run(command, cwd=ROOT, env={**TRITON_AUTOTUNING_CACHE, **os.environ}, stderr=subprocess.PIPE,
                            text=True)
    sys.stderr.write(result.stderr)
    return result.returncode, failure_line(result.stderr) if result.returncode else ""


# ------------------------------------------------------------------------------------ table and plot


class Table:
    """The printed rows: shape, pass and baseline, the columns the cases have, `extra` as key=value,
    then the flags (a mismatch, an error)."""

    def __init__(self, cases: Sequence, passes: Sequence[str], baselines: Sequence[str], graph: bool = False,
                 extra: Sequence[str] = ()):
        self.widths = (max(len(case.label) for case in cases), max(len("pass"), *map(len, passes)),
                       max(len("baseline"), *map(len, baselines)))
        self.columns = [("ours ms", "ours_ms", ".4f"), ("base ms", "baseline_ms", ".4f"), ("ratio", "ratio", ".3f")]
        if graph:
            self.columns.append(("graph x", "graph_ratio", ".3f"))
        if hasattr(cases[0], "flops"):
            self.columns += [("ours TF/s", "ours_tflops", ".1f"), ("base TF/s", "baseline_tflops", ".1f")]
        if hasattr(cases[0], "hbm_bytes"):
            self.columns += [("floor ms", "floor_ms", ".4f"), ("of floor", "ours_of_floor", ".3f")]
        self.columns.append(("rel diff", "rel_diff_vs_baseline", ".2e"))
        self.extra = extra

    def header(self) -> str:
        shape, pass_, baseline = self.widths
        return f"{'shape':{shape}} {'pass':{pass_}} {'baseline':{baseline}} " + " ".join(
            f"{title:>10}" for title, _, _ in self.columns)

    def line(self, row: dict) -> str:
        shape, pass_, baseline = self.widths
        cells = [f"{row[key]:>10{spec}}" if row.get(key) is not None else f"{'-':>10}" for _, key, spec in self.columns]
        notes = "".join(f" {key}={row.get(key)}" for key in self.extra)
        notes += " MISMATCH" * bool(row.get("mismatch")) + (f"  ({row['error']})" if "error" in row else "")
        return f"{row['shape']:{shape}} {row['pass']:{pass_}} {row['baseline']:{baseline}} {' '.join(cells)}{notes}"

    def print(self, rows: Sequence[dict]) -> None:
        for row in rows:
            print(self.line(row), flush=True)


BASELINE_COLORS = ("tab:blue", "tab:green", "tab:gray", "tab:orange", "tab:purple", "tab:brown", "tab:olive", "tab:cyan")


def plot(rows: Sequence[dict], path: pathlib.Path, title: str, device_name: str,
         panel: Callable[[dict], str] = Bench.panel, tick: Callable[[dict], str] = Bench.tick) -> None:
    """A panel per (panel(row), pass), a bar per provider at each case: TFLOP/s for cases that count
    flops, else ms on a log scale with the HBM floor as a tick where the cases have one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(map(panel, rows)))
    passes = list(dict.fromkeys(row["pass"] for row in rows))
    panels = [(group, pass_) for group in groups for pass_ in passes]  # a row of passes per group
    columns = len(passes) if len(passes) > 1 else min(2, len(groups))
    flops = any(row.get("flops") for row in rows)
    most_ticks = max(len({tick(row) for row in rows if panel(row) == group}) for group in groups)
    fig, axes = plt.subplots(math.ceil(len(panels) / columns), columns, squeeze=False, layout="constrained",
                             figsize=(max(7.0, 3 + 0.7 * most_ticks) * columns, 4.8 * math.ceil(len(panels) / columns)))
    for ax, (group, pass_) in itertools.zip_longest(axes.flat, panels, fillvalue=(None, None)):
        selected = [row for row in rows if panel(row) == group and row["pass"] == pass_]
        if selected:
            bar_panel(ax, selected, " ".join(filter(None, (group, pass_))), tick, flops)
        else:
            ax.axis("off")
    fig.suptitle(f"{title} on {device_name}, same run ({'TFLOP/s, higher' if flops else 'ms, lower'} is better)",
                 fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bar_panel(ax, rows: Sequence[dict], title: str, tick: Callable[[dict], str], flops: bool) -> None:
    """Per case a bar for ours (tk_ops), each baseline, and the CUDA-graph replays of each where timed."""
    ticks = list(dict.fromkeys(map(tick, rows)))
    names = ["tk_ops", *dict.fromkeys(row["baseline"] for row in rows)]
    colors = dict(zip(names, ("tab:red", *BASELINE_COLORS)))
    series = [(name, "ours_ms" if name == "tk_ops" else "baseline_ms", name) for name in names]
    series += [(f"{name} graph", key.replace("_ms", "_graph_ms"), name) for name, key, _ in series
               if any(row.get(key.replace("_ms", "_graph_ms")) is not None for row in rows)]
    width = 0.8 / len(series)
    for i, (label, key, name) in enumerate(series):
        values = []
        for t in ticks:
            row = next((r for r in rows if tick(r) == t and name in ("tk_ops", r["baseline"])), None)
            ms = None if row is None else row.get(key)
            values.append(math.nan if ms is None else row["flops"] / ms / 1e9 if flops else ms)
        graph = label.endswith(" graph")
        ax.bar([j + (i - (len(series) - 1) / 2) * width for j in range(len(ticks))], values, width, color=colors[name],
               hatch="//" if graph else None, alpha=0.5 if graph else 1.0, label=label)
    floors = [next((r.get("floor_ms") for r in rows if tick(r) == t), None) for t in ticks]
    if not flops and any(f is not None for f in floors):
        ax.plot(range(len(ticks)), [math.nan if f is None else f for f in floors], "k_", markersize=20,
                label="HBM floor (copy bandwidth)")
    ax.set_xticks(range(len(ticks)), ticks, rotation=20, fontsize=7, ha="right")
    if not flops and any(row["ours_ms"] or row["baseline_ms"] for row in rows):  # a dry run has no times
        ax.set_yscale("log")
    ax.set_ylabel("TFLOP/s" if flops else "ms")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)


# ------------------------------------------------------------------------------- the command line


def arguments(description: Optional[str], passes: Sequence[str] = (), check: bool = True,
              dry_run: str = "CPU, tiny cases, nothing timed: every provider runs, the rows print") -> argparse.ArgumentParser:
    """The options every bench shares: --out, --dry-run (what the bench's does), --plot-from, --check (a
    bench with a correctness sweep) and --pass (into args.passes; a bench that times several `passes`)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, help="also write the results and plot into this folder")
    if check:
        parser.add_argument("--check", action="store_true", help="only the correctness sweep")
    parser.add_argument("--dry-run", action="store_true", help=f"{dry_run} (JSON and plot into --out only)")
    parser.add_argument("--plot-from", type=pathlib.Path, help="only redraw the plot next to this results file")
    if passes:
        parser.add_argument("--pass", dest="passes", choices=passes, action="append",
                            help="only this pass (repeatable; default: all)")
    return parser


def without_gpu(args: argparse.Namespace, bench: Bench, dry_run_cases: Sequence, header: Callable[[], dict] = dict) -> bool:
    """--plot-from (redraw NAME.png next to a results file the bench wrote) and --dry-run (the run of
    dry_run_cases on the CPU, header() the results file's fields beside the environment's): True where one
    of them ran."""
    if args.plot_from:
        replot(args.plot_from, lambda document, path: plot(document["rows"], path, bench.title, document.get("gpu") or "CPU",
                                                           bench.panel, bench.tick))
    elif args.dry_run:
        run(bench, dry_run_cases, device="cpu", passes=getattr(args, "passes", None), out=args.out, **header())
    return bool(args.plot_from or args.dry_run)


def replot(results: pathlib.Path, plot_document: Callable[[dict, pathlib.Path], None]) -> None:
    """--plot-from: plot_document(the results file's document, the .png beside it)."""
    plot_document(json.loads(results.read_text()), results.with_suffix(".png"))


def with_defaults(args: argparse.Namespace, defaults: dict, dry_run_defaults: dict) -> argparse.Namespace:
    """args with each option of defaults that was left out (None) at its default, a dry run's where it has one."""
    for name, value in {**defaults, **(dry_run_defaults if args.dry_run else {})}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def names_of(parser: argparse.ArgumentParser, given: Optional[Sequence[str]], known: Sequence[str],
             default: Sequence[str], what: str) -> list[str]:
    """The names of a repeatable option of comma-separated names (default where it is not given); a usage
    error for a name not among known."""
    names = [name for name in ",".join(given or default).split(",") if name]
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown {what} {unknown}: choose from {', '.join(known)}")
    return names


def finish_check(summary: str, failures: Sequence[str], exit_on_failure: bool = True) -> None:
    """The end of a bench's --check sweep: the summary, each failure, and a non-zero exit on any
    (unless the caller goes on, e.g. to time what it has flagged)."""
    print(f"{summary}, {len(failures)} failures", flush=True)
    for failure in failures:
        print("  FAIL", failure)
    if failures and exit_on_failure:
        raise SystemExit(1)
