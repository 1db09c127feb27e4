"""torch.compile with and without ``tk_ops.inductor.enable()``: HF Llama and BERT, fwd and train step.

Unchanged Hugging Face models (built from configs, the same random weights on both sides, bf16)
compiled by Inductor, once after ``tk_ops.inductor.enable()`` (ours) and once as is (the baseline
"torch.compile"); each timed forward-only and as a training step (forward + backward of the logits'
mean logsumexp), on benchmarks/common.py's harness. The rows add the tk ops that ours' generated code
for that pass calls (tk_ops_called), and the relative difference of ours' logits (forward) or loss
(training step, the first) from the baseline's.

    python3 -m benchmarks.bench_compile [--out DIR] [--pass forward|train_step]
    python3 -m benchmarks.bench_compile --dry-run [--out DIR]   # CPU, tiny models, nothing timed
"""

from __future__ import annotations

import dataclasses
import functools
import re

import torch
from torch._inductor.utils import run_and_get_code

import tk_ops.inductor
from benchmarks import common

PASSES = ("forward", "train_step")


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    family: str  # "llama" (LlamaForCausalLM) or "bert" (BertForMaskedLM)
    batch: int
    seq: int
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int

    @property
    def label(self) -> str:
        return f"{self.name} B={self.batch} N={self.seq}"


MODELS = [Model("llama-4L-2048", "llama", 4, 2048, 32000, 2048, 5632, 4, 16, 4),
          Model("bert-large-4L", "bert", 32, 512, 30522, 1024, 4096, 4, 16, 16)]
DRY_RUN_MODELS = [Model("llama-tiny", "llama", 2, 32, 256, 64, 128, 1, 4, 2),
                  Model("bert-tiny", "bert", 2, 32, 256, 64, 128, 1, 4, 4)]


def network(model: Model, device) -> torch.nn.Module:
    """The model in bf16, with the weights of seed 0 (the same on both sides)."""
    import transformers

    torch.manual_seed(0)
    if model.family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=model.vocab, hidden_size=model.hidden, intermediate_size=model.intermediate,
            num_hidden_layers=model.layers, num_attention_heads=model.heads, num_key_value_heads=model.kv_heads,
            max_position_embeddings=4096, attn_implementation="sdpa")
        return transformers.LlamaForCausalLM(config).to(device, torch.bfloat16)
    config = transformers.BertConfig(
        vocab_size=model.vocab, hidden_size=model.hidden, intermediate_size=model.intermediate,
        num_hidden_layers=model.layers, num_attention_heads=model.heads, max_position_embeddings=512,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    return transformers.BertForMaskedLM(config).to(device, torch.bfloat16)


def tk_ops_called(codes: list[str]) -> list[str]:
    """The tk ops that Inductor's generated code calls."""
    return sorted(set(re.findall(r"torch\.ops\.tk\.(\w+)", "\n".join(codes))))


class Compiled:
    """One side's model compiled for one pass. Built and compiled at the first call, on its inputs' device
    and with tk_ops.inductor enabled or not (the switch counts while Inductor compiles); that call's
    generated code gives row_fields: the tk ops it calls."""

    def __init__(self, model: Model, pass_: str, rewrite: bool):
        self.model, self.pass_, self.rewrite = model, pass_, rewrite
        self.net, self.row_fields = None, None

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """The logits (forward), or the loss after its backward (training step)."""
        if self.pass_ == "forward":
            with torch.no_grad():
                return self.net(input_ids=ids).logits
        loss = self.net(input_ids=ids).logits.float().logsumexp(-1).mean()
        loss.backward()
        return loss.detach()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.net is not None:
            return self.step(ids)
        torch._dynamo.reset()
        (tk_ops.inductor.enable if self.rewrite else tk_ops.inductor.disable)()
        self.net = torch.compile(network(self.model, ids.device))
        out, codes = run_and_get_code(self.step, ids)
        if self.rewrite:
            self.row_fields = {"tk_ops_called": tk_ops_called(codes)}
        return out


BENCH = common.Bench(
    "compile", "torch.compile with and without tk_ops.inductor (bf16)",
    ours=common.Provider("tk_ops", lambda model, pass_: Compiled(model, pass_, rewrite=True)),
    baselines=(common.Provider("torch.compile", lambda model, pass_: Compiled(model, pass_, rewrite=False)),),
    inputs=lambda model, pass_, device: (torch.randint(0, model.vocab, (model.batch, model.seq), device=device),),
    passes=PASSES, set_bytes=lambda model, pass_, inputs: common.tensor_bytes(inputs), max_sets=2,
    timer=functools.partial(common.time_ms, warmup=3, rounds=10, batch=3), shown=("tk_ops_called",))


def main(argv=None) -> None:
    args = common.arguments(__doc__, PASSES, check=False).parse_args(argv)
    try:
        if not common.without_gpu(args, BENCH, DRY_RUN_MODELS):
            common.run(BENCH, MODELS, passes=args.passes, out=args.out, backends=tk_ops.backends())
    finally:
        tk_ops.inductor.disable()


if __name__ == "__main__":
    main()
