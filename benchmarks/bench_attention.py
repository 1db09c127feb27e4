"""tk_ops.attention forward and backward against SDPA (cuDNN and flash backends) in the same run.

Shapes (../shared/anchors.md): N from 512 to 16384 with B = 16384 / N, D = 128 with H = 16 and
D = 64 with H = 32, causal and not; GQA (B = 4, Hq = 32, Hkv = 8, N = 4096, D = 128); odd N
(1000, 4097) at D = 128. TFLOP/s count 4 B H Nq Nk D for the forward (halved when causal) and 2.5x
that for the backward. Each row names its pass (fwd; bwd, the default backward; bwd_one_pass, the
one-pass dq method forced; bwd_det, deterministic=True; all three against the same baseline backward) and its baseline (sdpa_cudnn,
sdpa_flash); writes benchmarks/results/attention.json and attention.png.

Run from the repository root: python3 -m benchmarks.bench_attention [--out DIR] [--only grid gqa odd]
A small correctness pass (what compute-sanitizer runs): python3 -m benchmarks.bench_attention --check
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import tk_ops
from benchmarks import common

BASELINES = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION}
TOKENS = 16384


@dataclasses.dataclass(frozen=True)
class Case:
    group: str  # grid, gqa, odd
    batch: int
    q_heads: int
    kv_heads: int
    length: int
    head_dim: int
    causal: bool

    def flops(self, pass_name: str) -> float:
        forward = 4.0 * self.batch * self.q_heads * self.length * self.length * self.head_dim
        forward = forward / 2 if self.causal else forward
        return forward if pass_name == "fwd" else 2.5 * forward

    @property
    def shape(self) -> str:
        heads = f"H={self.q_heads}" if self.q_heads == self.kv_heads else f"Hq={self.q_heads} Hkv={self.kv_heads}"
        return f"B={self.batch} {heads} N={self.length} D={self.head_dim}" + (" causal" if self.causal else "")


def cases(groups: set[str]) -> list[Case]:
    out = []
    for causal in (False, True):
        if "grid" in groups:
            for head_dim, heads in ((128, 16), (64, 32)):
                out += [Case("grid", TOKENS // n, heads, heads, n, head_dim, causal) for n in (512, 1024, 2048, 4096, 8192, 16384)]
        if "gqa" in groups:
            out.append(Case("gqa", 4, 32, 8, 4096, 128, causal))
        if "odd" in groups:
            out += [Case("odd", max(1, TOKENS // n), 16, 16, n, 128, causal) for n in (1000, 4097)]
    return out


def make_inputs(case: Case) -> tuple:
    def heads(count):
        return torch.randn(case.batch, count, case.length, case.head_dim, device="cuda", dtype=torch.bfloat16)

    q, k, v = heads(case.q_heads), heads(case.kv_heads), heads(case.kv_heads)
    return q, k, v, torch.randn_like(q)


def ours_forward(case: Case):
    scale = case.head_dim**-0.5
    return lambda q, k, v, grad_out: torch.ops.tk.attention(q, k, v, case.causal, scale, False)


# Our backward passes: the default method for the shape, the one-pass method forced, the deterministic one.
OUR_BACKWARDS = {"bwd": (False, None), "bwd_one_pass": (False, "one_pass"), "bwd_det": (True, None)}


def ours_backward(case: Case, inputs: tuple, deterministic: bool, forced_method):
    """The backward op alone, on the forward's own out and lse (TK_OPS_ATTENTION_BACKWARD = forced_method)."""
    scale = case.head_dim**-0.5
    q, k, v, grad_out = inputs
    out, lse = torch.ops.tk.attention(q, k, v, case.causal, scale, deterministic)

    def run():
        if forced_method is not None:
            os.environ["TK_OPS_ATTENTION_BACKWARD"] = forced_method
        try:
            return torch.ops.tk.attention_bwd(grad_out, None, q, k, v, out, lse, case.causal, scale, deterministic)
        finally:
            os.environ.pop("TK_OPS_ATTENTION_BACKWARD", None)

    return run


def sdpa_forward(case: Case, backend):
    group = case.q_heads // case.kv_heads

    def run(q, k, v, grad_out):
        if group > 1:  # the fused backends take GQA as repeated K/V heads; the copy is outside the timing
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)

    return run


def sdpa_backward(case: Case, backend, inputs: tuple):
    q, k, v, grad_out = inputs
    group = case.q_heads // case.kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)
    return lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def timed_forward(fn, sets) -> float:
    return common.time_ms(fn, sets, warmup=3, rounds=10, batch=5)


def timed_backward(make, sets) -> float:
    """Each set's backward closure is built once (forward outside the timing), then rotated."""
    closures = [(make(s),) for s in sets]
    return common.time_ms(lambda run: run(), closures, warmup=3, rounds=10, batch=5)


def run_case(case: Case) -> list[dict]:
    first = make_inputs(case)
    bytes_per_set = sum(t.numel() * t.element_size() for t in first) * 2
    sets = [first] + [make_inputs(case) for _ in range(common.rotation_count(bytes_per_set, cap=4) - 1)]
    ours = {
        "fwd": timed_forward(ours_forward(case), sets),
        **{pass_name: timed_backward(lambda s: ours_backward(case, s, *method), sets)
           for pass_name, method in OUR_BACKWARDS.items()},
    }
    ours_out = ours_forward(case)(*first)[0]
    rows = []
    for name, backend in BASELINES.items():
        try:
            reference = sdpa_forward(case, backend)(*first)
            baseline = {
                "fwd": timed_forward(sdpa_forward(case, backend), sets),
                "bwd": timed_backward(lambda s: sdpa_backward(case, backend, s), sets),
            }
        except RuntimeError as error:  # the backend does not take this shape
            print(f"{case.shape}: {name} unavailable ({str(error).splitlines()[0][:80]})")
            continue
        error = rel_err(ours_out, reference)
        for pass_name in OUR_BACKWARDS:  # each of our backwards against the same baseline backward
            baseline[pass_name] = baseline["bwd"]
        for pass_name in ("fwd", *OUR_BACKWARDS):
            flops = case.flops("fwd" if pass_name == "fwd" else "bwd")
            rows.append({
                "group": case.group,
                "pass": pass_name,
                "baseline": name,
                "shape": case.shape,
                "batch": case.batch,
                "q_heads": case.q_heads,
                "kv_heads": case.kv_heads,
                "n": case.length,
                "head_dim": case.head_dim,
                "causal": case.causal,
                "dtype": "bf16",
                "ours_ms": round(ours[pass_name], 5),
                "baseline_ms": round(baseline[pass_name], 5),
                "ratio": round(baseline[pass_name] / ours[pass_name], 4),
                "ours_tflops": round(flops / ours[pass_name] / 1e9, 1),
                "baseline_tflops": round(flops / baseline[pass_name] / 1e9, 1),
                "out_rel_err_vs_baseline": float(f"{error:.3e}"),
            })
    del sets, first
    torch.cuda.empty_cache()
    return rows


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(128, False), (128, True), (64, False), (64, True)]
    fig, axes = plt.subplots(2, 4, figsize=(20, 8))
    colors = {"ours": "tab:red", "sdpa_cudnn": "tab:blue", "sdpa_flash": "tab:gray"}
    for row_axes, pass_name in zip(axes, ("fwd", "bwd")):
        for ax, (head_dim, causal) in zip(row_axes, panels):
            sel = [r for r in rows if r["group"] == "grid" and r["pass"] == pass_name and r["head_dim"] == head_dim
                   and r["causal"] == causal]
            for name in BASELINES:
                mine = [r for r in sel if r["baseline"] == name]
                if not mine:
                    continue
                xs = [r["n"] for r in mine]
                ax.plot(xs, [r["baseline_tflops"] for r in mine], "s-", color=colors[name], label=name)
                if name == "sdpa_cudnn":
                    ax.plot(xs, [r["ours_tflops"] for r in mine], "o-", color=colors["ours"], label="tk_ops")
                    deterministic = [r for r in rows if r["group"] == "grid" and r["pass"] == "bwd_det"
                                     and r["head_dim"] == head_dim and r["causal"] == causal and r["baseline"] == name]
                    if pass_name == "bwd" and deterministic:
                        ax.plot([r["n"] for r in deterministic], [r["ours_tflops"] for r in deterministic], "o--",
                                color=colors["ours"], alpha=0.5, label="tk_ops deterministic")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("N (B = 16384 / N)")
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"{pass_name} D={head_dim}{' causal' if causal else ''}", fontsize=9)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
    fig.suptitle(f"Attention on {torch.cuda.get_device_name()}: tk_ops vs SDPA cuDNN / flash (same run, bf16)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ---------------------------------------------------------------------------- correctness

CHECK_SHAPES = [  # (B, Hq, Hkv, Nq, Nk, D, causal): tails, Nq != Nk, GQA, rows that see no key
    (1, 2, 1, 1, 1, 64, False),
    (1, 2, 2, 17, 33, 128, True),
    (2, 4, 2, 130, 70, 64, True),
    (1, 2, 1, 200, 300, 128, False),
]


def check() -> None:
    """The forward against float64 SDPA (rows that see no key left out) and finite gradients, on tails,
    Nq != Nk and GQA; exits non-zero on a wrong result."""
    for batch, q_heads, kv_heads, q_len, k_len, head_dim, causal in CHECK_SHAPES:
        q = torch.randn(batch, q_heads, q_len, head_dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, kv_heads, k_len, head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        scale = head_dim**-0.5
        out, lse = torch.ops.tk.attention(q, k, v, causal, scale, False)
        grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
        grads = torch.ops.tk.attention_bwd(grad_out, grad_lse, q, k, v, out, lse, causal, scale, False)
        deterministic = torch.ops.tk.attention_bwd(grad_out, grad_lse, q, k, v, out, lse, causal, scale, True)
        methods_err = max(rel_err(a, b) for a, b in zip(grads, deterministic))
        group = q_heads // kv_heads
        expected = F.scaled_dot_product_attention(
            q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1),
            attn_mask=torch.ones(q_len, k_len, dtype=torch.bool, device="cuda").tril(k_len - q_len) if causal else None,
            scale=scale)
        seen = torch.isfinite(lse)[..., None]
        err = rel_err(out.double() * seen, torch.nan_to_num(expected) * seen)
        finite = all(torch.isfinite(g).all() for g in grads)
        status = "ok" if err < 1e-2 and methods_err < 1e-2 and finite else "WRONG"
        print(f"attention {batch}x{q_heads}/{kv_heads}x{q_len}x{k_len}x{head_dim} causal={causal}: rel err {err:.2e}, "
              f"one-pass vs deterministic grads {methods_err:.2e} {status}")
        if status != "ok":
            raise SystemExit("attention check: wrong result")
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, help="also write the results and plot into this folder")
    parser.add_argument("--only", nargs="*", default=["grid", "gqa", "odd"])
    parser.add_argument("--check", action="store_true", help="only the small correctness pass against float64")
    args = parser.parse_args()

    assert tk_ops.backends()["attention"] == "cuda kernel", f"tk_ops extension: {tk_ops.extension_status()}"
    if args.check:
        check()
        return
    rows = []
    print(f"{'shape':40} {'pass':4} {'ours TF/s':>9} {'cuDNN':>7} {'x cuDNN':>7} {'flash':>7} {'x flash':>7}")
    for case in cases(set(args.only)):
        case_rows = run_case(case)
        rows += case_rows
        for pass_name in ("fwd", *OUR_BACKWARDS):
            by = {r["baseline"]: r for r in case_rows if r["pass"] == pass_name}
            if not by:
                continue
            ours = next(iter(by.values()))["ours_tflops"]
            cells = []
            for name in BASELINES:
                r = by.get(name)
                cells += [f"{r['baseline_tflops']:7.1f}", f"{r['ratio']:7.3f}"] if r else [f"{'-':>7}", f"{'-':>7}"]
            print(f"{case.shape:40} {pass_name:4} {ours:9.1f} {' '.join(cells)}")

    out_dirs = [common.RESULTS] + ([args.out] if args.out else [])
    common.write_results("attention", rows, out_dirs,
                         flops="fwd 4 B H Nq Nk D (halved when causal), bwd 2.5x fwd; bf16")
    for directory in out_dirs:
        plot(rows, directory / "attention.png")


if __name__ == "__main__":
    main()
