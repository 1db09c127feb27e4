"""tk_ops.attention forward and backward against SDPA (cuDNN and flash backends) in the same run.

Shapes (the attention family's targets): N from 512 to 16384 with B = 16384 / N, D = 128 with H = 16 and
D = 64 with H = 32, causal and not; GQA (B = 4, Hq = 32, Hkv = 8, N = 4096, D = 128); odd N
(1000, 4097) at D = 128. TFLOP/s count 4 B H Nq Nk D for the forward (halved when causal) and 2.5x
that for the backward, which is timed alone (the forward that feeds it runs outside the timing).
Each row names its pass (fwd; bwd, the default backward; bwd_one_pass, the one-pass dq method
forced; bwd_det, deterministic=True; each backward against the baseline's backward, timed beside
it) and its baseline (sdpa_cudnn, sdpa_flash, and fa4 where FlashAttention-4 imports), with the
relative difference of ours from it (fwd: the output; the backwards: the gradients of q, k, v);
calls under GRAPH_BELOW_MS (the short forwards) are also replayed in CUDA graphs, ours and cuDNN's
(graph_ratio: the ratio without host overhead); writes benchmarks/results/attention.json and
attention.png (benchmarks/common.py's rows; the header names the commit and the FA4 version).

FlashAttention-4 (flash-attn-4, `flash_attn.cute.flash_attn_func`, its CuTe-DSL kernels; written
against 4.0.0b36): a baseline only where it imports (on the device: benchmarks/gpu_session.sh
installs the wheels that benchmarks/wheels/fa4.sh downloads); otherwise one line says it is absent and the
run goes on without its rows. It takes (B, N, H, D) tensors, GQA as fewer K/V heads: the copies into
that layout are made outside the timing, like the forward that feeds a backward. It compiles each
kernel configuration on its first call, which every provider makes before it is timed.

Run from the repository root: python3 -m benchmarks.bench_attention [--out DIR] [--only grid gqa odd]
    [--pass fwd --pass bwd ...]
The mask options (sliding window, softcap, sinks; FEATURE_CASES), forward and backward (the backward op
alone, as above), against compiled FlexAttention, into attention_features.json:
    python3 -m benchmarks.bench_attention --features [--out DIR] [--pass fwd --pass bwd]
Packed documents (attention_varlen; VARLEN_CASES), forward and forward + backward, against compiled
FlexAttention with a document mask, into attention_varlen.json: python3 -m benchmarks.bench_attention --varlen
A small correctness pass (what compute-sanitizer runs): python3 -m benchmarks.bench_attention --check
On the CPU, tiny cases, nothing timed: python3 -m benchmarks.bench_attention --dry-run [--out DIR]
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import tk_ops
from benchmarks import common

TOKENS = 16384
GROUPS = ("grid", "gqa", "odd")
# Our backward passes: (deterministic, TK_OPS_ATTENTION_BACKWARD): the default method for the shape,
# the one-pass method forced, the deterministic one.
OUR_BACKWARDS = {"bwd": (False, None), "bwd_one_pass": (False, "one_pass"), "bwd_det": (True, None)}
PASSES = ("fwd", *OUR_BACKWARDS)
# Calls shorter than this (the forwards at N <= 1024) are also timed as CUDA-graph replays, ours and
# cuDNN's: host overhead apart, so the eager ratio can be read against the device-time ratio.
GRAPH_BELOW_MS = 0.35


@dataclasses.dataclass(frozen=True)
class Case:
    group: str  # grid, gqa, odd, head_dims
    batch: int
    q_heads: int
    kv_heads: int
    n: int
    head_dim: int
    causal: bool
    dtype: str = "bf16"

    def flops(self, pass_: str) -> float:
        forward = 4.0 * self.batch * self.q_heads * self.n * self.n * self.head_dim
        forward = forward / 2 if self.causal else forward
        return forward if pass_ == "fwd" else 2.5 * forward

    @property
    def label(self) -> str:
        heads = f"H={self.q_heads}" if self.q_heads == self.kv_heads else f"Hq={self.q_heads} Hkv={self.kv_heads}"
        return f"B={self.batch} {heads} N={self.n} D={self.head_dim}" + (" causal" if self.causal else "")


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


# --dry-run: each group at sizes a CPU runs in a moment
DRY_RUN_CASES = [Case("grid", 2, 2, 2, 64, 64, False), Case("gqa", 1, 4, 2, 48, 64, True), Case("odd", 1, 2, 2, 33, 128, True)]


def make_inputs(case: Case, device="cuda") -> tuple:
    def heads(count):
        return torch.randn(case.batch, count, case.n, case.head_dim, device=device, dtype=torch.bfloat16)

    q, k, v = heads(case.q_heads), heads(case.kv_heads), heads(case.kv_heads)
    return q, k, v, torch.randn_like(q)


def call(backward):
    """bwd's timed call: the closure that each provider's prepare built per input set after running
    the forward, outside the timing."""
    return backward()


def ours(case: Case, pass_: str):
    scale = case.head_dim**-0.5
    if pass_ != "fwd":
        return call
    return lambda q, k, v, grad_out: torch.ops.tk.attention(q, k, v, case.causal, scale, False)


def ours_backward(case: Case, pass_: str, inputs: tuple) -> tuple:
    """The backwards: the backward op alone, on the forward's own out and lse, by the pass's method
    (TK_OPS_ATTENTION_BACKWARD = the method forced, during the call)."""
    if pass_ == "fwd":
        return inputs
    deterministic, forced_method = OUR_BACKWARDS[pass_]
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

    return (run,)


def sdpa_forward(case: Case, pass_: str, backend):
    if pass_ != "fwd":
        return call
    group = case.q_heads // case.kv_heads

    def run(q, k, v, grad_out):
        if group > 1:  # the fused backends take GQA as repeated K/V heads: the copy is part of the timed call
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)

    return run


def sdpa_backward(case: Case, pass_: str, inputs: tuple, backend) -> tuple:
    """The backwards: autograd's backward of SDPA alone, on repeated K/V heads for GQA."""
    if pass_ == "fwd":
        return inputs
    q, k, v, grad_out = inputs
    group = case.q_heads // case.kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)
    return (lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True),)


def kv_heads_summed(case: Case, pass_: str, outputs: list) -> list:
    """SDPA's gradients of the repeated K/V heads summed per head, as ours has them (GQA)."""
    if pass_ == "fwd":
        return outputs
    grad_q, *grad_kv = outputs
    return [grad_q, *(g.unflatten(1, (case.kv_heads, -1)).sum(2) for g in grad_kv)]


def sdpa(name: str, backend, graph: bool = False) -> common.Provider:
    return common.Provider(name, functools.partial(sdpa_forward, backend=backend),
                           prepare=functools.partial(sdpa_backward, backend=backend), as_ours=kv_heads_summed,
                           graph=graph)


# FlashAttention-4: the module and the distribution (common.peer)
FA4 = ("flash_attn.cute", "flash-attn-4")


def fa4_attention(case: Case):
    """FA4's forward as a function of (B, N, H, D) tensors, K/V with fewer heads for GQA, returning its
    (out, lse)."""
    flash_attn_func, scale = common.need(*FA4).flash_attn_func, case.head_dim**-0.5
    return lambda q, k, v: flash_attn_func(q, k, v, softmax_scale=scale, causal=case.causal)


def fa4_forward(case: Case, pass_: str):
    if pass_ != "fwd":
        return call
    attention = fa4_attention(case)
    return lambda q, k, v, grad_out: attention(q, k, v)


def fa4_prepare(case: Case, pass_: str, inputs: tuple) -> tuple:
    """The input set in FA4's (B, N, H, D) layout (contiguous copies, made here, outside the timing);
    the backwards: autograd's backward of FA4 alone, on its forward's out, for the same grad_out
    (in that layout), as the SDPA rows do."""
    *qkv, grad_out = inputs
    q, k, v = (t.transpose(1, 2).contiguous() for t in qkv)
    if pass_ == "fwd":
        return q, k, v, grad_out  # grad_out unused
    grad_out = grad_out.transpose(1, 2).contiguous()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fa4_attention(case)(q, k, v)[0]
    return (lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True),)


def fa4_as_ours(case: Case, pass_: str, outputs: list) -> list:
    """FA4's outputs in ours' (B, H, N, D) layout, for the check: the forward's out (its lse is left out),
    the gradients of q, k, v (K/V's already per K/V head)."""
    return [t.transpose(1, 2) for t in (outputs[:1] if pass_ == "fwd" else outputs)]


FA4_PROVIDER = common.Provider("fa4", fa4_forward, prepare=fa4_prepare, as_ours=fa4_as_ours)


BENCH = common.Bench(
    "attention", "Attention: tk_ops vs SDPA cuDNN / flash (bf16)",
    ours=common.Provider("tk_ops", ours, prepare=ours_backward, graph=True),
    baselines=(sdpa("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION, graph=True),
               sdpa("sdpa_flash", SDPBackend.FLASH_ATTENTION)),
    inputs=lambda case, pass_, device: make_inputs(case, device), passes=PASSES,
    set_bytes=lambda case, pass_, inputs: 2 * common.tensor_bytes(inputs), max_sets=4,
    timer=functools.partial(common.time_ms, warmup=3, rounds=10, batch=5),
    graph_below_ms=GRAPH_BELOW_MS,
    panel=lambda row: f"{row['group']} D={row['head_dim']}",
)


def with_fa4(bench: common.Bench) -> tuple[common.Bench, str]:
    """The bench with FA4 among the baselines where flash_attn.cute imports (printing which), else the
    bench as it is and one line that says FA4 is absent; and that line for the results header."""
    module, description = common.peer(*FA4)
    if module is None or not hasattr(module, "flash_attn_func"):
        description = description if module is None else f"{FA4[1]}: flash_attn.cute has no flash_attn_func"
        print(f"FlashAttention-4 absent, no fa4 rows: {description}", flush=True)
        return bench, f"absent: {description}"
    print(f"FlashAttention-4 baseline (fa4): {description}, flash_attn.cute.flash_attn_func", flush=True)
    return dataclasses.replace(bench, title=bench.title.replace(" (bf16)", " / FA4 (bf16)"),
                               baselines=(*bench.baselines, FA4_PROVIDER)), description


# ---------------------------------------------------------------------- the forward's other head dims

# The kernels' head dims beyond 64 and 128, forward and backward (the backward: D = 128's kernels on padded
# copies at 96, the split-column plans at 192 and 256, recompute; its default method), against
# cuDNN (and FA4 where it is installed): 16384 tokens, GQA 16/2 at D = 256 (Gemma's and Qwen3-Next's
# attention, the anchor's shape), MHA at 96 and 192.
HEAD_DIM_BENCH = dataclasses.replace(BENCH, name="attention_head_dims",
                                     title="Attention at D = 96, 192, 256: tk_ops vs SDPA cuDNN / flash (bf16)",
                                     passes=("fwd", "bwd"))
HEAD_DIM_CASES = [Case("head_dims", 2, q_heads, kv_heads, 8192, head_dim, causal)
                  for head_dim, q_heads, kv_heads in ((96, 16, 16), (192, 16, 16), (256, 16, 2))
                  for causal in (False, True)]
DRY_RUN_HEAD_DIM_CASES = [Case("head_dims", 1, 4, 2, 40, 96, True), Case("head_dims", 1, 2, 2, 33, 256, False)]


# ---------------------------------------------------------------------------- the mask options

@dataclasses.dataclass(frozen=True)
class FeatureCase(Case):
    """Attention with the kernels' mask options (window, softcap, sinks), Nq = Nk = n. TFLOP/s count the
    (query, key) pairs the mask lets through, as FlashAttention counts a sliding window."""
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    sinks: bool = False

    def visible_pairs(self) -> int:
        rows = torch.arange(self.n, dtype=torch.int64)
        left, right = self.window
        first = (rows - left).clamp(min=0) if left >= 0 else torch.zeros_like(rows)
        last = rows if self.causal else ((rows + right).clamp(max=self.n - 1) if right >= 0 else torch.full_like(rows, self.n - 1))
        return int((last - first + 1).clamp(min=0).sum())

    def flops(self, pass_: str) -> float:
        forward = 4.0 * self.batch * self.q_heads * self.visible_pairs() * self.head_dim
        return forward if pass_ == "fwd" else 2.5 * forward

    @property
    def label(self) -> str:
        options = [f"window={self.window}"] * (self.window != (-1, -1)) + [f"softcap={self.softcap:g}"] * bool(self.softcap)
        options += ["sinks"] * self.sinks
        return super().label + "".join(f" {o}" for o in options)


FEATURE_CASES = [
    # the plain causal kernel: how this run's FlexAttention compares with the anchors' (362 TFLOP/s)
    FeatureCase("plain", 2, 16, 16, 8192, 128, True),
    # Mistral-style causal sliding window at long context (the row: FA4 652, Flex 368)
    FeatureCase("window", 1, 16, 16, 32768, 128, True, window=(4095, -1)),
    # a local two-sided window
    FeatureCase("window", 2, 16, 16, 8192, 128, False, window=(256, 256)),
    # Gemma 2's softcap 50 (at D = 128: the kernel has no D = 256 yet)
    FeatureCase("softcap", 2, 16, 16, 8192, 128, True, softcap=50.0),
    # GPT-OSS's layers: 64 query / 8 KV heads of 64, sinks, full causal and a 128-token window
    FeatureCase("sinks", 1, 64, 8, 8192, 64, True, sinks=True),
    FeatureCase("sinks", 1, 64, 8, 8192, 64, True, window=(127, -1), sinks=True),
]
# (the CPU's compiled FlexAttention returns no lse, so the sinks' rows say so there)
DRY_RUN_FEATURE_CASES = [FeatureCase("window", 1, 4, 2, 64, 64, True, window=(15, -1), softcap=5.0),
                         FeatureCase("window", 1, 2, 2, 48, 128, False, window=(8, 4)),
                         FeatureCase("sinks", 1, 4, 2, 64, 64, True, sinks=True)]


def feature_sinks(case: FeatureCase, device) -> torch.Tensor | None:
    """Each query head's sink logit (fixed, so every provider sees the same)."""
    if not case.sinks:
        return None
    return torch.randn(case.q_heads, generator=torch.Generator().manual_seed(0)).to(device)


def options_arguments(case: FeatureCase, device) -> tuple:
    """tk::attention's trailing arguments for the case: causal, scale, deterministic, window, softcap, sinks."""
    return (case.causal, case.head_dim**-0.5, False, *case.window, case.softcap, feature_sinks(case, device))


def ours_with_options(case: FeatureCase, pass_: str):
    if pass_ != "fwd":
        return call
    return lambda q, k, v, grad_out: torch.ops.tk.attention(q, k, v, *options_arguments(case, q.device))


def ours_options_backward(case: FeatureCase, pass_: str, inputs: tuple) -> tuple:
    """bwd: the backward op alone on the forward's out and lse (the forward runs here, outside the timing);
    it returns the sinks' gradient too, which the check leaves out (Flex's gradients are of q, k, v)."""
    if pass_ == "fwd":
        return inputs
    q, k, v, grad_out = inputs
    arguments = options_arguments(case, q.device)
    out, lse = torch.ops.tk.attention(q, k, v, *arguments)
    return (lambda: torch.ops.tk.attention_bwd(grad_out, None, q, k, v, out, lse, *arguments),)


def flex_with_options(case: FeatureCase, pass_: str):
    """FlexAttention (compiled): the window and causality as a block mask (made once, outside the timing),
    the softcap as a score_mod, the sinks folded in afterwards from its lse: out * sigmoid(lse - sink)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    left, right = case.window

    def visible(b, h, q_idx, kv_idx):
        keep = (q_idx >= 0) & (kv_idx >= 0)
        if case.causal:
            keep = keep & (kv_idx <= q_idx)
        elif right >= 0:
            keep = keep & (kv_idx - q_idx <= right)
        if left >= 0:
            keep = keep & (q_idx - kv_idx <= left)
        return keep

    def capped(score, b, h, q_idx, kv_idx):
        return case.softcap * torch.tanh(score / case.softcap)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    masked = case.causal or case.window != (-1, -1)
    block_mask = create_block_mask(visible, None, None, case.n, case.n, device=device) if masked else None
    attend = torch.compile(flex_attention, dynamic=False)
    sinks = feature_sinks(case, device)

    def forward(q, k, v):
        result = attend(q, k, v, score_mod=capped if case.softcap else None, block_mask=block_mask,
                        scale=case.head_dim**-0.5, enable_gqa=case.q_heads != case.kv_heads, return_lse=sinks is not None)
        if sinks is None:
            return result
        out, lse = result
        return out * torch.sigmoid(lse - sinks.view(1, -1, 1)).unsqueeze(-1).to(out.dtype)

    return timed_pass(FLEX_FORWARDS, case, pass_, forward)


# Each case's compiled FlexAttention forward (flex_with_options), for its bwd prepare (stored_forward_backward).
FLEX_FORWARDS: dict = {}


def timed_pass(forwards: dict, case: FeatureCase, pass_: str, forward):
    """A baseline's timed call: fwd, its forward on (q, k, v); bwd, the backward closure its prepare made
    (stored_forward_backward), the forward stored in ``forwards`` for that prepare."""
    if pass_ == "fwd":
        return lambda q, k, v, grad_out: forward(q, k, v)
    forwards[case] = forward
    return call


def stored_forward_backward(forwards: dict):
    """A bwd prepare: autograd's backward alone of the case's forward that the provider's build stored in
    ``forwards``, on that forward's out (run here, outside the timing)."""
    def prepare(case: FeatureCase, pass_: str, inputs: tuple) -> tuple:
        if pass_ == "fwd":
            return inputs
        q, k, v, grad_out = inputs
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = forwards[case](q, k, v)
        return (lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True),)

    return prepare


def masked_sdpa(case: FeatureCase, pass_: str):
    """SDPA as a model calls it for the case: a window as a dense boolean mask (made once, outside the timing;
    the call the Inductor rewrite would replace, tk_ops/inductor/attention.py), causality alone as is_causal.
    No row for a softcap or sinks, which SDPA does not take."""
    if case.softcap or case.sinks:
        return None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mask = None
    if case.window != (-1, -1):
        left, right = case.window[0], 0 if case.causal else case.window[1]
        key_minus_query = torch.arange(case.n, device=device)[None, :] - torch.arange(case.n, device=device)[:, None]
        mask = torch.ones(case.n, case.n, dtype=torch.bool, device=device)
        if left >= 0:
            mask &= key_minus_query >= -left
        if right >= 0:
            mask &= key_minus_query <= right

    def forward(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=case.causal and mask is None,
                                              scale=case.head_dim**-0.5, enable_gqa=case.q_heads != case.kv_heads)

    return timed_pass(MASKED_SDPA_FORWARDS, case, pass_, forward)


# Each case's masked SDPA forward (masked_sdpa), for its bwd prepare (stored_forward_backward).
MASKED_SDPA_FORWARDS: dict = {}


FEATURES_BENCH = common.Bench(
    "attention_features", "Attention with window / softcap / sinks: tk_ops vs FlexAttention / masked SDPA (bf16)",
    ours=common.Provider("tk_ops", ours_with_options, prepare=ours_options_backward),
    baselines=(common.Provider("flex", flex_with_options, prepare=stored_forward_backward(FLEX_FORWARDS)),
               common.Provider("sdpa_masked", masked_sdpa, prepare=stored_forward_backward(MASKED_SDPA_FORWARDS))),
    inputs=lambda case, pass_, device: make_inputs(case, device), passes=("fwd", "bwd"),
    set_bytes=lambda case, pass_, inputs: 2 * common.tensor_bytes(inputs), max_sets=4,
    timer=functools.partial(common.time_ms, warmup=3, rounds=10, batch=5),
    panel=lambda row: row["group"],
)


# ---------------------------------------------------------------------------- packed sequences

@dataclasses.dataclass(frozen=True)
class VarlenCase:
    """Causal attention over documents packed into one (total, H, D) batch (attention_varlen), H = 16."""
    group: str
    lengths: tuple[int, ...]
    heads: int = 16
    head_dim: int = 128
    dtype: str = "bf16"

    def flops(self, pass_: str) -> float:
        forward = sum(4.0 * self.heads * self.head_dim * length * (length + 1) / 2 for length in self.lengths)
        return forward if pass_ == "fwd" else 3.5 * forward  # fwd+bwd: the forward and its 2.5x backward

    @property
    def label(self) -> str:
        return (f"{len(self.lengths)} docs of {min(self.lengths)}-{max(self.lengths)} ({sum(self.lengths)} tokens) "
                f"H={self.heads} D={self.head_dim} causal")


# The packed batch (13 documents of 128-4096 tokens; FA4 454 TFLOP/s forward there, another run) and
# 64 short documents (a Bible chapter's size: where a launch per sequence costs most).
VARLEN_CASES = [
    VarlenCase("packed", (4096, 3584, 3072, 2816, 2560, 2304, 2048, 1792, 1536, 1280, 1024, 512, 128)),
    VarlenCase("packed", tuple(64 + (37 * i) % 961 for i in range(64))),
]
DRY_RUN_VARLEN_CASES = [VarlenCase("packed", (5, 17, 1), heads=2, head_dim=16)]


def varlen_inputs(case: VarlenCase, pass_: str, device) -> tuple:
    total = sum(case.lengths)
    shape = (total, case.heads, case.head_dim)
    q, k, v, grad_out = (torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(4))
    return (*(t.requires_grad_() for t in (q, k, v)), grad_out)


def cu_seqlens(case: VarlenCase, device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(case.lengths)], dtype=torch.int32, device=device)


def ours_varlen(case: VarlenCase, pass_: str):
    cu = cu_seqlens(case, "cuda" if torch.cuda.is_available() else "cpu")
    longest = max(case.lengths)

    def attend(q, k, v):
        return tk_ops.attention_varlen(q, k, v, cu.to(q.device), cu.to(q.device), longest, longest, causal=True)
    return common.step(attend, pass_ != "fwd")


def flex_varlen(case: VarlenCase, pass_: str):
    """Compiled FlexAttention on the packed batch as one (1, H, total, D) sequence with a document mask (the
    block mask made once, outside the timing)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    document = torch.repeat_interleave(torch.arange(len(case.lengths), device=device),
                                       torch.tensor(case.lengths, device=device))

    def same_document_causal(b, h, q_idx, kv_idx):
        return (document[q_idx] == document[kv_idx]) & (kv_idx <= q_idx)

    total = sum(case.lengths)
    block_mask = create_block_mask(same_document_causal, None, None, total, total, device=device)
    attend = torch.compile(flex_attention, dynamic=False)

    def packed(q, k, v):
        return attend(*(t.transpose(0, 1)[None] for t in (q, k, v)), block_mask=block_mask)[0].transpose(0, 1)
    return common.step(packed, pass_ != "fwd")


def padded(case: VarlenCase, packed: torch.Tensor) -> torch.Tensor:
    """Packed (total, H, X) rows as a right-padded (B, H, longest, X) batch, zeros past each document."""
    batch = packed.new_zeros(len(case.lengths), max(case.lengths), *packed.shape[1:])
    for b, (start, length) in enumerate(zip(itertools.accumulate((0, *case.lengths)), case.lengths)):
        batch[b, :length] = packed[start:start + length]
    return batch.transpose(1, 2)


def unpadded(case: VarlenCase, batch: torch.Tensor) -> torch.Tensor:
    """padded's inverse: each document's rows of a (B, H, longest, X) batch, packed again."""
    return torch.cat([batch[b, :, :length].transpose(0, 1) for b, length in enumerate(case.lengths)])


def sdpa_padded(case: VarlenCase, pass_: str):
    """SDPA's cuDNN backend on the batch padded to the longest document (what a padded batch costs: every
    document as long as the longest; right padding under is_causal leaves the real rows exact)."""
    def attend(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return common.step(attend, pass_ != "fwd")


def pad_inputs(case: VarlenCase, pass_: str, inputs: tuple) -> tuple:
    """The padded batch, made outside the timing (a padded batch is what such a model already holds)."""
    q, k, v, grad_out = inputs
    return (*(padded(case, t.detach()).requires_grad_() for t in (q, k, v)), padded(case, grad_out))


VARLEN_BENCH = common.Bench(
    "attention_varlen", "Packed documents (attention_varlen): tk_ops vs FlexAttention with a document mask and "
    "padded SDPA cuDNN (bf16)",
    ours=common.Provider("tk_ops", ours_varlen),
    baselines=(common.Provider("flex", flex_varlen),
               common.Provider("sdpa_cudnn_padded", sdpa_padded, prepare=pad_inputs,
                               as_ours=lambda case, pass_, outputs: [unpadded(case, t) for t in outputs])),
    inputs=varlen_inputs, passes=("fwd", "fwd+bwd"),
    set_bytes=lambda case, pass_, inputs: 2 * common.tensor_bytes(inputs), max_sets=4,
    timer=functools.partial(common.time_ms, warmup=3, rounds=10, batch=5),
)


# ---------------------------------------------------------------------------- correctness

CHECK_SHAPES = [  # (B, Hq, Hkv, Nq, Nk, D, causal): tails, Nq != Nk, GQA, rows that see no key
    (1, 2, 1, 1, 1, 64, False),
    (1, 2, 2, 17, 33, 128, True),
    (2, 4, 2, 130, 70, 64, True),
    (1, 2, 1, 200, 300, 128, False),
    (1, 4, 2, 200, 300, 96, True),  # the other head dims (gradients: 96 on the padded D = 128 kernels, 192
    # and 256 on the split-column plans)
    (1, 2, 1, 130, 200, 192, False),
    (1, 4, 1, 100, 333, 256, True),
]


# The kernels' options: (batch, Hq, Hkv, Nq, Nk, D, causal, window_left, window_right, softcap), each with
# random sinks, forward and backward. A causal sliding window that skips key blocks; a two-sided window where
# rows past the keys see none (their out is 0, their lse the sink).
CHECK_OPTION_SHAPES = [
    (1, 2, 1, 300, 700, 128, True, 150, -1, 2.0),
    (2, 4, 2, 333, 200, 64, False, 40, 90, 0.0),
    (1, 2, 2, 260, 300, 128, True, 100, -1, 0.0),
    (1, 2, 1, 200, 260, 64, True, -1, -1, 3.0),
    (1, 2, 1, 150, 260, 256, True, 60, -1, 2.0),
    (1, 4, 2, 130, 260, 192, True, -1, -1, 0.0),
]


def options_expected(q, k, v, causal, scale, left, right, softcap, sinks):
    """out and lse in float64, as tk_ops/ops/attention.py defines them (the sinks keep every lse finite)."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = scale * q @ k.transpose(-1, -2)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    diagonal = torch.arange(q.shape[2], device=q.device)[:, None] + k.shape[2] - q.shape[2]
    keys = torch.arange(k.shape[2], device=q.device)[None, :]
    visible = torch.ones_like(keys - diagonal, dtype=torch.bool)
    if left >= 0:
        visible &= keys >= diagonal - left
    if causal or right >= 0:
        visible &= keys <= diagonal + (0 if causal else right)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(torch.cat([scores, sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], -1), -1)
    return torch.exp(scores - lse[..., None]) @ v, lse


def check_options() -> None:
    for batch, q_heads, kv_heads, q_len, k_len, head_dim, causal, left, right, softcap in CHECK_OPTION_SHAPES:
        q = torch.randn(batch, q_heads, q_len, head_dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, kv_heads, k_len, head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        sinks = torch.randn(q_heads, device="cuda")
        scale = head_dim**-0.5
        out, lse = torch.ops.tk.attention(q, k, v, causal, scale, False, left, right, softcap, sinks)
        expected_out, expected_lse = options_expected(q, k, v, causal, scale, left, right, softcap, sinks)
        err = max(common.relative_difference(out.double(), expected_out),
                  common.relative_difference(lse.double(), expected_lse))
        err = max(err, options_backward_error(q, k, v, causal, scale, left, right, softcap, sinks, out, lse))
        status = "ok" if err < 1e-2 else "WRONG"
        print(f"attention {batch}x{q_heads}/{kv_heads}x{q_len}x{k_len}x{head_dim} causal={causal} "
              f"window=({left}, {right}) softcap={softcap} sinks: rel err {err:.2e} (forward, and backward by both "
              f"methods) {status}")
        if status != "ok":
            raise SystemExit("attention check: wrong result")


# Packed sequences for check_packed: an empty one, one with queries but no key, tails across block edges.
CHECK_PACKED_LENGTHS = ([129, 0, 300, 7], [200, 5, 300, 0])


def check_packed() -> None:
    """attention_varlen's packed kernels against the dense kernels (checked above) sequence by sequence,
    forward and backward by both methods, with a window, a softcap and sinks; then lengths that break every
    rule (decreasing, out of range), which the kernels must clamp: no access outside the tensors (what
    memcheck watches)."""
    q_lengths, k_lengths = CHECK_PACKED_LENGTHS
    q = torch.randn(sum(q_lengths), 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(k_lengths), 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sinks = torch.randn(4, device="cuda")
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device="cuda")
                  for n in (q_lengths, k_lengths))
    options = (True, 0.125, 50, -1, 2.0, sinks)
    sizes = (max(q_lengths), max(k_lengths))
    out, lse = torch.ops.tk.attention_varlen(q, k, v, cu_q, cu_k, *sizes, *options, False)
    grad_out = torch.randn_like(out)
    err = 0.0
    for deterministic in (False, True):
        grads = torch.ops.tk.attention_varlen_bwd(grad_out, None, q, k, v, out, lse, cu_q, cu_k, *sizes, *options,
                                                  deterministic)
        grad_sinks = torch.zeros_like(sinks)
        for b in range(len(q_lengths)):
            rows = slice(cu_q[b].item(), cu_q[b + 1].item())
            keys = slice(cu_k[b].item(), cu_k[b + 1].item())
            if q_lengths[b] == 0 or k_lengths[b] == 0:
                err = max(err, out[rows].abs().max().item() if q_lengths[b] else 0.0)
                continue
            dense = [t[part].transpose(0, 1)[None] for t, part in ((q, rows), (k, keys), (v, keys))]
            dense_out, dense_lse = torch.ops.tk.attention(*dense, *options[:2], deterministic, *options[2:])
            dense_grads = torch.ops.tk.attention_bwd(grad_out[rows].transpose(0, 1)[None], None, *dense, dense_out,
                                                     dense_lse, *options[:2], deterministic, *options[2:])
            pairs = [(out[rows], dense_out[0].transpose(0, 1)), (lse[:, rows], dense_lse[0])]
            pairs += [(g[part], d[0].transpose(0, 1)) for g, d, part in zip(grads, dense_grads, (rows, keys, keys))]
            err = max(err, *(common.relative_difference(a.double(), b.double()) for a, b in pairs))
            grad_sinks += dense_grads[3]
        err = max(err, common.relative_difference(grads[3].double(), grad_sinks.double()))
    status = "ok" if err < 1e-2 else "WRONG"
    print(f"attention_varlen {q_lengths}x{k_lengths} causal window=(50, -1) softcap=2.0 sinks: rel diff {err:.2e} "
          f"from the dense kernels per sequence (forward, and backward by both methods) {status}")
    if status != "ok":
        raise SystemExit("attention check: wrong result")
    bad_q, bad_k = (torch.tensor(n, dtype=torch.int32, device="cuda") for n in ([7, -100, 1 << 30, 2, 5],
                                                                                  [0, 1 << 30, 3, -7, 900]))
    for deterministic in (False, True):
        out, lse = torch.ops.tk.attention_varlen(q, k, v, bad_q, bad_k, *sizes, *options, deterministic)
        torch.ops.tk.attention_varlen_bwd(grad_out, None, q, k, v, out, lse, bad_q, bad_k, *sizes, *options,
                                          deterministic)
    torch.cuda.synchronize()
    print("attention_varlen with lengths that break every rule: no fault")


def check_kvcache() -> None:
    """attention_with_kvcache on a dense cache (the packed forward kernel) against the float64 reference on
    the CPU: NaN in every unused slot, lengths around the 128-key blocks (an empty cache, one key into a
    block, a block exactly full), an append, GQA 4, a window and a softcap; then lengths past the capacity
    and negative ones, which must stay in their rows (no fault, the spare rows untouched)."""
    lengths, q_len, new_len, capacity = [0, 5, 127, 128, 129, 300], 2, 1, 384
    q = torch.randn(len(lengths), q_len, 8, 128, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.full((len(lengths) + 1, capacity, 2, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    for b, length in enumerate(lengths):
        k_cache[b, :length] = torch.randn(length, 2, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = k_cache.clone()
    k, v = (torch.randn(len(lengths), new_len, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    options = (True, 0.1, 200, -1, 2.0, None)
    cpu = [t.cpu().double() for t in (q, k_cache, v_cache, k, v)]
    out, lse = torch.ops.tk.attention_with_kvcache(q, k_cache, v_cache, k, v, seqlens, None, *options)
    want_out, want_lse = torch.ops.tk.attention_with_kvcache(*cpu, seqlens.cpu(), None, *options)
    # the empty cache's first query sees no key: its lse is -inf on both sides, compared as such
    lse, want_lse = lse.double().cpu(), want_lse.double()
    seen = torch.isfinite(want_lse)
    lse_err = (common.relative_difference(lse[seen], want_lse[seen])
               if torch.equal(seen, torch.isfinite(lse)) and (lse[~seen] == want_lse[~seen]).all() else math.inf)
    err = max(common.relative_difference(out.double().cpu(), want_out), lse_err,
              common.relative_difference(k_cache.double().cpu().nan_to_num(), cpu[1].nan_to_num()))
    status = "ok" if err < 1e-2 and torch.isfinite(out).all() else "WRONG"
    print(f"attention_with_kvcache dense {lengths} + {new_len}, Nq={q_len}, GQA 8/2, D=128, window 200, softcap 2: "
          f"rel err {err:.2e} {status}")
    if status != "ok":
        raise SystemExit("attention check: wrong result")
    seqlens.copy_(torch.tensor([-9, 1000, 318, 319, 5, 0], dtype=torch.int32))
    torch.ops.tk.attention_with_kvcache(q, k_cache, v_cache, k, v, seqlens, None, *options)
    torch.cuda.synchronize()
    if not k_cache[len(lengths):].isnan().all():
        raise SystemExit("attention check: an append left its sequence's cache row")
    print("attention_with_kvcache with lengths past the capacity: no fault, every write in its own row")
    # The same cache as 128-position pages, the pool's rows shuffled, then a decode step (Nq = 1, split-KV).
    pages = k_cache[: len(lengths)].unflatten(1, (-1, 128))  # (B, pages per row, 128, 2, 128)
    order = torch.randperm(pages.shape[0] * pages.shape[1], device="cuda")
    pool_k = pages.flatten(0, 1)[order]
    pool_v = v_cache[: len(lengths)].unflatten(1, (-1, 128)).flatten(0, 1)[order]
    table = torch.argsort(order).view(len(lengths), -1).to(torch.int32)
    seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
    one = q[:, :1].contiguous()
    out, lse = torch.ops.tk.attention_with_kvcache(one, pool_k, pool_v, None, None, seqlens, table, *options[:2],
                                                   -1, -1, 2.0, None)
    cpu = [t.cpu().double() for t in (one, pool_k, pool_v)]
    want_out, _ = torch.ops.tk.attention_with_kvcache(*cpu, None, None, seqlens.cpu(), table.cpu(), *options[:2],
                                                      -1, -1, 2.0, None)
    err = common.relative_difference(out.double().cpu(), want_out)
    status = "ok" if err < 1e-2 and torch.isfinite(out).all() else "WRONG"
    print(f"attention_with_kvcache paged (128-position pages, shuffled pool), Nq=1: rel err {err:.2e} {status}")
    if status != "ok":
        raise SystemExit("attention check: wrong result")


def sink_gradient_scale(sinks, out, lse, grad_out, grad_lse) -> torch.Tensor:
    """Per head, the root sum of squares of its sink gradient's terms, one per row: p_sink (dlse - dO . out).
    The terms cancel (a sum of a few units from terms of size ~1 over a thousand rows), so the sum's own size
    is no scale to judge it by."""
    delta = (grad_out.double() * out.detach().double()).sum(-1)
    terms = torch.exp(sinks.detach().double()[:, None] - lse.detach().double()) * (grad_lse.double() - delta)
    return terms.square().sum((0, 2)).sqrt()


def options_backward_error(q, k, v, causal, scale, left, right, softcap, sinks, out, lse) -> float:
    """The largest relative difference of the backward kernels' dq, dk, dv (one-pass and recompute) from
    float64 autograd of options_expected, for random dO and dlse; dsinks relative to the scale of its terms."""
    leaves64 = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    expected_out, expected_lse = options_expected(*leaves64[:3], causal, scale, left, right, softcap, leaves64[3])
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    expected = torch.autograd.grad((expected_out * grad_out.double()).sum() + (expected_lse * grad_lse.double()).sum(),
                                   leaves64)
    sinks_scale = sink_gradient_scale(sinks, expected_out, expected_lse, grad_out, grad_lse).clamp_min(1e-30)
    err = 0.0
    for deterministic in (False, True):
        os.environ["TK_OPS_ATTENTION_BACKWARD"] = "recompute" if deterministic else "one_pass"
        try:
            grads = torch.ops.tk.attention_bwd(grad_out, grad_lse, q, k, v, out, lse, causal, scale, deterministic,
                                               left, right, softcap, sinks)
        finally:
            os.environ.pop("TK_OPS_ATTENTION_BACKWARD", None)
        err = max(err, *(common.relative_difference(g.double(), e) for g, e in zip(grads[:3], expected[:3])))
        err = max(err, ((grads[3].double() - expected[3]).abs() / sinks_scale).max().item())
    return err


def check() -> None:
    """The forward against float64 SDPA (rows that see no key left out) and finite gradients, on tails,
    Nq != Nk and GQA, then the forward and backward with window, softcap and sinks against float64; exits non-zero
    on a wrong result."""
    for batch, q_heads, kv_heads, q_len, k_len, head_dim, causal in CHECK_SHAPES:
        q = torch.randn(batch, q_heads, q_len, head_dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, kv_heads, k_len, head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        scale = head_dim**-0.5
        out, lse = torch.ops.tk.attention(q, k, v, causal, scale, False)
        grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
        grads = torch.ops.tk.attention_bwd(grad_out, grad_lse, q, k, v, out, lse, causal, scale, False)
        deterministic = torch.ops.tk.attention_bwd(grad_out, grad_lse, q, k, v, out, lse, causal, scale, True)
        methods_err = max(common.relative_difference(a, b) for a, b in zip(grads, deterministic))
        group = q_heads // kv_heads
        expected = F.scaled_dot_product_attention(
            q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1),
            attn_mask=torch.ones(q_len, k_len, dtype=torch.bool, device="cuda").tril(k_len - q_len) if causal else None,
            scale=scale)
        seen = torch.isfinite(lse)[..., None]
        err = common.relative_difference(out.double() * seen, torch.nan_to_num(expected) * seen)
        finite = all(torch.isfinite(g).all() for g in grads)
        status = "ok" if err < 1e-2 and methods_err < 1e-2 and finite else "WRONG"
        print(f"attention {batch}x{q_heads}/{kv_heads}x{q_len}x{k_len}x{head_dim} causal={causal}: rel err {err:.2e}, "
              f"one-pass vs deterministic grads {methods_err:.2e} {status}")
        if status != "ok":
            raise SystemExit("attention check: wrong result")
    check_options()
    check_packed()
    check_kvcache()
    torch.cuda.synchronize()


def main(argv=None) -> None:
    parser = common.arguments(__doc__, passes=PASSES)
    parser.add_argument("--only", nargs="*", choices=GROUPS, default=list(GROUPS))
    parser.add_argument("--features", action="store_true",
                        help="instead: window, softcap and sinks against FlexAttention (attention_features.json)")
    parser.add_argument("--varlen", action="store_true",
                        help="instead: packed documents (attention_varlen) against FlexAttention (attention_varlen.json)")
    parser.add_argument("--head-dims", action="store_true",
                        help="instead: D = 96, 192, 256, forward and backward, against cuDNN and FA4 (attention_head_dims.json)")
    args = parser.parse_args(argv)
    if args.head_dims:
        bench, fa4 = with_fa4(HEAD_DIM_BENCH)
        if common.without_gpu(args, bench, DRY_RUN_HEAD_DIM_CASES):
            return
        common.run(bench, HEAD_DIM_CASES, out=args.out, fa4=fa4,
                   flops="fwd 4 B H Nq Nk D (halved when causal), bwd 2.5x fwd; bf16")
        return
    if args.varlen:
        if common.without_gpu(args, VARLEN_BENCH, DRY_RUN_VARLEN_CASES):
            return
        common.run(VARLEN_BENCH, VARLEN_CASES, out=args.out,
                   flops="fwd 4 H D sum L(L+1)/2 (causal per document), fwd+bwd 3.5x that; bf16")
        return
    if args.features:
        if common.without_gpu(args, FEATURES_BENCH, DRY_RUN_FEATURE_CASES):
            return
        passes = [p for p in args.passes or FEATURES_BENCH.passes if p in FEATURES_BENCH.passes]
        common.run(FEATURES_BENCH, FEATURE_CASES, out=args.out, passes=passes,
                   flops="fwd 4 B H D x the (query, key) pairs the causal mask and the window let through, bwd 2.5x "
                         "fwd; bf16")
        return
    if args.plot_from:
        return common.without_gpu(args, BENCH, [])
    bench, fa4 = (BENCH, None) if args.check and not args.dry_run else with_fa4(BENCH)
    if common.without_gpu(args, bench, [case for case in DRY_RUN_CASES if case.group in args.only]):
        return
    assert tk_ops.backends()["attention"] == "cuda kernel", f"tk_ops extension: {tk_ops.extension_status()}"
    if args.check:
        return check()
    common.run(bench, cases(set(args.only)), out=args.out, passes=args.passes, fa4=fa4,
               flops="fwd 4 B H Nq Nk D (halved when causal), bwd 2.5x fwd; bf16")


if __name__ == "__main__":
    main()
