"""One profiled call of a kernel for Nsight Compute, after warm-up calls.

    ncu --clock-control none --kernel-name-base demangled -k regex:KERNELS --launch-skip S --launch-count C \\
        --set full python3 -m benchmarks.profile_kernels CASE

Each case makes ``WARMUP_CALLS`` calls before the one that is meant to be profiled, so
``--launch-skip`` is WARMUP_CALLS times the kernels per call. Both, and the KERNELS regex, come from
the case's entry in benchmarks/families.py (the script prints them); gpu_session.sh's `profile`
part runs every case there.
"""

from __future__ import annotations

import argparse
import math

import torch

import tk_ops
from benchmarks import families

WARMUP_CALLS = 2


def gemm(m: int, n: int, k: int, weight_row_major: bool):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if weight_row_major:
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        return lambda: tk_ops.linear(a, weight)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return lambda: tk_ops.matmul(a, b)


def attention(batch: int, heads: int, n: int, d: int, backward: bool):
    q, k, v = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = 1.0 / math.sqrt(d)
    if not backward:
        return lambda: torch.ops.tk.attention.default(q, k, v, False, scale, False)
    out, lse = torch.ops.tk.attention.default(q, k, v, False, scale, False)
    grad = torch.randn_like(out)
    return lambda: torch.ops.tk.attention_bwd.default(grad, None, q, k, v, out, lse, False, scale, False)


def based_attention(batch: int, heads: int, n: int, backward: bool = False):
    q, k = (torch.randn(batch, heads, n, 16, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(batch, heads, n, 64, device="cuda", dtype=torch.bfloat16)
    if not backward:
        return lambda: torch.ops.tk.based_attention.default(q, k, v, 1e-6, True)
    out, denominator = torch.ops.tk.based_attention.default(q, k, v, 1e-6, True)
    grad = torch.randn_like(out)
    return lambda: torch.ops.tk.based_attention_bwd.default(grad, q, k, v, out, denominator, 1e-6, True)


def linear_attention(batch: int, heads: int, n: int, features: int, value_dim: int, backward: bool = False):
    """Unit-scale scores (q scaled by F**-0.5), normalised: the forward with its denominator, or the
    backward (statistics, dq, dk/dv, reduce) on the forward's outputs."""
    q = torch.randn(batch, heads, n, features, device="cuda", dtype=torch.bfloat16) * features**-0.5
    k = torch.randn(batch, heads, n, features, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, heads, n, value_dim, device="cuda", dtype=torch.bfloat16)
    if not backward:
        return lambda: torch.ops.tk.linear_attention.default(q, k, v, 1e-6, True)
    out, denominator = torch.ops.tk.linear_attention.default(q, k, v, 1e-6, True)
    grad = torch.randn_like(out)
    return lambda: torch.ops.tk.linear_attention_bwd.default(grad, q, k, v, out, denominator, 1e-6, True)


def mamba2_ssd(batch: int, seqlen: int, heads: int, groups: int, state_size: int, chunk_size: int):
    """Mamba-2 sized: P = 64, gated, D, dt_bias + softplus, initial states."""
    x, z = (torch.randn(batch, seqlen, heads, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    B, C = (torch.randn(batch, seqlen, groups, state_size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dt = torch.randn(batch, seqlen, heads, device="cuda") * 0.5 - 1.5
    A = -0.3 - torch.rand(heads, device="cuda")
    D, dt_bias = torch.randn(heads, device="cuda"), torch.randn(heads, device="cuda") * 0.3
    initial = torch.randn(batch, heads, 64, state_size, device="cuda")
    return lambda: torch.ops.tk.mamba2_ssd.default(x, dt, A, B, C, chunk_size, D, z, dt_bias, True, initial)


def fftconv(batch: int, heads: int, seq_len: int, backward: bool = False):
    """bf16 u, fp32 filters of the full length, D; the backward for a random output gradient."""
    u = torch.randn(batch, heads, seq_len, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(heads, seq_len, device="cuda") / math.sqrt(seq_len)
    D = torch.randn(heads, device="cuda")
    if not backward:
        return lambda: torch.ops.tk.fftconv.default(u, k, D)
    grad = torch.randn_like(u)
    return lambda: torch.ops.tk.fftconv_bwd.default(grad, u, k, D)


def mamba2_ssd_backward(batch: int, seqlen: int, heads: int, groups: int, state_size: int, chunk_size: int):
    """The backward (block states, reverse sweep, grad_B/grad_C reduction) on the forward's outputs,
    with a gradient for the final states too."""
    x, z = (torch.randn(batch, seqlen, heads, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    B, C = (torch.randn(batch, seqlen, groups, state_size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dt = torch.randn(batch, seqlen, heads, device="cuda") * 0.5 - 1.5
    A = -0.3 - torch.rand(heads, device="cuda")
    D, dt_bias = torch.randn(heads, device="cuda"), torch.randn(heads, device="cuda") * 0.3
    initial = torch.randn(batch, heads, 64, state_size, device="cuda")
    y, final, chunk_states = torch.ops.tk.mamba2_ssd.default(x, dt, A, B, C, chunk_size, D, z, dt_bias, True, initial)
    grad_y, grad_final = torch.randn_like(y), torch.randn_like(final)
    return lambda: torch.ops.tk.mamba2_ssd_bwd.default(
        grad_y, grad_final, x, dt, A, B, C, chunk_size, D, z, dt_bias, True, initial, chunk_states
    )


def layer_norm_backward(rows: int, hidden: int):
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    weight, bias = (torch.randn(hidden, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    _, _, mean, rstd = torch.ops.tk.layer_norm.default(x, weight, bias, None, None, 1e-5, 0.0)
    grad = torch.randn_like(x)
    h = x  # without residual or dropout the backward reads x as the stream
    return lambda: torch.ops.tk.layer_norm_bwd.default(
        grad, None, h, weight, bias, mean, rstd, None, 0.0, [True, False, True, True]
    )


def bench_decode_case(*args, **kwargs):
    from benchmarks import bench_decode

    return bench_decode.DecodeCase(*args, **kwargs)


def decode(case):
    """A bench_decode case's cache call (its inputs and ours)."""
    from benchmarks import bench_decode

    inputs = bench_decode.make_inputs(case, "cuda")
    run = bench_decode.ours(case, "fwd")
    return lambda: run(*inputs)


def gated_delta_rule(batch: int, seq_len: int, k_heads: int, v_heads: int):
    """bench_gated_delta_rule's forward (bf16, K = V = 128, l2norm, final state)."""
    from benchmarks import bench_gated_delta_rule as bench

    q, k, v, g, beta, _ = bench.make_inputs(bench.Case(batch, seq_len, k_heads, v_heads), "cuda")
    inputs = [t.detach() for t in (q, k, v, g, beta)]
    return lambda: bench.ours(*inputs)


def causal_conv1d(batch: int, dim: int, seq_len: int, layout: str, backward: bool):
    """Mamba-2's short convolution (W = 4, bias, SiLU, bf16): x contiguous (B, D, L), or ("bld") a
    (B, L, D) tensor seen as (B, D, L); the output gradient in x's layout."""
    if layout == "bld":
        x = torch.randn(batch, seq_len, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    else:
        x = torch.randn(batch, dim, seq_len, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(dim, 4, device="cuda") * 0.5).to(torch.bfloat16)
    bias = torch.randn(dim, device="cuda", dtype=torch.bfloat16)
    if not backward:
        return lambda: torch.ops.tk.causal_conv1d.default(x, weight, bias, True)
    grad = torch.randn_like(x)  # x's strides
    return lambda: torch.ops.tk.causal_conv1d_bwd.default(grad, x, weight, bias, True)


MAMBA2_CONV_DIM = 4096 + 2 * 128  # d_inner plus B and C of d_state 128, one group

CASES = {
    "gemm_k64": lambda: gemm(4096, 4096, 64, weight_row_major=False),
    "gemm_4096": lambda: gemm(4096, 4096, 4096, weight_row_major=False),
    "linear_llama_row_major_weight": lambda: gemm(16384, 11008, 4096, weight_row_major=True),
    "attention_fwd_d128_n8192": lambda: attention(2, 16, 8192, 128, backward=False),
    "attention_bwd_d128_n8192": lambda: attention(2, 16, 8192, 128, backward=True),
    "based_fwd_n4096": lambda: based_attention(8, 16, 4096),
    "based_bwd_n4096": lambda: based_attention(8, 16, 4096, backward=True),
    # three stages and two blocks an SM at F = 64; two stages and one block at F = 256
    "linear_attention_fwd_f64_n4096": lambda: linear_attention(8, 16, 4096, 64, 64),
    "linear_attention_fwd_f256_n4096": lambda: linear_attention(8, 16, 4096, 256, 64),
    "linear_attention_bwd_f64_n4096": lambda: linear_attention(8, 16, 4096, 64, 64, backward=True),
    "linear_attention_bwd_f256_n4096": lambda: linear_attention(8, 16, 4096, 256, 64, backward=True),
    # one stage and two blocks an SM at N = 128 (one (batch, head) per block)
    "mamba2_ssd_fwd_n128_l4096": lambda: mamba2_ssd(4, 4096, 32, 1, 128, 256),
    # bench_fftconv's N = 4096 target: 8 warps a block, one pair of sequences at a time
    "fftconv_fwd_n4096": lambda: fftconv(16, 768, 4096),
    "fftconv_bwd_n4096": lambda: fftconv(16, 768, 4096, backward=True),
    # one stage and one block an SM at N = 128; grad_B and grad_C summed over 32 heads per group
    "mamba2_ssd_bwd_n128_l4096": lambda: mamba2_ssd_backward(4, 4096, 32, 1, 128, 256),
    # bench_mamba2's longest target shape: 160 (batch, head) chains for 132 SMs
    "mamba2_ssd_fwd_n128_l16384": lambda: mamba2_ssd(2, 16384, 80, 1, 128, 256),
    "mamba2_ssd_bwd_n128_l16384": lambda: mamba2_ssd_backward(2, 16384, 80, 1, 128, 256),
    # one warp per row at 1024, four at 4096 (benchmarks/results/norms.md compares the two)
    "layer_norm_bwd_h1024": lambda: layer_norm_backward(32768, 1024),
    "layer_norm_bwd_h4096": lambda: layer_norm_backward(32768, 4096),
    # bench_conv1d's shapes: channel-first items of 1024 positions, channel-last walks of the resident grid
    "causal_conv1d_fwd_bdl_l4096": lambda: causal_conv1d(8, MAMBA2_CONV_DIM, 4096, "bdl", backward=False),
    "causal_conv1d_fwd_bld_l4096": lambda: causal_conv1d(8, MAMBA2_CONV_DIM, 4096, "bld", backward=False),
    "causal_conv1d_bwd_bdl_l4096": lambda: causal_conv1d(8, MAMBA2_CONV_DIM, 4096, "bdl", backward=True),
    "causal_conv1d_bwd_bld_l4096": lambda: causal_conv1d(8, MAMBA2_CONV_DIM, 4096, "bld", backward=True),
    # bench_decode's split-KV cases furthest from the copy bandwidth: ragged long caches, and four queries
    "decode_paged_b8_l8k_57k": lambda: decode(bench_decode_case("paged", 8, 8192, 57344, block_size=128)),
    "decode_paged_b16_nq4": lambda: decode(bench_decode_case("paged", 16, 4096, 12288, q_len=4, block_size=128)),
    "gated_delta_rule_fwd_t32768": lambda: gated_delta_rule(1, 32768, 16, 32),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=sorted(CASES))
    args = parser.parse_args()
    call = CASES[args.case]()
    kernels = families.profile(args.case)
    for _ in range(WARMUP_CALLS):
        call()
    torch.cuda.synchronize()
    call()
    torch.cuda.synchronize()
    print(f"{args.case}: profile with --kernel-name-base demangled -k 'regex:{kernels.kernels}' "
          f"--launch-skip {WARMUP_CALLS * kernels.per_call} --launch-count {kernels.per_call}")


if __name__ == "__main__":
    main()
