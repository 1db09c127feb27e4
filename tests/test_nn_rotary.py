"""tk_ops.nn.RotaryEmbedding against a Hugging Face-style Llama rotary module and rotate_half."""

from __future__ import annotations

import pytest
import torch

import tk_ops
from tk_testing import TOLERANCE, assert_rel_close, requires_kernel


class HFStyleRotaryEmbedding(torch.nn.Module):
    """The Hugging Face Llama pattern: fp32 frequencies as a batched matmul, duplicated halves."""

    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        self.register_buffer("inv_freq", 1.0 / (base**exponents), persistent=False)

    def forward(self, x, position_ids):
        frequencies = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        positions = position_ids[:, None, :].float()
        angles = (frequencies.to(x.device) @ positions).transpose(1, 2)
        duplicated = torch.cat((angles, angles), dim=-1)
        return duplicated.cos().to(x.dtype), duplicated.sin().to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin):
    """HF's apply_rotary_pos_emb, with the GPT-NeoX partial-rotary split when cos is narrower than q."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]

    def rotate(x):
        rotary, passed = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat((rotary * cos + rotate_half(rotary) * sin, passed), dim=-1)

    return rotate(q), rotate(k)


def llama_inputs(B, Hq, Hk, N, D, dtype, device="cpu"):
    q = torch.randn(B, N, Hq, D, dtype=dtype, device=device).transpose(1, 2)  # HF's view-then-transpose
    k = torch.randn(B, N, Hk, D, dtype=dtype, device=device).transpose(1, 2)
    offsets = torch.randint(0, 3000, (B, 1), device=device)  # batch-dependent positions
    position_ids = offsets + torch.arange(N, device=device)
    return q, k, position_ids


def test_constructor_signature_and_state():
    rotary = tk_ops.nn.RotaryEmbedding(64)
    assert (rotary.dim, rotary.max_position_embeddings, rotary.base) == (64, 2048, 10000.0)
    assert rotary.inv_freq.dtype == torch.float32 and rotary.inv_freq.shape == (32,)
    # HF's formula, operation for operation (elementwise, no reduction): the same bits on any machine.
    torch.testing.assert_close(rotary.inv_freq, HFStyleRotaryEmbedding(64).inv_freq, rtol=0, atol=0)
    assert dict(rotary.named_buffers()).keys() == {"inv_freq"}
    assert rotary.state_dict() == {}  # non-persistent, as in HF
    custom = tk_ops.nn.RotaryEmbedding(32, max_position_embeddings=4096, base=500000.0, device="cpu")
    assert custom.max_position_embeddings == 4096
    torch.testing.assert_close(custom.inv_freq, HFStyleRotaryEmbedding(32, 500000.0).inv_freq, rtol=0, atol=0)


@pytest.mark.parametrize("dim", [0, 7, -4])
def test_constructor_rejects_bad_dim(dim):
    with pytest.raises(ValueError, match="dim must be a positive even integer"):
        tk_ops.nn.RotaryEmbedding(dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_matches_hf_cos_sin(dtype):
    B, N, dim = 3, 11, 64
    x = torch.randn(B, N, 8, dtype=dtype)
    position_ids = torch.randint(0, 5000, (B, 1)) + torch.arange(N)
    cos, sin = tk_ops.nn.RotaryEmbedding(dim)(x, position_ids)
    hf_cos, hf_sin = HFStyleRotaryEmbedding(dim)(x, position_ids)
    assert cos.shape == (B, N, dim) and cos.dtype == dtype and not cos.requires_grad
    torch.testing.assert_close(cos, hf_cos)
    torch.testing.assert_close(sin, hf_sin)


def test_forward_keeps_fp32_angles_under_autocast():
    B, N, dim = 2, 7, 32
    x = torch.randn(B, N, dim)
    position_ids = 4000 + torch.arange(N).expand(B, N)
    rotary = tk_ops.nn.RotaryEmbedding(dim)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cos, sin = rotary(x, position_ids)
    expected_cos, expected_sin = rotary(x, position_ids)
    assert cos.dtype == torch.float32
    # The same fp32 elementwise computation with and without autocast (which it does not touch).
    torch.testing.assert_close(cos, expected_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin, expected_sin, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, rotary_dim", [(64, 64), (128, 128), (80, 32)], ids=["D64", "D128", "D80-R32"])
def test_apply_matches_hf_rotate_half(head_dim, rotary_dim, dtype):
    B, Hq, Hk, N = 3, 6, 2, 13
    q, k, position_ids = llama_inputs(B, Hq, Hk, N, head_dim, dtype)
    rotary = tk_ops.nn.RotaryEmbedding(rotary_dim)
    cos, sin = rotary(q, position_ids)
    q_out, k_out = rotary.apply_rotary_pos_emb(q, k, cos, sin)
    hf_q, hf_k = hf_apply_rotary_pos_emb(q, k, cos, sin)
    assert q_out.dtype == dtype and q_out.shape == q.shape and k_out.shape == k.shape
    tolerance = TOLERANCE[dtype]
    assert_rel_close(q_out, hf_q, tolerance, "q")
    assert_rel_close(k_out, hf_k, tolerance, "k")
    assert torch.equal(q_out[..., rotary_dim:], q[..., rotary_dim:])


def test_apply_gradients_match_hf():
    B, Hq, Hk, N, D = 2, 4, 2, 9, 80
    q, k, position_ids = llama_inputs(B, Hq, Hk, N, D, torch.float64)
    q.requires_grad_()
    k.requires_grad_()
    rotary = tk_ops.nn.RotaryEmbedding(48)
    cos, sin = rotary(q, position_ids)
    weight_q, weight_k = torch.randn_like(q), torch.randn_like(k)

    def loss(outputs):
        q_out, k_out = outputs
        return (q_out * weight_q).sum() + (k_out * weight_k).sum()

    grads = torch.autograd.grad(loss(rotary.apply_rotary_pos_emb(q, k, cos, sin)), (q, k))
    expected = torch.autograd.grad(loss(hf_apply_rotary_pos_emb(q, k, cos, sin)), (q, k))
    for name, grad, hf_grad in zip("qk", grads, expected):
        assert_rel_close(grad, hf_grad, TOLERANCE[torch.float64], f"grad {name}")


def test_apply_rejects_tables_of_another_dim():
    rotary = tk_ops.nn.RotaryEmbedding(32)
    q, k, position_ids = llama_inputs(1, 2, 2, 5, 64, torch.float32)
    cos, sin = tk_ops.nn.RotaryEmbedding(64)(q, position_ids)
    with pytest.raises(ValueError, match=r"cos.shape\[-1\] must equal dim \(32\)"):
        rotary.apply_rotary_pos_emb(q, k, cos, sin)


def test_module_apply_still_recurses():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), tk_ops.nn.RotaryEmbedding(16))
    visited = []
    model.apply(lambda module: visited.append(type(module).__name__))
    assert visited == ["Linear", "RotaryEmbedding", "Sequential"]


def test_compile_fullgraph_without_graph_break():
    B, Hq, Hk, N, D = 2, 4, 2, 7, 32
    q, k, position_ids = llama_inputs(B, Hq, Hk, N, D, torch.float32)
    rotary = tk_ops.nn.RotaryEmbedding(D)
    graphs = []

    def record_graph(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    def attention_inputs(q, k, position_ids):
        cos, sin = rotary(q, position_ids)
        return rotary.apply_rotary_pos_emb(q, k, cos, sin)

    q_out, k_out = torch.compile(attention_inputs, backend=record_graph, fullgraph=True)(q, k, position_ids)
    (graph,) = graphs
    assert torch.ops.tk.rope_qk.default in {node.target for node in graph.graph.nodes}
    expected_q, expected_k = attention_inputs(q, k, position_ids)
    torch.testing.assert_close(q_out, expected_q)
    torch.testing.assert_close(k_out, expected_k)


@requires_kernel("rope_qk")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_module_on_kernel(dtype):
    B, Hq, Hk, N, D = 2, 32, 8, 1025, 128
    q, k, position_ids = llama_inputs(B, Hq, Hk, N, D, dtype, device="cuda")
    rotary = tk_ops.nn.RotaryEmbedding(D, device="cuda")
    cos, sin = rotary(q, position_ids)
    q_out, k_out = rotary.apply_rotary_pos_emb(q, k, cos, sin)
    hf_q, hf_k = hf_apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double())
    assert_rel_close(q_out, hf_q, TOLERANCE[dtype], "q")
    assert_rel_close(k_out, hf_k, TOLERANCE[dtype], "k")
