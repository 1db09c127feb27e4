"""tk_ops.rope_qk / tk_ops.rope against Hugging Face's rotate_half formula (eager and torch.compile)
and Liger's rope kernel, all in the same run.

Cases: the target case (Llama GQA: q (8, 32, 4096, 128), k (8, 8, 4096, 128), bf16, HF (1, N, D) tables)
with q and k stored (B, H, N, D) and as the (B, N, H, D) projection view, multi-head D = 64, partial
rotary (D = 80, R = 32, fp16), GPT-J interleaved (D = 256, R = 64) and a single tensor. Forward and
forward + backward (the gradients through the autograd of each implementation). Liger runs on its
own storage order (B, N, H, D) (the same values, copied there outside the timing), in place; it has
no interleaved or single-tensor form.

GB/s counts the bytes that must cross HBM: q and k read once, the outputs written once, cos and sin
read once (fwd_bwd: the gradients too, twice in all); ours_of_floor is that rate over the
device-to-device copy bandwidth measured in this run. Rows: benchmarks/common.py's, a row per
baseline, with rel_err_vs_fp32_formula (ours against HF's formula in fp32). Writes
benchmarks/results/rope.json and rope.png.

Run from the repository root: python3 -m benchmarks.bench_rope [--out DIR] [--only CASE ...] [--check]
--check checks awkward shapes of every kernel path against float64 and times nothing (the run that
compute-sanitizer watches); --dry-run runs every case tiny on the CPU, nothing timed.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

import tk_ops
from benchmarks import common

DEVICE = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PASSES = ("fwd", "fwd_bwd")


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
    def label(self) -> str:
        k = f" k ({self.batch},{self.k_heads},{self.seq_len},{self.head_dim})" if self.k_heads else ""
        return f"q ({self.batch},{self.q_heads},{self.seq_len},{self.head_dim}){k} R={self.rotary_dim}"

    def hbm_bytes(self, pass_: str) -> int:
        """q and k read and written once, cos and sin read once; fwd_bwd: the gradients too."""
        element = DTYPES[self.dtype].itemsize
        rows = self.batch * (self.q_heads + self.k_heads) * self.seq_len
        table_entries = self.seq_len * self.rotary_dim // 2 * 2  # cos and sin, R/2 each: the half form
        forward = 2 * rows * self.head_dim * element + table_entries * 4
        return forward * (2 if pass_ == "fwd_bwd" else 1)


CASES = [
    Case("llama-gqa", 8, 32, 8, 4096, 128, 128, "bf16", "bhnd"),
    Case("llama-gqa-projection-view", 8, 32, 8, 4096, 128, 128, "bf16", "bnhd"),
    Case("mha-d64", 16, 16, 16, 2048, 64, 64, "bf16", "bhnd"),
    Case("partial-rotary-fp16", 8, 32, 32, 2048, 80, 32, "fp16", "bhnd"),
    Case("gptj-interleaved", 4, 16, 16, 2048, 256, 64, "bf16", "bnhd", interleaved=True),
    Case("single-tensor-q", 8, 32, 0, 4096, 128, 128, "bf16", "bhnd"),
]
# --dry-run: every case's layout, table form and dtype at sizes a CPU runs in a moment
DRY_RUN_CASES = [dataclasses.replace(case, batch=1, q_heads=max(1, case.q_heads // 8), k_heads=case.k_heads // 8, seq_len=16)
                 for case in CASES]


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


def angles(case: Case, device) -> torch.Tensor:
    """theta (1, N, R/2) in float32: Llama's inverse frequencies times the position."""
    exponents = torch.arange(0, case.rotary_dim, 2, device=device, dtype=torch.float32) / case.rotary_dim
    positions = torch.arange(case.seq_len, device=device, dtype=torch.float32)
    return (positions[:, None] / 10000.0**exponents)[None]


@functools.lru_cache(maxsize=2)  # one set of tables per case, shared by all its input sets
def tables(case: Case, device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The tables each implementation takes: HF's full (1, N, R) in x's dtype; ours the same for full
    rotary, its first half (a view) for partial rotary, the fp32 half form for GPT-J; "reference":
    ours in HF's full form in fp32."""
    theta = angles(case, device)
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


def heads_tensor(case: Case, heads: int, layout: str, requires_grad: bool, device) -> torch.Tensor:
    dtype = DTYPES[case.dtype]
    if layout == "bnhd":
        x = torch.randn(case.batch, case.seq_len, heads, case.head_dim, device=device, dtype=dtype).transpose(1, 2)
    else:
        x = torch.randn(case.batch, heads, case.seq_len, case.head_dim, device=device, dtype=dtype)
    return x.requires_grad_(requires_grad)


def input_set(case: Case, requires_grad: bool, device) -> tuple:
    """(q, k or None, (grad_q, grad_k or None)) in the case's layout."""
    q = heads_tensor(case, case.q_heads, case.layout, requires_grad, device)
    k = heads_tensor(case, case.k_heads, case.layout, requires_grad, device) if case.k_heads else None
    grads = (torch.randn_like(q), torch.randn_like(k) if k is not None else None)
    return q, k, grads


def stored_bnhd(x):
    """The same values in (B, N, H, D) storage, seen as (B, H, N, D)."""
    return None if x is None else x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(x.requires_grad)


def relative_error(case: Case, device) -> float:
    """tk_ops against the HF formula in float32 on the same inputs and tables."""
    q, k, _ = input_set(case, False, device)
    all_tables = tables(case, q.device)
    if case.k_heads:
        got = tk_ops.rope_qk(q, k, *all_tables["ours"], interleaved=case.interleaved)
    else:
        got = (tk_ops.rope(q, *all_tables["ours"], interleaved=case.interleaved),)
    want = hf_formula(case.interleaved)(q.float(), k.float() if k is not None else None, *all_tables["reference"])
    num = sum(((g.float() - w) ** 2).sum() for g, w in zip(got, want))
    den = sum((w**2).sum() for w in want)
    return (num / den).sqrt().item()


# ------------------------------------------------------------------------------------ providers


def provider(name: str, forward, table_kind: str = "baseline", storage=None) -> common.Provider:
    """forward(case) -> (q, k, cos, sin) -> outputs, on the case's tables of `table_kind`; fwd_bwd also
    takes the gradients of q and k; `storage` (given) re-lays out each input set first, outside the
    timing."""

    def build(case: Case, pass_: str):
        fn = forward(case)
        if fn is None:
            return None

        def run(q, k, grads, cos, sin):
            outputs = fn(q, k, cos, sin)
            if pass_ == "fwd":
                return outputs
            inputs = (q,) if k is None else (q, k)
            return torch.autograd.grad(outputs, inputs, grads[: len(inputs)])

        return run

    def prepare(case: Case, pass_: str, inputs: tuple) -> tuple:
        q, k, grads = inputs
        if storage is not None:
            q, k, grads = storage(q), storage(k), tuple(map(storage, grads))
        return (q, k, grads, *tables(case, q.device)[table_kind])

    return common.Provider(name, build, prepare)


def ours(case: Case):
    def apply(q, k, cos, sin):
        if k is None:
            return (tk_ops.rope(q, cos, sin, interleaved=case.interleaved),)
        return tk_ops.rope_qk(q, k, cos, sin, interleaved=case.interleaved)

    return apply


def liger(case: Case):
    """Liger's kernel on its own storage order, in place; it has no interleaved or single-tensor form."""
    if not case.k_heads or case.interleaved:
        return None
    return common.need("liger_kernel.transformers.functional", "liger-kernel").liger_rope


BENCH = common.Bench(
    "rope", "RoPE: tk_ops vs HF eager / torch.compile / Liger", provider("tk_ops", ours, "ours"),
    baselines=(provider("eager", lambda case: hf_formula(case.interleaved)),
               provider("compiled", lambda case: torch.compile(hf_formula(case.interleaved), fullgraph=True, dynamic=False)),
               provider("liger", liger, storage=stored_bnhd)),
    inputs=lambda case, pass_, device: input_set(case, pass_ == "fwd_bwd", device), passes=PASSES,
    set_bytes=lambda case, pass_, inputs: case.hbm_bytes(pass_),
    case_fields=lambda case, device: {"rel_err_vs_fp32_formula": float(f"{relative_error(case, device):.3e}")},
    tick=lambda row: row["name"],
)


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


def main(argv=None) -> None:
    parser = common.arguments(__doc__, PASSES)
    parser.add_argument("--only", nargs="*", help="case names (default: all)")
    args = parser.parse_args(argv)
    if common.without_gpu(args, BENCH, [c for c in DRY_RUN_CASES if not args.only or c.name in args.only]):
        return
    assert tk_ops.backends()["rope_qk"] == "cuda kernel", f"tk_ops extension: {tk_ops.extension_status()}"
    if args.check:
        return check()
    common.run(BENCH, [c for c in CASES if not args.only or c.name in args.only], passes=args.passes, out=args.out,
               copy_gbps=common.measured_copy_bandwidth())


if __name__ == "__main__":
    main()
