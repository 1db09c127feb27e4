"""torch.compile with and without ``tk_ops.inductor.enable()``: HF Llama and BERT, fwd and train step.

Unchanged Hugging Face models (built from configs, random weights, bf16) compiled by Inductor,
once as is and once after ``tk_ops.inductor.enable()``; each timed forward-only and as a training
step (forward + backward). The rewrites that fired are counted from the generated code.

    python3 -m benchmarks.bench_compile [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re

import torch
from torch._inductor.utils import run_and_get_code

import tk_ops.inductor
from benchmarks import common


@dataclasses.dataclass
class Model:
    name: str
    build: callable
    batch: int
    seq: int
    vocab: int


def _llama():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096, attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def _bert():
    import transformers

    config = transformers.BertConfig(
        vocab_size=30522, hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
        max_position_embeddings=512, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa",
    )
    return transformers.BertForMaskedLM(config)


MODELS = [Model("llama-4L-2048", _llama, 4, 2048, 32000), Model("bert-large-4L", _bert, 32, 512, 30522)]


def tk_ops_called(codes: list[str]) -> list[str]:
    """The tk ops that Inductor's generated code calls."""
    return sorted(set(re.findall(r"torch\.ops\.tk\.(\w+)", "\n".join(codes))))


def _measure(model: Model, rewrite: bool) -> dict:
    torch._dynamo.reset()
    if rewrite:
        tk_ops.inductor.enable()
    else:
        tk_ops.inductor.disable()
    net = model.build().to("cuda", torch.bfloat16)
    compiled = torch.compile(net)
    inputs = [(torch.randint(0, model.vocab, (model.batch, model.seq), device="cuda"),) for _ in range(2)]

    def forward(ids):
        with torch.no_grad():
            return compiled(input_ids=ids).logits

    def train_step(ids):
        loss = compiled(input_ids=ids).logits.float().logsumexp(-1).mean()
        loss.backward()

    _, forward_code = run_and_get_code(forward, *inputs[0])
    _, train_code = run_and_get_code(train_step, *inputs[0])
    calls = tk_ops_called(forward_code + train_code)
    result = {
        "forward_ms": common.time_ms(forward, inputs, warmup=3, rounds=10, batch=3),
        "train_step_ms": common.time_ms(train_step, inputs, warmup=3, rounds=10, batch=3),
        "tk_ops_called": calls,
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, help="also write the results into this folder")
    args = parser.parse_args()

    rows = []
    print(f"{'model':16} {'pass':10} {'compile ms':>11} {'+tk ms':>9} {'ratio':>6}  tk ops in the code")
    for model in MODELS:
        baseline = _measure(model, rewrite=False)
        torch.cuda.empty_cache()
        ours = _measure(model, rewrite=True)
        torch.cuda.empty_cache()
        for measure in ("forward_ms", "train_step_ms"):
            row = {
                "shape": f"{model.name} B={model.batch} N={model.seq}",
                "pass": measure.removesuffix("_ms"),
                "ours_ms": round(ours[measure], 4),
                "baseline": "torch.compile",
                "baseline_ms": round(baseline[measure], 4),
                "ratio": round(baseline[measure] / ours[measure], 3),
                "tk_ops_called": ours["tk_ops_called"],
            }
            rows.append(row)
            print(
                f"{model.name:16} {row['pass']:10} {row['baseline_ms']:11.3f} {row['ours_ms']:9.3f} "
                f"{row['ratio']:6.3f}  {','.join(row['tk_ops_called'])}"
            )
    tk_ops.inductor.disable()
    out_dirs = [common.RESULTS] + ([args.out] if args.out else [])
    common.write_results("compile", rows, out_dirs, backends=tk_ops.backends())


if __name__ == "__main__":
    main()
