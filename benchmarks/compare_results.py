"""Two trees' runs of one bench side by side: new/old time per row, and each side's run-to-run spread.

    python3 -m benchmarks.compare_results OLD.json NEW.json [OLD2.json NEW2.json ...]

The files are one bench's results (what `bench_NAME --out DIR` writes as DIR/NAME.json; gpu_session.sh's
compare:NAME passes its bench:NAME@baseline runs as OLD and its bench:NAME runs as NEW). A table row is
one timing: the case (the bench's naming fields), the pass, and the provider: tk_ops or a baseline,
"graph" for CUDA-graph replays. new/old under 1: the new tree is faster.

With several pairs, run alternately (baseline, new, baseline, new), old and new are each side's mean,
"old +-" and "new +-" each side's spread (max - min, over the mean), and "x spread" is |new/old - 1|
over the larger spread. Two runs a side tell little: rows of unchanged code (simulated, normal noise)
reach 1x spread one time in five and 2x one time in fourteen, so count a row as changed only well
above 2x (three runs a side: 2x one time in two hundred). The baselines (cuDNN, cuBLAS, ...) run the
same code on both sides: their rows show the machine's own drift and how often noise passes 2x.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import re
import statistics

# bench -> (the row fields that name its case, the field that named its pass in rows written before
# benchmarks/common.py's one row schema, or None). A row's pass is its "pass"; in older rows that
# field, else the timing's key (<provider>_<pass>_ms), else "fwd" (one pass).
ROW_NAMES = {
    "attention": (("shape",), None),
    "gemm": (("op", "shape", "dtype", "layout"), None),
    "norms": (("norm", "hidden"), "case"),
    "rope": (("case", "name"), None),  # the case's name: "case" in older rows
    "compile": (("shape",), None),
    "overhead": (("op",), None),
    "conv1d": (("shape",), None),
    "fftconv": (("shape",), None),
    "mamba2": (("shape", "ours_chunk"), None),  # ours' time differs per chunk size
    "linear_attention": (("shape",), None),
    "decode": (("shape",), None),
    "gated_delta_rule": (("shape",), None),
    "linear_cross_entropy": (("shape",), None),
}
PASS_IN_KEY = re.compile(r"(.+?)_(fwd_bwd|fwd|bwd)")


def bench_name(document: dict, path: pathlib.Path) -> str:
    """From the command that wrote the file (.../bench_NAME.py or -m benchmarks.bench_NAME), else the file name."""
    found = re.search(r"bench_(\w+)", document.get("command", ""))
    return found.group(1) if found else path.stem


def case_name(row: dict, fields: tuple[str, ...]) -> str:
    return " ".join(str(row[f]) if isinstance(row[f], str) else f"{f}={row[f]}" for f in fields if f in row)


def timings(document: dict, bench: str) -> dict[tuple[str, str, str], float]:
    """(case, pass, provider) -> milliseconds, from every `*_ms` field of every row (the HBM floor aside)."""
    fields, old_pass_field = ROW_NAMES[bench]
    found: dict[tuple[str, str, str], float] = {}
    for row in document["rows"]:
        case = case_name(row, fields)
        for key, ms in row.items():
            if not key.endswith("_ms") or key == "floor_ms" or not isinstance(ms, (int, float)) or math.isnan(ms):
                continue
            provider = key[: -len("_ms")]
            graph = provider.endswith("_graph")
            provider = provider.removesuffix("_graph")
            pass_name = row.get("pass", row.get(old_pass_field, ""))
            if not pass_name and (in_key := PASS_IN_KEY.fullmatch(provider)):
                provider, pass_name = in_key.groups()
            pass_name = pass_name or "fwd"
            provider = {"ours": "tk_ops", "baseline": row.get("baseline", "baseline")}.get(provider, provider)
            name = (case, pass_name, provider + (" graph" if graph else ""))
            if found.setdefault(name, ms) != ms:  # ours is in each baseline's row: equal
                raise SystemExit(f"{bench}: two timings named {name}; make ROW_NAMES[{bench!r}] tell them apart")
    return found


CLEAR_OF_NOISE = 2.0  # |new/old - 1| over the larger spread that the summary counts as a change


@dataclasses.dataclass(frozen=True)
class Comparison:
    name: tuple[str, str, str]  # case, pass, provider
    old: list[float]  # milliseconds, one per run
    new: list[float]

    @property
    def ratio(self) -> float:
        return statistics.fmean(self.new) / statistics.fmean(self.old)

    @staticmethod
    def spread(values: list[float]) -> float:
        return (max(values) - min(values)) / statistics.fmean(values)

    @property
    def times_spread(self) -> float:
        """|new/old - 1| over the larger of the two sides' spreads (needs two runs a side)."""
        noise = max(self.spread(self.old), self.spread(self.new))
        return abs(self.ratio - 1) / noise if noise > 0 else math.inf


def compare(documents: list[dict], bench: str) -> tuple[list[Comparison], list[tuple[str, str, str]]]:
    """The timings found in every file, a case's rows together; and those missing from some file."""
    runs = [timings(d, bench) for d in documents]
    names = list(dict.fromkeys(name for run in runs[1::2] + runs[0::2] for name in run))
    first_seen = [list(dict.fromkeys(name[i] for name in names)) for i in range(3)]
    names.sort(key=lambda name: [first_seen[i].index(part) for i, part in enumerate(name)])
    found = [n for n in names if all(n in run for run in runs)]
    rows = [Comparison(n, [run[n] for run in runs[0::2]], [run[n] for run in runs[1::2]]) for n in found]
    return rows, [n for n in names if n not in found]


def report(rows: list[Comparison], missing: list[tuple[str, str, str]]) -> None:
    repeated = bool(rows) and len(rows[0].old) > 1
    titles = ("case", "pass", "provider")
    widths = [max([len(r.name[i]) for r in rows] + [len(title)]) for i, title in enumerate(titles)]
    header = [f"{title:{w}}" for title, w in zip(titles, widths)] + [f"{'old ms':>9} {'new ms':>9} {'new/old':>7}"]
    print("\n" + " ".join(header + ([f"{'old +-':>6} {'new +-':>6} {'x spread':>8}"] if repeated else [])))
    for r in rows:
        line = [f"{part:{w}}" for part, w in zip(r.name, widths)]
        line += [f"{statistics.fmean(r.old):9.4g} {statistics.fmean(r.new):9.4g} {r.ratio:7.3f}"]
        line += [f"{r.spread(r.old):6.1%} {r.spread(r.new):6.1%} {r.times_spread:8.1f}"] if repeated else []
        print(" ".join(line))

    print(f"\nper provider: geometric mean of new/old{f', rows beyond {CLEAR_OF_NOISE:g}x spread' if repeated else ''}")
    for provider in dict.fromkeys(r.name[2] for r in rows):
        mine = [r for r in rows if r.name[2] == provider]
        beyond = sum(r.times_spread > CLEAR_OF_NOISE for r in mine) if repeated else None
        print(f"  {provider:{widths[2]}} {statistics.geometric_mean([r.ratio for r in mine]):6.3f} over {len(mine):3} rows"
              + (f"  {beyond} beyond {CLEAR_OF_NOISE:g}x spread" if repeated else ""))
    if missing:
        print(f"{len(missing)} timings not in every file (left out), e.g. {' / '.join(missing[0])}")


def describe(label: str, path: pathlib.Path, document: dict) -> str:
    commit = (document.get("commit") or "unknown")[:12]
    dirty = " (dirty)" if document.get("dirty") is True else ""
    return f"{label:5} {commit}{dirty}  {document.get('gpu', '?')}  {document.get('date', '?')}  {path}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=pathlib.Path, help="OLD NEW [OLD NEW ...], in the order they ran")
    args = parser.parse_args()
    if len(args.files) % 2:
        parser.error("give the files in pairs: OLD NEW [OLD NEW ...]")
    documents = [json.loads(path.read_text()) for path in args.files]
    benches = {bench_name(d, p) for d, p in zip(documents, args.files)}
    if len(benches) != 1:
        raise SystemExit(f"the files come from different benches: {sorted(benches)}")
    bench = benches.pop()
    if bench not in ROW_NAMES:
        raise SystemExit(f"no row naming for bench {bench!r}: add it to ROW_NAMES in {__file__}")
    for i, (path, document) in enumerate(zip(args.files, documents)):
        print(describe(f"{'old' if i % 2 == 0 else 'new'}{i // 2 + 1}", path, document))
    if len({d.get("gpu") for d in documents}) > 1:
        print("warning: the runs are from different GPUs")
    report(*compare(documents, bench))


if __name__ == "__main__":
    main()
