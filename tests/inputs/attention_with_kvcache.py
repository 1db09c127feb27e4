"""tk.attention_with_kvcache's inputs and its float64 definition (tests/op_db.py and
tests/test_attention_with_kvcache.py).

Caches are built with NaN in every slot that holds no token: past each sequence's cache length, the rows
of a dense cache past the batch, the blocks no sequence owns. An implementation that reads a slot it
must not read, or writes one it must not write, shows it as NaN in its output or a changed canary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

import tk_ops

NAN = float("nan")


@dataclass
class KVCacheCase:
    """One call's inputs: q (B, Nq, Hq, D), the caches (dense, or paged with block_table), k and v
    (B, Nnew, Hkv, D / Dv) or None, cache_seqlens (B,) int32."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: Optional[torch.Tensor]
    v: Optional[torch.Tensor]
    cache_seqlens: torch.Tensor
    block_table: Optional[torch.Tensor]

    def arguments(self) -> dict:
        """Keyword arguments of tk_ops.attention_with_kvcache (the caches are these tensors: they are written)."""
        return dict(q=self.q, k_cache=self.k_cache, v_cache=self.v_cache, k=self.k, v=self.v,
                    cache_seqlens=self.cache_seqlens, block_table=self.block_table)

    def clone(self) -> "KVCacheCase":
        return KVCacheCase(*(None if t is None else t.clone() for t in (
            self.q, self.k_cache, self.v_cache, self.k, self.v, self.cache_seqlens, self.block_table)))

    def op_arguments(self, causal=True, scale=0.3, window_left=-1, window_right=-1, softcap=0.0, sinks=None) -> tuple:
        """The positional arguments of torch.ops.tk.attention_with_kvcache."""
        return (self.q, self.k_cache, self.v_cache, self.k, self.v, self.cache_seqlens, self.block_table, causal,
                scale, window_left, window_right, softcap, sinks)


def make_case(lengths, q_len, new_len, *, q_heads=4, kv_heads=2, head_dim=16, value_dim=None, capacity=None,
              block_size=None, spare=2, reserve=0, dtype=torch.float64, device="cpu") -> KVCacheCase:
    """Sequences with ``lengths`` cached tokens, Nq = ``q_len`` queries and Nnew = ``new_len`` appended tokens
    (0: k = v = None). Dense when ``block_size`` is None, with ``capacity`` (default: the longest sequence after
    the append) slots per row and ``spare`` rows past the batch; paged otherwise, each sequence owning
    ceil(capacity / block_size) blocks of a shuffled pool with ``spare`` blocks nobody owns, its block_table
    entries past the blocks it uses (those of its first length + Nnew + ``reserve`` positions: later calls
    may append ``reserve`` more) set to -1 (never read)."""
    value_dim = head_dim if value_dim is None else value_dim
    batch = len(lengths)
    capacity = max(lengths) + new_len if capacity is None else capacity
    capacity = max(capacity, 1)
    options = dict(dtype=dtype, device=device)
    q = torch.randn(batch, q_len, q_heads, head_dim, **options)
    k = v = None
    if new_len:
        k = torch.randn(batch, new_len, kv_heads, head_dim, **options)
        v = torch.randn(batch, new_len, kv_heads, value_dim, **options)
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    if block_size is None:
        k_cache = torch.full((batch + spare, capacity, kv_heads, head_dim), NAN, **options)
        v_cache = torch.full((batch + spare, capacity, kv_heads, value_dim), NAN, **options)
        for b, length in enumerate(lengths):
            k_cache[b, :length] = torch.randn(length, kv_heads, head_dim, **options)
            v_cache[b, :length] = torch.randn(length, kv_heads, value_dim, **options)
        return KVCacheCase(q, k_cache, v_cache, k, v, cache_seqlens, None)
    blocks_per_sequence = -(-capacity // block_size)
    pool = torch.randperm(batch * blocks_per_sequence + spare).tolist()
    k_cache = torch.full((len(pool), block_size, kv_heads, head_dim), NAN, **options)
    v_cache = torch.full((len(pool), block_size, kv_heads, value_dim), NAN, **options)
    block_table = torch.full((batch, blocks_per_sequence), -1, dtype=torch.int32)
    for b, length in enumerate(lengths):
        used = min(-(-(length + new_len + reserve) // block_size), blocks_per_sequence)
        block_table[b, :used] = torch.tensor(pool[b * blocks_per_sequence:][:used], dtype=torch.int32)
        for position in range(length):
            block, slot = block_table[b, position // block_size], position % block_size
            k_cache[block, slot] = torch.randn(kv_heads, head_dim, **options)
            v_cache[block, slot] = torch.randn(kv_heads, value_dim, **options)
    return KVCacheCase(q, k_cache, v_cache, k, v, cache_seqlens, block_table.to(device))


def _slot(case: KVCacheCase, b: int, position: int) -> tuple[int, int]:
    """(row or block, slot) of position ``position`` of sequence ``b``, read element by element."""
    if case.block_table is None:
        return b, position
    block_size = case.k_cache.shape[1]
    return int(case.block_table[b, position // block_size]), position % block_size


def cached_keys_and_values(case: KVCacheCase, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's cached keys and values (cache_seqlens[b], Hkv, D / Dv), gathered slot by slot."""
    slots = torch.tensor([_slot(case, b, p) for p in range(int(case.cache_seqlens[b]))], dtype=torch.long)
    blocks, positions = slots.view(-1, 2).unbind(1)
    return case.k_cache[blocks, positions], case.v_cache[blocks, positions]


def expected_caches(case: KVCacheCase) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches after the call: ``case``'s (taken before it) with k, v written slot by slot at the positions
    cache_seqlens .. cache_seqlens + Nnew - 1, nothing else changed."""
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    if case.k is not None:
        for b in range(case.q.shape[0]):
            for j in range(case.k.shape[1]):
                block, slot = _slot(case, b, int(case.cache_seqlens[b]) + j)
                k_cache[block, slot], v_cache[block, slot] = case.k[b, j], case.v[b, j]
    return k_cache, v_cache


def float64_definition(case: KVCacheCase, *, causal=True, scale=None, window=None, softcap=None, sinks=None):
    """(out (B, Nq, Hq, Dv), lse (B, Hq, Nq)) in float64 from ``case`` taken before the call: per sequence,
    tk_ops.attention of its queries against its cached keys followed by the appended ones (all of them
    visible to the mask of tk.attention, bottom-right aligned over the sequence's keys)."""
    outs, lses = [], []
    for b in range(case.q.shape[0]):
        keys, values = cached_keys_and_values(case, b)
        if case.k is not None:
            keys, values = torch.cat((keys, case.k[b])), torch.cat((values, case.v[b]))
        q = case.q[b].double().transpose(0, 1)[None]
        if keys.shape[0] == 0:  # tk.attention takes no empty key set: no key seen
            q_heads, q_len = q.shape[1], q.shape[2]
            lse = torch.full((1, q_heads, q_len), float("-inf"), dtype=torch.float64)
            if sinks is not None:
                lse = sinks.double().view(1, -1, 1).expand(1, q_heads, q_len)
            outs.append(torch.zeros(q_len, q_heads, values.shape[-1], dtype=torch.float64))
            lses.append(lse[0])
            continue
        out, lse = tk_ops.attention(q, keys.double().transpose(0, 1)[None], values.double().transpose(0, 1)[None],
                                    causal=causal, scale=scale, window=window, softcap=softcap,
                                    sinks=None if sinks is None else sinks.double(), return_lse=True)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses).float()
