"""The results tables of README.md and benchmarks/results/<name>.md, generated from the results JSON.

    python -m benchmarks.results_tables           # rewrite every generated table in place
    python -m benchmarks.results_tables --check   # exit 1 if a table differs from its JSON (CI runs this)

A table lives between two marker lines: ``<!-- results:begin -->`` / ``<!-- results:end -->`` in a
family's record (the full table) and ``<!-- results:NAME:begin -->`` / ``<!-- results:NAME:end -->``
in README.md (a summary). Each table opens with the run's provenance (GPU, date, versions, commit,
the copy bandwidth or matrix ceiling measured in the run), so a number never loses where it came from.
Ratios are baseline time / ours: above 1 means tk_ops is faster.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
from collections import defaultdict
from typing import Callable, Iterable, Optional

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results"
README = REPO_ROOT / "README.md"

PEER_FIELDS = ("fa4", "liger", "fla", "mamba_ssm")  # the documents' peer-version fields


# ------------------------------------------------------------------------------------ formatting


def fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def ms(value: Optional[float]) -> str:
    """Milliseconds with three significant figures below 1 ms, two decimals above."""
    if value is None:
        return "-"
    return f"{value:.3g}" if value < 1 else f"{value:.2f}"


def markdown(header: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def provenance(document: dict, extra: str = "") -> str:
    """One line: where and from which code the numbers come."""
    commit = (document.get("commit") or "commit unknown")[:7]
    parts = [document.get("gpu", "GPU unknown"), (document.get("date") or "")[:10],
             f"torch {document.get('torch')} + CUDA {document.get('cuda')}", f"commit {commit}"]
    peer = document.get("peers") if isinstance(document.get("peers"), dict) else {}
    for field in PEER_FIELDS:
        version = document.get(field) if isinstance(document.get(field), str) else None
        if field == "mamba_ssm" and isinstance(document.get(field), dict):
            version = document[field].get("version")
        if version:
            parts.append(str(version) if " " in str(version) else f"{field} {version}")  # "name version" as is
    parts += [f"{name} {version}" for name, version in peer.items() if version]
    if document.get("copy_gbps"):
        parts.append(f"copy {document['copy_gbps'] / 1000:.2f} TB/s in the run")
    if document.get("ceiling_tflops"):
        parts.append(f"cuBLAS 8192^3 {document['ceiling_tflops']:.0f} TFLOP/s in the run")
    if extra:
        parts.append(extra)
    return "*" + ", ".join(p for p in parts if p) + ".*"


def by(rows: list[dict], *fields: str) -> dict:
    """rows grouped by the values of fields, in first-seen order."""
    groups: dict = defaultdict(list)
    for row in rows:
        groups[tuple(row.get(f) for f in fields)].append(row)
    return groups


def baseline_row(rows: list[dict], baseline: str) -> Optional[dict]:
    return next((r for r in rows if r.get("baseline") == baseline), None)


def ratio_of(rows: list[dict], baseline: str, key: str = "ratio") -> str:
    row = baseline_row(rows, baseline)
    return fmt(row.get(key)) if row else "-"


# ------------------------------------------------------------------------------------ families


def gemm(document: dict, summary: bool) -> str:
    header = ["group", "shape (M N K)", "layout", "dtype", "ours TFLOP/s", "cuBLAS TFLOP/s", "x cuBLAS",
              "x cuBLAS, CUDA graph"]
    rows = [r for r in document["rows"] if not summary or r.get("dtype") == "bf16"]
    body = [[r["group"], f"{r['m']} {r['n']} {r['k']}", r["layout"], r["dtype"], fmt(r["ours_tflops"], 0),
             fmt(r["baseline_tflops"], 0), fmt(r["ratio"]), fmt(r.get("graph_ratio"))] for r in rows]
    return markdown(header, body)


ATTENTION_BASELINES = ("sdpa_cudnn", "fa4")


def attention(document: dict, summary: bool) -> str:
    """Per shape: forward and default backward, TFLOP/s of ours and of cuDNN and FA4, and the ratio to
    the faster of the two (the record adds the deterministic backward)."""
    measured = {r["pass"] for r in document["rows"]}
    passes = tuple(p for p in (("fwd", "bwd") if summary else ("fwd", "bwd", "bwd_det")) if p in measured)
    header = ["shape"]
    for pass_ in passes:
        header += [f"{pass_} ours", "cuDNN", "FA4", "x faster"]
    body = []
    for (shape,), rows in by(document["rows"], "shape").items():
        if summary and not keep_in_attention_summary(rows[0]):
            continue
        line = [shape]
        for pass_ in passes:
            in_pass = [r for r in rows if r["pass"] == pass_]
            peers = {name: baseline_row(in_pass, name) for name in ATTENTION_BASELINES}
            ours = in_pass[0] if in_pass else None
            fastest = min((r["baseline_ms"] for r in peers.values() if r), default=None)
            line += [fmt(ours["ours_tflops"], 0) if ours else "-"]
            line += [fmt(peers[n]["baseline_tflops"], 0) if peers[n] else "-" for n in ATTENTION_BASELINES]
            line += [fmt(fastest / ours["ours_ms"]) if ours and fastest else "-"]
        body.append(line)
    return markdown(header, body)


# Baselines of the mask options and packed documents: compiled FlexAttention always; where a file has them,
# SDPA with the window as a dense mask (no softcap, no sinks) and SDPA cuDNN on the batch padded to the longest
# document.
AGAINST_FLEX_BASELINES = (("flex", "FlexAttention", "x Flex"), ("sdpa_masked", "masked SDPA", "x SDPA"),
                          ("sdpa_cudnn_padded", "padded cuDNN", "x cuDNN"))


def against_flex(document: dict, summary: bool) -> str:
    """The mask options, or packed documents, per pass: TFLOP/s (over the pairs the mask lets through) of
    ours and of compiled FlexAttention (and of masked SDPA where the file has it), and the ratios."""
    present = [b for b in AGAINST_FLEX_BASELINES if any(r.get("baseline") == b[0] for r in document["rows"])]
    header = ["shape", "pass", "ours TFLOP/s"] + [name for b in present for name in b[1:]]
    body = []
    for (shape, pass_), rows in by(document["rows"], "shape", "pass").items():
        line = [shape, pass_, fmt(rows[0]["ours_tflops"], 0)]
        for baseline, *_ in present:
            row = baseline_row(rows, baseline)
            line += [fmt(row.get("baseline_tflops"), 0), fmt(row.get("ratio"))] if row else ["-", "-"]
        body.append(line)
    return markdown(header, body)


def keep_in_attention_summary(row: dict) -> bool:
    return row.get("group") != "grid" or row.get("n") in (1024, 4096, 16384)


def memory_bound(baselines: tuple[str, ...], names: tuple[str, ...] = ("shape",), graph: bool = False,
                 in_summary: Callable[[dict], bool] = lambda row: True) -> Callable[[dict, bool], str]:
    """Per case and pass: our time, our fraction of the copy-bandwidth floor, the ratio to each baseline
    (the README's summary keeps the rows in_summary accepts)."""
    def table(document: dict, summary: bool) -> str:
        header = ["case", "pass", "ours ms", "of copy bandwidth"] + [f"x {b}" for b in baselines]
        if graph:
            header.append("ours, CUDA graph: of copy")
        body = []
        for key, rows in by(document["rows"], *names, "pass").items():
            first = rows[0]
            if summary and not in_summary(first):
                continue
            line = [" ".join(str(k) for k in key[:-1]), key[-1], ms(first["ours_ms"]), fmt(first.get("ours_of_floor"))]
            line += [ratio_of(rows, b) for b in baselines]
            if graph:
                line.append(fmt(first.get("ours_graph_of_floor")))
            body.append(line)
        return markdown(header, body)
    return table


def mamba2(document: dict, summary: bool) -> str:
    """Each side at its fastest chunk size, and the memory of each."""
    header = ["shape", "pass", "ours ms (chunk)", "mamba_ssm ms (chunk)", "x mamba_ssm", "of copy",
              "peak MiB ours / mamba_ssm"]
    body = []
    for r in document["rows"]:
        if not r["baseline"].endswith("@best"):
            continue
        body.append([r["shape"], r["pass"], f"{ms(r['ours_ms'])} ({r['ours_chunk']})",
                     f"{ms(r['baseline_ms'])} ({r['baseline_chunk']})", fmt(r["ratio"]), fmt(r["ours_of_floor"]),
                     f"{r['ours_peak_mib']:,.0f} / {r['baseline_peak_mib']:,.0f}"])
    return markdown(header, body)


def linear_attention(document: dict, summary: bool) -> str:
    baselines = sorted({r["baseline"] for r in document["rows"]}, key=lambda b: (b != "parallel_based", b))
    return memory_bound(tuple(baselines))(document, summary)


def overhead(document: dict, summary: bool) -> str:
    header = ["op", "pass", "ours us", "torch us", "torch / ours"]
    body = [[r["op"], r["pass"], fmt(r["ours_ms"] * 1000, 1), fmt(r["baseline_ms"] * 1000, 1), fmt(r["ratio"])]
            for r in document["rows"]]
    return markdown(header, body)


def compile_(document: dict, summary: bool) -> str:
    header = ["model", "pass", "torch.compile ms", "+ tk_ops.inductor ms", "ratio", "tk ops in the compiled code"]
    body = [[r["shape"], r["pass"], ms(r["baseline_ms"]), ms(r["ours_ms"]), fmt(r["ratio"]),
             ", ".join(op for op in r["tk_ops_called"] if not op.endswith("_bwd"))] for r in document["rows"]]
    return markdown(header, body)


def training(document: dict, summary: bool) -> str:
    """A row per run; a run with no time did not finish (out of memory)."""
    header = ["model", "preset", "variant", "tokens/s", "MFU", "peak GiB", "final eval loss", "GPU, commit"]
    body = []
    for r in document["rows"]:
        eval_loss = r.get("eval_loss") or []
        final = eval_loss[-1][1] if eval_loss else None
        finished = r["tokens_per_s"] is not None
        body.append([r["model"], r["preset"], r["variant"], fmt(r["tokens_per_s"], 0) if finished else "did not finish",
                     f"{100 * r['mfu']:.0f}%" if finished else "-", fmt(r.get("max_memory_gib"), 1), fmt(final, 3),
                     f"{r.get('gpu', document.get('gpu'))}, {(r.get('commit') or '')[:7]}"])
    return markdown(header, body)


LINEAR_CROSS_ENTROPY_BASELINES = ("eager", "compiled", "liger")


def linear_cross_entropy(document: dict, summary: bool) -> str:
    """Per shape and pass: our time and TFLOP/s (2NVH per GEMM pass the unfused form runs: one forward,
    three forward+backward), the ratio to each baseline, and each side's peak memory."""
    header = ["shape", "pass", "ours ms", "ours TFLOP/s"] + [f"x {b}" for b in LINEAR_CROSS_ENTROPY_BASELINES]
    header.append("peak GiB " + " / ".join(("ours",) + LINEAR_CROSS_ENTROPY_BASELINES))
    body = []
    for (shape, pass_), rows in by(document["rows"], "shape", "pass").items():
        first = rows[0]
        peaks = first.get("peak_gib", {})
        line = [shape, pass_, ms(first["ours_ms"]), fmt(first.get("ours_tflops"), 0)]
        line += [ratio_of(rows, b) for b in LINEAR_CROSS_ENTROPY_BASELINES]
        line.append(" / ".join(fmt(peaks.get(side)) for side in ("tk_ops",) + LINEAR_CROSS_ENTROPY_BASELINES))
        body.append(line)
    return markdown(header, body)


def long_context(document: dict, summary: bool) -> str:
    header = ["variant", "N", "B", "tokens/s", "mixer share of the step", "peak GiB"]
    body = [[r["variant"], str(r["seq_len"]), str(r["batch_size"]), fmt(r["tokens_per_s"], 0),
             fmt(r.get("mixer_share")), fmt(r.get("max_memory_gib"), 1)] for r in document["rows"]]
    return markdown(header, body)


# name -> its JSON files, each with its table; the record is benchmarks/results/<name>.md (the README
# summarises the first file, or those README_FILES lists)
FAMILIES: dict[str, tuple[tuple[str, Callable[[dict, bool], str]], ...]] = {
    "gemm": (("gemm", gemm),),
    "attention": (("attention", attention), ("attention_head_dims", attention), ("attention_features", against_flex),
                  ("attention_varlen", against_flex)),
    "decode": (("decode", memory_bound(("sdpa", "fa4"), graph=True)),),
    "norms": (("norms", memory_bound(("eager", "compiled", "liger"), ("shape",), graph=True,
                                     in_summary=lambda row: row["hidden"] in (1024, 4096, 8192))),),
    "rope": (("rope", memory_bound(("eager", "compiled", "liger"), ("name",))),),
    "conv1d": (("conv1d", memory_bound(("eager", "compiled"))),),
    "fftconv": tuple((stem, memory_bound(("torch.fft eager", "torch.fft compiled"))) for stem in ("fftconv", "fftconv_fp32")),
    "mamba2": (("mamba2", mamba2),),
    "linear_attention": (("linear_attention", linear_attention),),
    "linear_cross_entropy": (("linear_cross_entropy", linear_cross_entropy),),
    "gated_delta_rule": (("gated_delta_rule", memory_bound(("fla",))),),
    "overhead": (("overhead", overhead),),
    "compile": (("compile", compile_),),
    "training": (("training", training),),
    "long_context": (("long_context", long_context),),
}


# The files the README shows of a family (its first alone unless listed here).
README_FILES = {"attention": ("attention", "attention_head_dims", "attention_features", "attention_varlen")}


def render(name: str, summary: bool) -> str:
    files = FAMILIES[name]
    if summary:
        shown = README_FILES.get(name, (files[0][0],))
        files = tuple(file for file in files if file[0] in shown)
    parts = []
    for stem, table in files:
        document = json.loads((RESULTS / f"{stem}.json").read_text())
        label = f"`benchmarks/results/{stem}.json`"
        parts.append(f"{provenance(document, label)}\n\n{table(document, summary)}")
    return "\n\n".join(parts)


# ------------------------------------------------------------------------------------ the files


def replace_between(text: str, begin: str, end: str, body: str, where: str) -> str:
    pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{where}: no '{begin}' ... '{end}' block")
    return pattern.sub(lambda _: f"{begin}\n{body}\n{end}", text, count=1)


def generated() -> dict[pathlib.Path, str]:
    """Each file with a generated table -> its text with every table regenerated."""
    texts = {}
    readme = README.read_text()
    for name in FAMILIES:
        record = RESULTS / f"{name}.md"
        texts[record] = replace_between(record.read_text(), "<!-- results:begin -->", "<!-- results:end -->",
                                        render(name, summary=False), str(record))
        begin, end = f"<!-- results:{name}:begin -->", f"<!-- results:{name}:end -->"
        if begin in readme:
            readme = replace_between(readme, begin, end, render(name, summary=True), "README.md")
    texts[README] = readme
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report tables that differ from their JSON")
    args = parser.parse_args()
    stale = []
    for path, text in generated().items():
        if path.read_text() != text:
            stale.append(path.relative_to(REPO_ROOT))
            if not args.check:
                path.write_text(text)
    if args.check and stale:
        sys.exit("tables out of date with their JSON (run python -m benchmarks.results_tables): "
                 + ", ".join(map(str, stale)))
    print(("stale: " if args.check else "rewritten: ") + (", ".join(map(str, stale)) or "none"))


if __name__ == "__main__":
    main()
