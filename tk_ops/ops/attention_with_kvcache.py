"""Attention for inference against a KV cache: ``tk.attention_with_kvcache``, with the semantics of
FlashAttention's ``flash_attn_with_kvcache``.

A batch of B sequences, each with the keys and values of its first cache_seqlens[b] tokens in a cache:

  dense  k_cache (B_cache, Nmax, Hkv, D), v_cache (B_cache, Nmax, Hkv, Dv), B_cache >= B: position p of
         sequence b is k_cache[b, p] (rows from B on are neither read nor written);
  paged  k_cache (num_blocks, block_size, Hkv, D), v_cache (num_blocks, block_size, Hkv, Dv) and
         block_table (B, max_blocks) int32: position p of sequence b is slot p % block_size of block
         block_table[b, p // block_size].

A call does two things, for q (B, Nq, Hq, D) with Hq % Hkv == 0 (GQA):

1. Append, when k (B, Nnew, Hkv, D) and v (B, Nnew, Hkv, Dv) are given (Nnew = 0 otherwise): k[b, j] and
   v[b, j] are written into the caches, in place, at position cache_seqlens[b] + j for j < Nnew.
2. Attend: sequence b then has L_b = cache_seqlens[b] + Nnew keys, at positions 0 .. L_b - 1. Query row i
   sits at position L_b - Nq + i and sees key p iff
       L_b - Nq + i - left <= p <= L_b - Nq + i + right      (window = (left, right), -1 unbounded),
   with right = 0 under causal: tk.attention's bottom-right aligned mask over the sequence's L_b keys.
   Scale, softcap, sinks, out and lse are tk.attention's (tk_ops/ops/attention.py): a row that sees no
   key has out 0 and lse -inf (lse = its sink with sinks).

No cache slot at or past position L_b of a sequence is read (a slot never written may hold anything,
NaN included), and no slot but the appended ones is written. Where the appended positions of two
sequences share a paged slot, which one's values it holds afterwards is unspecified (as in
FlashAttention); blocks that sequences only read may be shared freely.

Op
  tk::attention_with_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v,
                             Tensor cache_seqlens, Tensor? block_table, bool causal, float scale,
                             int window_left, int window_right, float softcap, Tensor? sinks)
      -> (Tensor out, Tensor lse)
  out (B, Nq, Hq, Dv) contiguous in q's dtype, lse (B, Hq, Nq) contiguous fp32; cache_seqlens (B,)
  int32; the caches have a unit last stride (any other strides). The schema marks k_cache and v_cache
  as written, so torch.compile functionalizes the append and a CUDA kernel registered for the op
  may write them in place. The op has no gradient (an inference op, like FlashAttention's): its
  outputs never require grad (``_library.register_forward_only``).

On a GPU, dense caches in bf16/fp16 (the attention forward kernel's head dims, D = Dv) run that kernel's
packed variant (csrc/torch/attention.cpp): the B x Nq query rows as B
sequences, each against the first cache_seqlens[b] + Nnew slots of its cache row, after a prepare kernel
appends k and v (decoding, Nq <= 16 and no window: each KV head's Nq x G query rows as a task's rows,
split-KV, with causal the last Nq - 1 keys a separate per-query-head tail call, and a kernel that combines
the chunks and the tail by their lse); nothing is read on the host, so a decode step can be captured in a CUDA
graph. Paged
caches in blocks of a multiple of 128 positions run it too (a key block read from the page the table
names); smaller blocks, and every other case, run the reference. It reads cache_seqlens and block_table on the host
first (a device sync on a GPU) and raises a ValueError for contents that would read or write outside the
caches, then appends with an indexed write, gathers each sequence's keys and values into (B, L, Hkv, D)
tensors, right-aligned (L the longest L_b; the left padding is hidden from every row and zeroed, so that
a NaN in an unused slot cannot reach the output), and runs tk.attention's forward on them in fp32 (fp64
for fp64 inputs). Right alignment puts every sequence's last key at index L - 1, where tk.attention's
bottom-right aligned mask puts it, so one batched call serves sequences of different lengths.
"""

from __future__ import annotations

from typing import Optional

import torch

from tk_ops import _checks, _library
from tk_ops.ops import attention as attention_module

# ---------------------------------------------------------------------------- the cache's contents


def _capacity(k_cache: torch.Tensor, block_table: Optional[torch.Tensor]) -> tuple[int, str]:
    """The positions a sequence can hold, and where that number comes from (for error messages)."""
    if block_table is None:
        return k_cache.shape[1], "Nmax = k_cache.shape[1]"
    blocks, block_size = block_table.shape[1], k_cache.shape[1]
    return blocks * block_size, f"max_blocks * block_size = {blocks} * {block_size}"


def check_lengths(lengths: list[int], new_len: int, k_cache: torch.Tensor, block_table: Optional[torch.Tensor]) -> None:
    """ValueError unless every cache length is >= 0 and leaves room for the Nnew appended tokens."""
    capacity, where = _capacity(k_cache, block_table)
    for b, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"cache_seqlens[{b}] must be >= 0, got {length}")
        if length + new_len > capacity:
            raise ValueError(
                f"cache_seqlens[{b}] + Nnew ({length} + {new_len}) must be at most the cache's capacity "
                f"({where} = {capacity})"
            )


def check_block_table(block_table: torch.Tensor, lengths: list[int], new_len: int, num_blocks: int, block_size: int):
    """ValueError unless every block a sequence uses (those holding its first cache_seqlens + Nnew positions)
    is in [0, num_blocks); the entries past them are not read and may hold anything (e.g. -1)."""
    used = torch.tensor([-(-(length + new_len) // block_size) for length in lengths])
    in_use = torch.arange(block_table.shape[1])[None, :] < used[:, None]
    table = block_table.cpu()
    outside = in_use & ((table < 0) | (table >= num_blocks))
    if outside.any():
        b, j = outside.nonzero()[0].tolist()
        raise ValueError(
            f"block_table[{b}, {j}] must be a block index in [0, num_blocks = {num_blocks}) "
            f"(sequence {b} uses its first {used[b].item()} blocks), got {table[b, j].item()}"
        )


def _check_contents(cache_seqlens, block_table, new_len: int, k_cache: torch.Tensor) -> list[int]:
    """Read cache_seqlens (and block_table) on the host, check them; return the cache lengths."""
    lengths = cache_seqlens.tolist()
    check_lengths(lengths, new_len, k_cache, block_table)
    if block_table is not None:
        check_block_table(block_table, lengths, new_len, k_cache.shape[0], k_cache.shape[1])
    return lengths


# ----------------------------------------------------------------------------------- reference


def _cache_slots(table: torch.Tensor, positions: torch.Tensor, block_size: int):
    """(block, slot) indices (each like ``positions``) of the positions (B, n) of each sequence."""
    return table.gather(1, torch.div(positions, block_size, rounding_mode="floor")), positions % block_size


def _attention_with_kvcache_reference(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale,
                                      window_left, window_right, softcap, sinks):
    batch = q.shape[0]
    new_len = 0 if k is None else k.shape[1]
    lengths = _check_contents(cache_seqlens, block_table, new_len, k_cache)
    # A dense cache is a paged one with one block of Nmax slots per sequence: row b is sequence b's block.
    table = (torch.arange(batch, device=q.device)[:, None] if block_table is None else block_table).long()
    block_size = k_cache.shape[1]
    starts = cache_seqlens.long()
    if k is not None:
        blocks, slots = _cache_slots(table, starts[:, None] + torch.arange(new_len, device=q.device), block_size)
        k_cache[blocks, slots] = k
        v_cache[blocks, slots] = v
    key_len = max(max(lengths) + new_len, 1)
    # Index c of a sequence of L_b keys holds its position c - (key_len - L_b): right-aligned, so that every
    # sequence's last key is at key_len - 1, where tk.attention's bottom-right aligned mask expects it.
    positions = torch.arange(key_len, device=q.device)[None, :] - (key_len - new_len - starts)[:, None]
    absent = positions < 0
    blocks, slots = _cache_slots(table, positions.clamp_min(0), block_size)
    blocks.masked_fill_(absent, 0)  # an empty sequence's first block entry is not checked: read block 0
    padding = absent[:, :, None, None]
    keys = torch.where(padding, 0, k_cache[blocks, slots])
    values = torch.where(padding, 0, v_cache[blocks, slots])
    out, lse = attention_module._forward(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), causal, scale, window_left, window_right,
        softcap, sinks, absent,
    )
    return out.transpose(1, 2).contiguous(), lse


def _attention_with_kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale,
                                 window_left, window_right, softcap, sinks):
    batch, q_len, q_heads, _ = q.shape
    out = q.new_empty((batch, q_len, q_heads, v_cache.shape[3]))
    return out, q.new_empty((batch, q_heads, q_len), dtype=torch.float32)


attention_with_kvcache_op = _library.define(
    "attention_with_kvcache",
    "(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, Tensor cache_seqlens, "
    "Tensor? block_table, bool causal, float scale, int window_left, int window_right, float softcap, "
    "Tensor? sinks) -> (Tensor out, Tensor lse)",
    reference=_attention_with_kvcache_reference,
    fake=_attention_with_kvcache_fake,
)
_library.register_forward_only(attention_with_kvcache_op)


# ----------------------------------------------------------------------------------- public API


def _check_cache(name: str, cache: torch.Tensor) -> None:
    _checks.check_tensor(name, cache, ndim=4)
    if cache.shape[3] > 1 and cache.stride(3) != 1:
        raise ValueError(
            f"{name} must have a unit last stride (it is written in place, so it is never copied), "
            f"got strides {cache.stride()}"
        )


def _check_inputs(q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale) -> None:
    _checks.check_tensor("q", q, ndim=4)
    _check_cache("k_cache", k_cache)
    _check_cache("v_cache", v_cache)
    if (k is None) != (v is None):
        given, missing = ("k", "v") if v is None else ("v", "k")
        raise ValueError(f"k and v are appended together: {given} was given without {missing}")
    _checks.check_optional("k", k, ndim=4)
    _checks.check_optional("v", v, ndim=4)
    _checks.check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
    _checks.check_same_dtype(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
    batch, kv_heads = q.shape[0], k_cache.shape[2]
    for dim, what in ((0, "k_cache.shape[0]"), (1, "k_cache.shape[1]"), (2, "k_cache.shape[2] (Hkv)")):
        _checks.check_dim("v_cache", v_cache, dim, k_cache.shape[dim], what)
    _checks.check_dim("k_cache", k_cache, 3, q.shape[3], "q.shape[3] (head dim D)")
    if k is not None:
        _checks.check_dim("k", k, 0, batch, "q.shape[0] (batch)")
        _checks.check_dim("k", k, 2, kv_heads, "k_cache.shape[2] (Hkv)")
        _checks.check_dim("k", k, 3, q.shape[3], "q.shape[3] (head dim D)")
        _checks.check_dim("v", v, 0, batch, "q.shape[0] (batch)")
        _checks.check_dim("v", v, 1, k.shape[1], "k.shape[1] (Nnew)")
        _checks.check_dim("v", v, 2, kv_heads, "k_cache.shape[2] (Hkv)")
        _checks.check_dim("v", v, 3, v_cache.shape[3], "v_cache.shape[3] (value head dim Dv)")
    attention_module._check_heads_and_scale(q.shape[2], kv_heads, scale)
    if block_table is None:
        if k_cache.shape[0] < batch:
            raise ValueError(
                f"k_cache.shape[0] (B_cache) must be at least q's batch {batch} (a dense cache holds one row "
                f"per sequence), got shape {tuple(k_cache.shape)}"
            )
    else:
        _checks.check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,))
        _checks.check_dim("block_table", block_table, 0, batch, "q.shape[0] (batch)")
        _checks.check_same_device(q=q, block_table=block_table)
    if isinstance(cache_seqlens, torch.Tensor):
        _checks.check_tensor("cache_seqlens", cache_seqlens, ndim=1, dtypes=(torch.int32,))
        _checks.check_dim("cache_seqlens", cache_seqlens, 0, batch, "q.shape[0] (batch)")
        _checks.check_same_device(q=q, cache_seqlens=cache_seqlens)
    elif isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, torch.SymInt)):
        raise TypeError(
            f"cache_seqlens must be a (B,) int32 tensor or a Python int, got {type(cache_seqlens).__name__}"
        )


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    *,
    cache_seqlens,
    block_table: Optional[torch.Tensor] = None,
    causal: bool = True,
    scale: Optional[float] = None,
    window: Optional[tuple[int, int]] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    check_contents: bool = True,
):
    """Attention of q (B, Nq, Hq, D) against each sequence's KV cache, after appending k, v to it in place
    (FlashAttention's ``flash_attn_with_kvcache``; the math in the module docstring).

    k_cache, v_cache: dense (B_cache >= B, Nmax, Hkv, D / Dv), sequence b in row b; or paged
    (num_blocks, block_size, Hkv, D / Dv) with ``block_table`` (B, max_blocks) int32. Both need a unit
    last stride (other strides are free). ``cache_seqlens``: (B,) int32 on q's device, or a Python int
    for every sequence: the tokens already cached. k (B, Nnew, Hkv, D), v (B, Nnew, Hkv, Dv), optional
    and together: written into the caches at positions cache_seqlens .. cache_seqlens + Nnew - 1 before
    attending. Query row i of sequence b sits at position cache_seqlens[b] + Nnew - Nq + i; ``causal``
    (default True) and ``window`` are relative to it. ``scale``, ``window``, ``softcap`` and ``sinks``
    mean what they mean in ``tk_ops.attention``. Returns out (B, Nq, Hq, Dv) in q's dtype, or (out, lse)
    with ``return_lse``: lse (B, Hq, Nq) fp32.

    Forward only, as FlashAttention's: no gradient flows through it and its outputs never require grad.
    q, k and v must have the caches' dtype (no autocast: the cache's dtype is fixed when it is allocated).

    Checks. Types, shapes, dtypes, devices and options raise before anything runs. The contents (every
    cache_seqlens >= 0 with cache_seqlens + Nnew at most the capacity, Nmax or max_blocks * block_size;
    every block_table entry a sequence uses in [0, num_blocks)) raise a ValueError before anything is
    written, in eager mode: an int cache_seqlens always, tensors read on the host, which on a GPU costs a
    device sync (``check_contents=False`` skips it, as a caller that keeps its own cache consistent may;
    models/llama.py does). While a CUDA graph is being captured and under torch.compile they are not read
    (that would break the capture or the graph): there, as in FlashAttention, valid contents are the
    caller's promise, and the kernels clamp every index so that nothing outside the caches is read or
    written whatever the tensors hold (a bad row gets unspecified numbers). The reference reads them
    anyway and raises the same ValueError. Under torch.compile pass a tensor: an int is specialised, one
    graph per value.
    """
    _check_inputs(q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale)
    options = attention_module.mask_options(q, q.shape[3], q.shape[2], causal=causal, scale=scale, window=window,
                                            softcap=softcap, sinks=sinks)
    batch, new_len = q.shape[0], 0 if k is None else k.shape[1]
    if not isinstance(cache_seqlens, torch.Tensor):
        check_lengths([cache_seqlens] * batch, new_len, k_cache, block_table)
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    if check_contents and _checks.may_read_contents(cache_seqlens, device_sync=True):
        _check_contents(cache_seqlens, block_table, new_len, k_cache)
    out, lse = attention_with_kvcache_op(
        _checks.unit_last_stride(q),
        k_cache,
        v_cache,
        _checks.unit_last_stride(k),
        _checks.unit_last_stride(v),
        cache_seqlens.contiguous(),
        None if block_table is None else block_table.contiguous(),
        *options,
    )
    return (out, lse) if return_lse else out
