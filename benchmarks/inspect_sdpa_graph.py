"""Print the SDPA nodes of the joint (forward + backward) graphs Inductor sees, and their masks.

    python3 -m benchmarks.inspect_sdpa_graph [--device cuda]

For debugging the attention rewrite (tk_ops/inductor/attention.py) on a device: which fused
forward and backward aten nodes SDPA lowers to, who reads each output, and what the mask is
built from; then the tk nodes left after the tk pass, and the tk ops in the generated code. For
an explicit constant causal mask and for one-layer Hugging Face Llama and BERT (needs transformers).
"""

from __future__ import annotations

import argparse

import torch
import torch.fx
import torch.nn.functional as F
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import unset_fake_temporarily

from benchmarks.bench_compile import tk_ops_called
from tk_ops.inductor import _graph, attention
from tk_ops.inductor.attention import _FORWARD_TO_BACKWARD
from tk_ops.inductor.graph_pass import TkGraphPass
from tk_ops.inductor.options import RewriteOptions

_SDPA_NODES = set(_FORWARD_TO_BACKWARD) | {b for backwards in _FORWARD_TO_BACKWARD.values() for b in backwards}


def _name(value) -> str:
    return value.name if isinstance(value, torch.fx.Node) else repr(value)


def _ancestors(node: torch.fx.Node) -> list[torch.fx.Node]:
    seen, pending = [], [node]
    while pending:
        current = pending.pop()
        if current not in seen:
            seen.append(current)
            pending.extend(current.all_input_nodes)
    return seen


def print_sdpa_nodes(graph: torch.fx.Graph) -> None:
    print(f"--- joint graph, {len(graph.nodes)} nodes")
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _SDPA_NODES:
            continue
        print(f"{node.name} = {node.target}({', '.join(_name(a) for a in node.args)})")
        for user in node.users:
            index = user.args[1] if len(user.args) > 1 else None
            print(f"    output {index} -> {user.name}: {[(u.name, str(u.target)) for u in user.users]}")
        arguments = _graph.bind_arguments(node)
        mask = arguments.get("attn_mask", arguments.get("attn_bias"))
        if isinstance(mask, torch.fx.Node):
            print(f"    mask {mask.name}, built from {[(a.op, str(a.target)) for a in _ancestors(mask)]}")
            print_constant_checks(mask)
        if node.target in _FORWARD_TO_BACKWARD:
            print(f"    tk masking: {attention._masking_if_rewritable(arguments, RewriteOptions())}")


def print_constant_checks(mask: torch.fx.Node) -> None:
    """What the rewrite's mask proof concludes: the mask's value at compile time, and what tk runs it as."""
    q_len, k_len = (int(size) for size in mask.meta["val"].shape[-2:])
    with unset_fake_temporarily():
        constant = attention._constant_value(mask)
        print(f"      constant value: {None if constant is None else (constant.dtype, tuple(constant.shape))}")
        if constant is not None and constant.is_floating_point():
            print(f"      values: {sorted(set(constant.flatten().tolist()))[:4]}")
        print(f"      masking: {attention._mask_masking(constant, q_len, k_len)}")


def print_sdpa_nodes_then_rewrite(graph: torch.fx.Graph) -> None:
    print_sdpa_nodes(graph)
    TkGraphPass(RewriteOptions())(graph)
    tk_nodes = [n for n in graph.nodes if n.op == "call_function" and str(n.target).startswith("tk.")]
    print(f"--- after the tk pass: {[(n.name, str(n.target)) for n in tk_nodes]}")


def run_printing_tk_calls(step) -> None:
    _, codes = run_and_get_code(step)
    for index, code in enumerate(codes):
        print(f"--- generated code {index}: tk ops {tk_ops_called([code])}")


def constant_causal_mask(q, k, v):
    rows = torch.arange(q.shape[2], device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=rows[None, :] <= rows[:, None])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    inductor_config.fx_graph_cache = False
    inductor_config.joint_custom_post_pass = print_sdpa_nodes_then_rewrite

    q, k, v = (torch.randn(2, 4, 256, 128, device=args.device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    print("=== F.scaled_dot_product_attention with a constant causal mask")
    compiled = torch.compile(constant_causal_mask, fullgraph=True)
    run_printing_tk_calls(lambda: compiled(q, k, v).float().sum().backward())

    import transformers

    print(f"=== Hugging Face Llama, one layer (transformers {transformers.__version__})")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config).to(args.device, torch.bfloat16)
    ids = torch.randint(0, 128, (2, 16), device=args.device)
    compiled_model = torch.compile(model)
    run_printing_tk_calls(lambda: compiled_model(input_ids=ids).logits.float().sum().backward())

    print(f"=== Hugging Face BERT, one layer (transformers {transformers.__version__})")
    bert_config = transformers.BertConfig(
        vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa",
    )
    bert = torch.compile(transformers.BertForMaskedLM(bert_config).to(args.device, torch.bfloat16))
    run_printing_tk_calls(lambda: bert(input_ids=ids).logits.float().sum().backward())


if __name__ == "__main__":
    main()
