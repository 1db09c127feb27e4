"""tk_ops.rope_qk / tk_ops.rope against Hugging Face's rotate_half formula (eager and torch.compile)
and Liger's rope kernel, all in the same run.

Cases: the anchor (Llama GQA: q (8, 32, 4096, 128), k (8, 8, 4096, 128), bf16, HF (1, N, D) tables)
with q and k stored (B, H, N, D) and as the (B, N, H, D) projection view, multi-head D = 64, partial
rotary (D = 80, R = 32, fp16), GPT-J interleaved (D = 256, R = 64) and a single tensor. Forward and
forward + backward (the gradients through the autograd of each implementation). Liger runs on its
own storage order (B, N, H, D), in place, with no copies; it has no interleaved or single-tensor form.

GB/s counts the bytes that must cross HBM: q and k read once, the outputs written once, cos and sin
read once (fwd+bwd: the gradients too, twice in all); "of copy" is that rate over the
device-to-device copy bandwidth measured in this run. Writes benchmarks/results/rope.json and rope.png.

Run from the repository root: python3 -m benchmarks.bench_rope [--out DIR] [--check]
--check checks awkward shapes of every kernel path against float64 and times nothing (the run that
compute-sanitizer watches).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import traceback

import torch

import tk_ops
from benchmarks import common

DEVICE = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
IMPLEMENTATIONS = ("tk_ops", "eager", "compiled", "liger")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: int
    q_heads: int
    k_heads: int  # 0: tk_ops.rope on q alone
    seq_len: int
    head_dim: int
    rotary_dim: int
    dtype: str
    layout: str  # "bhnd": q, k contiguous (B, H, N, D); "bnhd": (B, N, H, D) storage seen as (B, H, N, D)
    interleaved: bool = False

    @property
    def shape(self) -> str:
        k = f" k ({self.batch},{self.k_heads},{self.seq_len},{self.head_dim})" if self.k_heads else ""
        return f"q ({self.batch},{self.q_heads},{self.seq_len},{self.head_dim}){k} R={self.rotary_dim}"

    def forward_bytes(self) -> int:
        element = DTYPES[self.dtype].itemsize
        rows = self.batch * (self.q_heads + self.k_heads) * self.seq_len
        table_entries = self.seq_len * self.rotary_dim // 2 * 2  # cos and sin, R/2 each: the half form
        return 2 * rows * self.head_dim * element + table_entries * 4


CASES = [
    Case("llama-gqa", 8, 32, 8, 4096, 128, 128, "bf16", "bhnd"),
    Case("llama-gqa-projection-view", 8, 32, 8, 4096, 128, 128, "bf16", "bnhd"),
    Case("mha-d64", 16, 16, 16, 2048, 64, 64, "bf16", "bhnd"),
    Case("partial-rotary-fp16", 8, 32, 32, 2048, 80, 32, "fp16", "bhnd"),
    Case("gptj-interleaved", 4, 16, 16, 2048, 256, 64, "bf16", "bnhd", interleaved=True),
    Case("single-tensor-q", 8, 32, 0, 4096, 128, 128, "bf16", "bhnd"),
]


# ------------------------------------------------------------------------------------ baselines


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def hf_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """HF's formula on the first R channels (cos, sin: (1, N, R), duplicated halves or pairs)."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    turn = rotate_every_two if interleaved else rotate_half
    rotary, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    rotated = rotary * cos + turn(rotary) * sin
    return torch.cat((rotated, passed), dim=-1) if passed.shape[-1] else rotated


def hf_formula(interleaved: bool):
    def apply(q, k, cos, sin):
        if k is None:
            return (hf_rotary(q, cos, sin, interleaved),)
        return hf_rotary(q, cos, sin, interleaved), hf_rotary(k, cos, sin, interleaved)

    return apply


# ---------------------------------------------------------------------------------------- inputs


def angles(case: Case) -> torch.Tensor:
    """theta (1, N, R/2) in float32: Llama's inverse frequencies times the position."""
    exponents = torch.arange(0, case.rotary_dim, 2, device=DEVICE, dtype=torch.float32) / case.rotary_dim
    positions = torch.arange(case.seq_len, device=DEVICE, dtype=torch.float32)
    return (positions[:, None] / 10000.0**exponents)[None]


def tables(case: Case) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The tables each implementation takes: HF's full (1, N, R) in x's dtype; ours the same for full
    rotary, its first half (a view) for partial rotary, the fp32 half form for GPT-J; "reference":
    ours in HF's full form in fp32."""
    theta = angles(case)
    dtype = DTYPES[case.dtype]
    full = torch.repeat_interleave(theta, 2, dim=-1) if case.interleaved else torch.cat((theta, theta), dim=-1)
    baseline = (full.cos().to(dtype), full.sin().to(dtype))
    if case.interleaved:
        ours = (theta.cos(), theta.sin())
    elif case.rotary_dim < case.head_dim:
        ours = tuple(t[..., : case.rotary_dim // 2] for t in baseline)
    else:
        ours = baseline
    reference = (full.cos(), full.sin()) if case.interleaved else tuple(t.float() for t in baseline)
    return {"ours": ours, "baseline": baseline, "reference": reference}


def heads_tensor(case: Case, heads: int, layout: str, requires_grad: bool) -> torch.Tensor:
    dtype = DTYPES[case.dtype]
    if layout == "bnhd":
        x = torch.randn(case.batch, case.seq_len, heads, case.head_dim, device=DEVICE, dtype=dtype).transpose(1, 2)
    else:
        x = torch.randn(case.batch, heads, case.seq_len, case.head_dim, device=DEVICE, dtype=dtype)
    return x.requires_grad_(requires_grad)


def input_set(case: Case, layout: str, requires_grad: bool) -> tuple:
    q = heads_tensor(case, case.q_heads, layout, requires_grad)
    k = heads_tensor(case, case.k_heads, layout, requires_grad) if case.k_heads else None
    grads = (torch.randn_like(q), torch.randn_like(k) if k is not None else None)
    return q, k, grads


# -------------------------------------------------------------------------------------- timing


def implementations(case: Case):
    """name -> (forward function (q, k, cos, sin) -> outputs, which tables, which storage order)."""

    def ours(q, k, cos, sin):
        if k is None:
            return (tk_ops.rope(q, cos, sin, interleaved=case.interleaved),)
        return tk_ops.rope_qk(q, k, cos, sin, interleaved=case.interleaved)

    formula = hf_formula(case.interleaved)
    found = {
        "tk_ops": (ours, "ours", case.layout),
        "eager": (formula, "baseline", case.layout),
        "compiled": (torch.compile(formula, fullgraph=True, dynamic=False), "baseline", case.layout),
    }
    if case.k_heads and not case.interleaved:
        try:
            from liger_kernel.transformers.functional import liger_rope
        except ImportError as error:
            print(f"  liger_kernel not importable ({error}): no Liger column")
        else:
            found["liger"] = (liger_rope, "baseline", "bnhd")
    return found


def timed(case: Case, forward, tables_used, layout: str, backward: bool) -> float:
    first = input_set(case, layout, backward)
    bytes_per_set = case.forward_bytes() * (2 if backward else 1)
    sets = [first] + [input_set(case, layout, backward) for _ in range(common.rotation_count(bytes_per_set) - 1)]
    cos, sin = tables_used

    def step(q, k, grads):
        outputs = forward(q, k, cos, sin)
        if backward:
            inputs = (q,) if k is None else (q, k)
            torch.autograd.grad(outputs, inputs, grads[: len(inputs)])

    return common.time_ms(step, sets)


def relative_error(case: Case) -> float:
    """tk_ops against the HF formula in float32 on the same inputs and tables."""
    q, k, _ = input_set(case, case.layout, False)
    all_tables = tables(case)
    if case.k_heads:
        got = tk_ops.rope_qk(q, k, *all_tables["ours"], interleaved=case.interleaved)
    else:
        got = (tk_ops.rope(q, *all_tables["ours"], interleaved=case.interleaved),)
    want = hf_formula(case.interleaved)(q.float(), k.float() if k is not None else None, *all_tables["reference"])
    num = sum(((g.float() - w) ** 2).sum() for g, w in zip(got, want))
    den = sum((w**2).sum() for w in want)
    return (num / den).sqrt().item()


def run_case(case: Case, copy_gbps: float) -> dict:
    torch._dynamo.reset()  # each case compiles afresh, never against the recompile limit of earlier ones
    row = {"case": case.name, "shape": case.shape, "dtype": case.dtype, "layout": case.layout,
           "interleaved": case.interleaved, "forward_bytes": case.forward_bytes(),
           "rel_err_vs_fp32_formula": float(f"{relative_error(case):.3e}")}
    all_tables = tables(case)
    for name, (forward, table_kind, layout) in implementations(case).items():
        for mode, backward in (("fwd", False), ("fwd_bwd", True)):
            try:
                ms = timed(case, forward, all_tables[table_kind], layout, backward)
            except Exception:  # a baseline that cannot run this case is reported, not fatal
                print(f"  {case.name} {name} {mode} failed:\n{traceback.format_exc(limit=3)}")
                continue
            gbps = case.forward_bytes() * (2 if backward else 1) / ms / 1e6
            row[f"{name}_{mode}_ms"] = round(ms, 5)
            row[f"{name}_{mode}_gbps"] = round(gbps, 1)
            row[f"{name}_{mode}_of_copy"] = round(gbps / copy_gbps, 3)
        torch.cuda.empty_cache()
    for mode in ("fwd", "fwd_bwd"):
        ours = row.get(f"tk_ops_{mode}_ms")
        baselines = {n: row[f"{n}_{mode}_ms"] for n in IMPLEMENTATIONS[1:] if f"{n}_{mode}_ms" in row}
        if ours and baselines:
            if "compiled" in baselines:
                row[f"{mode}_vs_compiled"] = round(baselines["compiled"] / ours, 3)
            best = min(baselines, key=baselines.get)
            row[f"{mode}_best_baseline"] = best
            row[f"{mode}_vs_best"] = round(baselines[best] / ours, 3)
    return row


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy of 1 GiB, bytes read plus bytes written."""
    source = torch.randn(2**28, device="cuda")
    target = torch.empty_like(source)
    ms = common.time_ms(lambda s, t: t.copy_(s), [(source, target)])
    return 2 * source.numel() * source.element_size() / ms / 1e6


# ------------------------------------------------------------------------------------- output


def plot(rows: list[dict], copy_gbps: float, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"tk_ops": "tab:red", "eager": "tab:gray", "compiled": "tab:blue", "liger": "tab:green"}
    fig, axes = plt.subplots(1, 2, figsize=(16, 5))
    width = 0.2
    for ax, mode, title in zip(axes, ("fwd", "fwd_bwd"), ("forward", "forward + backward")):
        for i, name in enumerate(IMPLEMENTATIONS):
            xs = [j + (i - 1.5) * width for j in range(len(rows))]
            ax.bar(xs, [r.get(f"{name}_{mode}_gbps", 0) / 1e3 for r in rows], width, color=colors[name], label=name)
        ax.axhline(copy_gbps / 1e3, color="black", lw=0.8, ls=":", label="device copy (this run)")
        ax.set_xticks(range(len(rows)), [r["case"] for r in rows], rotation=20, fontsize=7, ha="right")
        ax.set_ylabel("TB/s of the bytes that must cross HBM")
        ax.set_title(title)
        ax.set_ylim(0, 1.2 * copy_gbps / 1e3)
        ax.legend(fontsize=7, loc="upper left", ncol=5)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"RoPE on {torch.cuda.get_device_name()}: tk_ops vs HF eager / torch.compile / Liger (same run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(rows: list[dict]) -> None:
    print(f"{'case':28} {'mode':8} {'tk_ops ms':>9} {'eager':>8} {'compiled':>8} {'liger':>8} "
          f"{'tk TB/s':>8} {'of copy':>7} {'vs comp':>7} {'vs best':>7}")
    for r in rows:
        for mode in ("fwd", "fwd_bwd"):
            ms = [r.get(f"{n}_{mode}_ms") for n in IMPLEMENTATIONS]
            cells = " ".join(f"{m:8.4f}" if m else f"{'-':>8}" for m in ms[1:])
            print(f"{r['case']:28} {mode:8} {ms[0] or float('nan'):9.4f} {cells} "
                  f"{r.get(f'tk_ops_{mode}_gbps', float('nan')) / 1e3:8.3f} {r.get(f'tk_ops_{mode}_of_copy', float('nan')):7.3f} "
                  f"{r.get(f'{mode}_vs_compiled', float('nan')):7.3f} {r.get(f'{mode}_vs_best', float('nan')):7.3f}")


# -------------------------------------------------------------------------------- correctness


def check() -> None:
    """Every kernel path on small awkward shapes against float64; raises on a wrong result."""
    def expect(label, got, want):
        err = ((got.double() - want).norm() / want.norm()).item()
        print(f"{label:60} rel err {err:.2e}")
        if not err < 1e-2:
            raise SystemExit(f"{label}: relative error {err:.2e}")

    # (B, Hq, Hk, N, D, table width, interleaved, dtype, x offset in elements)
    shapes = [(2, 5, 3, 37, 128, 64, False, "bf16", 0), (2, 5, 3, 37, 128, 128, False, "fp16", 0),
              (3, 4, 1, 29, 80, 16, True, "bf16", 0), (1, 3, 2, 41, 64, 32, False, "fp32", 0),
              (2, 3, 2, 19, 33, 10, True, "fp16", 0), (2, 3, 2, 19, 64, 32, False, "bf16", 1)]
    for batch, hq, hk, n, d, width, interleaved, dtype_name, offset in shapes:
        dtype = DTYPES[dtype_name]
        q = torch.randn(batch * hq * n * d + offset, device=DEVICE, dtype=dtype)[offset:].view(batch, hq, n, d)
        k = torch.randn(batch, n, hk, d, device=DEVICE, dtype=dtype).transpose(1, 2)
        cos, sin = torch.randn(2, batch, n, width, device=DEVICE)
        rotary = d if width == d and not interleaved else 2 * width
        exact = [t.cpu().double() for t in (cos, sin)]
        shape = f"B={batch} N={n} D={d} R={rotary} {dtype_name} interleaved={interleaved} x offset={offset}"
        for name, op, reference in (("rope_qk", torch.ops.tk.rope_qk, torch.ops.tk.rope_ref),
                                    ("rope_qk_bwd", torch.ops.tk.rope_qk_bwd, torch.ops.tk.rope_bwd_ref)):
            for x, out in zip((q, k), op(q, k, cos, sin, interleaved)):
                expect(f"{name} H={x.shape[1]} {shape}", out.cpu(), reference(x.cpu().double(), *exact, interleaved))
        expect(f"rope H={hk} {shape}", torch.ops.tk.rope(k, cos, sin, interleaved).cpu(),
              torch.ops.tk.rope_ref(k.cpu().double(), *exact, interleaved))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, help="also write the results and plot into this folder")
    parser.add_argument("--check", action="store_true", help="check every kernel path against float64, time nothing")
    parser.add_argument("--only", nargs="*", help="case names (default: all)")
    args = parser.parse_args()

    assert tk_ops.backends()["rope_qk"] == "cuda kernel", f"tk_ops extension: {tk_ops.extension_status()}"
    if args.check:
        check()
        return
    copy_gbps = copy_bandwidth_gbps()
    print(f"device-to-device copy in this run: {copy_gbps / 1e3:.3f} TB/s")
    out_dirs = [common.RESULTS] + ([args.out] if args.out else [])
    rows = []
    for case in CASES:
        if args.only and case.name not in args.only:
            continue
        rows.append(run_case(case, copy_gbps))
        report(rows[-1:])
        # written after every case, so a run cut short keeps what it measured
        common.write_results("rope", rows, out_dirs, copy_gbps=round(copy_gbps, 1),
                             ceiling="torch copy_ of 1 GiB fp32, device to device, read + write, this run")
    print()
    report(rows)
    for directory in out_dirs:
        plot(rows, copy_gbps, directory / "rope.png")


if __name__ == "__main__":
    main()
