"""models.generate and the Llama model's KV cache: with random weights (float64, so that no near-tie can
flip an argmax), generation with the paged cache gives the tokens and logits of re-running the whole
model on the growing sequence; sampling; and the command line on a checkpoint that models.train writes."""

from __future__ import annotations

import pytest
import torch

from models import data, generate, train
from models.llama import LlamaConfig, LlamaForCausalLM
import tk_testing
from test_train import synthetic_text, train_args

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

CONFIG = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=40)


def random_llama(**overrides) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**{**CONFIG, **overrides})).double().eval()


def test_greedy_generation_with_the_cache_equals_rerunning_the_model_without_one():
    model = random_llama()
    prompt = torch.randint(0, 97, (2, 7))
    cached = generate.generate(model, prompt, 25, block_size=4)  # the blocks fill across the prompt and steps
    rerun = model.generate(prompt, 25, temperature=0)  # the whole sequence through the model at every step
    assert torch.equal(cached.tokens, rerun)
    assert cached.prefill_tokens == 7 and cached.new_tokens == 25


@pytest.mark.parametrize("sliding_window", [None, 5], ids=["full", "window-5"])
def test_cached_logits_equal_those_of_the_whole_sequence(sliding_window):
    model = random_llama(sliding_window=sliding_window)
    tokens = torch.randint(0, 97, (3, 20))
    full = model(tokens)
    cache = model.kv_cache(3, 20, block_size=3)
    with torch.no_grad():
        steps = [model(tokens[:, :6], cache=cache)] + [model(tokens[:, i:i + 1], cache=cache) for i in range(6, 17)]
        steps.append(model(tokens[:, 17:], cache=cache))  # three tokens at once against the cache
    torch.testing.assert_close(torch.cat(steps, dim=1), full)
    assert cache.length == 20 and cache.cache_seqlens.tolist() == [20] * 3
    # every sequence owns ceil(20 / 3) blocks, none shared
    assert sorted(cache.block_table.flatten().tolist()) == list(range(21))


def test_sampling_is_reproducible_and_keeps_to_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(400, 4)
    draws = generate.sample_next(logits, temperature=1.0, top_p=0.6, generator=torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {0, 1}  # 0.5 alone is short of 0.6; 0.5 + 0.3 reaches it
    again = generate.sample_next(logits, temperature=1.0, top_p=0.6, generator=torch.Generator().manual_seed(0))
    assert torch.equal(draws, again)
    everything = generate.sample_next(logits, temperature=1.0, top_p=1.0, generator=torch.Generator().manual_seed(1))
    assert set(everything.tolist()) == {0, 1, 2, 3}
    assert generate.sample_next(logits, temperature=1.0, top_p=0.1).eq(0).all()
    assert generate.sample_next(logits[:2], temperature=0.0, top_p=1.0).eq(0).all()


def test_generation_refuses_more_than_the_context_and_the_reference_path():
    with pytest.raises(ValueError, match="exceed the model's context of 40 positions"):
        generate.generate(random_llama(), torch.zeros(1, 30, dtype=torch.long), 11)
    model = random_llama(reference=True)
    with pytest.raises(ValueError, match="the KV cache runs on the tk path only"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=model.kv_cache(1, 8))


def test_the_command_line_generates_from_a_trained_checkpoint(tmp_path, capsys):
    data_dir = tmp_path / "data"
    data.prepare(data_dir, synthetic_text(), source="synthetic", vocab_size=320)
    run_dir = tmp_path / "run"
    train.main(train_args(run_dir, data_dir, "--sample-tokens", "0"))
    capsys.readouterr()
    arguments = ["--model", "llama", "--checkpoint", str(run_dir), "--data", str(data_dir), "--prompt", "The king",
                 "--max-new-tokens", "12", "--block-size", "8"]
    greedy = generate.main(arguments)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("llama (0.") and "greedy, paged KV cache in blocks of 8" in printed[0]
    assert printed[1].startswith("The king")
    assert printed[2].startswith("time to first token") and "decode 11 tokens at" in printed[2]
    assert greedy.tokens.shape[1] == greedy.prefill_tokens + 12
    sampled = [generate.main([*arguments, "--temperature", "0.8", "--top-p", "0.9", "--seed", "3"]).tokens
               for _ in range(2)]
    assert torch.equal(sampled[0], sampled[1])
    with pytest.raises(SystemExit, match="no checkpoint at"):
        generate.main(["--model", "llama", "--checkpoint", str(tmp_path / "nowhere"), "--data", str(data_dir)])


@tk_testing.requires_kernel("attention_with_kvcache")
@pytest.mark.parametrize("block_size", [128, 256])
def test_decode_steps_replayed_from_a_cuda_graph_equal_eager_ones(block_size):
    """The graph's replays append to the cache and advance its lengths on the device: the tokens, the
    cache's contents and its lengths equal those of steps launched from Python (bf16, same kernels)."""
    torch.manual_seed(0)
    # head dim 64: one the kernel takes (the reference would read the lengths on the host, which no capture can)
    model = random_llama(max_position_embeddings=300, hidden_size=256, intermediate_size=256).to("cuda", torch.bfloat16)
    prompt = torch.randint(0, 97, (3, 7), device="cuda")
    results, caches = [], []
    for graph in (False, True):
        cache_of = model.kv_cache
        made = []
        model.kv_cache = lambda *a, **k: made.append(cache_of(*a, **k)) or made[-1]  # keep the cache to compare
        try:
            results.append(generate.generate(model, prompt, 140, block_size=block_size, cuda_graph=graph))
        finally:
            del model.kv_cache
        caches.append(made[0])
    assert torch.equal(results[0].tokens, results[1].tokens)
    assert results[1].capture_s > 0 and results[0].capture_s == 0
    eager, graphed = caches
    assert graphed.length == eager.length == 7 + 139 and torch.equal(graphed.cache_seqlens, eager.cache_seqlens)
    for a, b in zip(eager.keys + eager.values, graphed.keys + graphed.values):
        tk_testing.assert_rel_close(b, a, tk_testing.TOLERANCE[torch.bfloat16], "cache")
