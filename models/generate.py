"""Generate text from a checkpoint of ``python -m models.train`` with a paged KV cache.

    python -m models.train --model llama --preset tiny          # writes runs/llama-tiny/checkpoint.safetensors
    python -m models.generate --model llama --checkpoint runs/llama-tiny --prompt "And God said"
    python -m models.generate --model llama --checkpoint runs/llama-tiny --temperature 0.8 --top-p 0.9

The prompt runs once through the model (the prefill: each layer's own causal ``tk_ops.attention``,
whose keys and values then fill a paged KV cache, ``models.kv_cache``); every next token is one step
of one token, each layer appending its key and value to the cache and attending to it with
``tk_ops.attention_with_kvcache``. On a GPU the step is captured once in a CUDA graph and replayed for
every next token (``--no-cuda-graph``: each step launched from Python): the cache's blocks are taken for
every position before the capture, and each replay reads its positions from the cache's lengths on the
device and advances them. Decoding is greedy by default (``--temperature 0``), or samples with a
temperature and nucleus (top-p) filtering, reproducibly from ``--seed`` (outside the graph, from its
logits). Prints the decoded text, the time to first token (the prefill and the first sampled token) and
the decode rate in tokens/s, both after an untimed warm-up generation of two tokens.

The tokenizer is that of the prepared data directory (``--data``, default ``.data/kjv``), which must be
the data the checkpoint was trained on. The context is the model's ``max_position_embeddings`` (the
training sequence length): prompt and new tokens must fit in it. The paged cache's blocks default to 128
positions, a size ``tk_ops.attention_with_kvcache``'s kernel takes (other sizes run its reference).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Optional

import torch

from models.checkpoint import load_model
from models.data import DEFAULT_DATA_DIR, TokenData
from tk_ops import _library

DEFAULT_NEW_TOKENS = 48
DEFAULT_BLOCK_SIZE = 128  # a block size attention_with_kvcache's kernel takes (its paged_block_multiple)


def sample_next(logits: torch.Tensor, *, temperature: float, top_p: float, generator=None) -> torch.Tensor:
    """The next token (B,) from logits (B, vocab): the argmax at temperature 0; otherwise a draw from
    softmax(logits / temperature) restricted to the smallest set of most likely tokens whose probability
    reaches ``top_p`` (nucleus sampling; top_p = 1: every token)."""
    if temperature == 0:
        return logits.argmax(-1)
    probabilities = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probabilities, order = probabilities.sort(dim=-1, descending=True)
    # a token is kept if the tokens more likely than it have not reached top_p yet (the first always is)
    before = sorted_probabilities.cumsum(-1) - sorted_probabilities
    sorted_probabilities = sorted_probabilities.masked_fill(before >= top_p, 0.0)
    choice = torch.multinomial(sorted_probabilities, 1, generator=generator)
    return order.gather(-1, choice).squeeze(-1)


@dataclasses.dataclass
class Generation:
    tokens: torch.Tensor  # (B, prompt + new tokens)
    prefill_tokens: int
    new_tokens: int
    time_to_first_token_s: float  # the prefill and the first sampled token
    decode_s: float  # the steps after the first token (without a CUDA graph's capture)
    capture_s: float = 0.0  # the capture of the CUDA graph of a decode step (none: 0)

    @property
    def decode_tokens_per_s(self) -> Optional[float]:
        """Tokens generated per second by the decode steps, over the whole batch (None without decode steps)."""
        steps = self.new_tokens - 1
        return self.tokens.shape[0] * steps / self.decode_s if steps > 0 and self.decode_s > 0 else None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _GraphedStep:
    """One decode step of ``model`` captured in a CUDA graph: ``logits(token)`` replays it for the next
    token (B, 1), appending to the cache and advancing its lengths on the device. The capture runs the
    step's Python once, so the cache's Python-side length is advanced here, not per replay: ``finish``
    sets it to the positions the replays wrote."""

    def __init__(self, model, cache, token: torch.Tensor, steps: int) -> None:
        self.cache, self.start = cache, cache.length
        cache.make_room(steps)  # every block the replays will write, before the capture fixes the table
        self.token = token.clone()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_logits = model(self.token, cache=cache)[:, -1]
        self.replays = 0

    def logits(self, token: torch.Tensor) -> torch.Tensor:
        self.token.copy_(token)
        self.graph.replay()
        self.replays += 1
        return self.static_logits

    def finish(self) -> None:
        self.cache.length = self.start + self.replays


@torch.inference_mode()
def generate(model, prompt: torch.Tensor, new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
             block_size: int = DEFAULT_BLOCK_SIZE, generator: Optional[torch.Generator] = None,
             cuda_graph: bool = False) -> Generation:
    """Continue each row of ``prompt`` (B, N) by ``new_tokens`` tokens (>= 1) with a paged KV cache: one
    prefill, then one decode step per token (with ``cuda_graph``, on a GPU: the first step eagerly, which
    also warms every kernel up, the others as replays of one captured step). The rows of a batch share the
    prompt length."""
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    context = model.config.max_position_embeddings
    if prompt.shape[1] + new_tokens > context:
        raise ValueError(
            f"the prompt ({prompt.shape[1]} tokens) and {new_tokens} new tokens exceed the model's context of "
            f"{context} positions (max_position_embeddings)"
        )
    cache = model.kv_cache(prompt.shape[0], prompt.shape[1] + new_tokens, block_size=block_size)
    device = prompt.device
    start = time.perf_counter()
    logits = model(prompt, cache=cache)[:, -1]
    tokens = [prompt, sample_next(logits, temperature=temperature, top_p=top_p, generator=generator)[:, None]]
    _synchronize(device)
    first_token = time.perf_counter()
    graphed, capture_s = None, 0.0
    for step in range(new_tokens - 1):
        if graphed is not None:
            logits = graphed.logits(tokens[-1])
        else:
            logits = model(tokens[-1], cache=cache)[:, -1]
        tokens.append(sample_next(logits, temperature=temperature, top_p=top_p, generator=generator)[:, None])
        remaining = new_tokens - 2 - step
        if cuda_graph and device.type == "cuda" and graphed is None and remaining > 0:
            _synchronize(device)
            before_capture = time.perf_counter()
            graphed = _GraphedStep(model, cache, tokens[-1], remaining)
            _synchronize(device)
            capture_s = time.perf_counter() - before_capture
    if graphed is not None:
        graphed.finish()
    _synchronize(device)
    return Generation(torch.cat(tokens, dim=1), prompt.shape[1], new_tokens, first_token - start,
                      time.perf_counter() - first_token - capture_s, capture_s)


def _kernel_takes_blocks(block_size: int) -> bool:
    """Whether attention_with_kvcache's kernel takes a paged cache of these blocks, as the extension declares
    it. A captured step needs the kernel: on other blocks its reference reads the cache's lengths on the host,
    which a capture cannot."""
    multiple = _library.kernel_support("attention_with_kvcache").get("paged_block_multiple")
    return bool(multiple) and block_size % multiple[0] == 0


def _checkpoint_file(path: Path) -> Path:
    """The checkpoint file: ``path`` itself, or the checkpoint.safetensors that models.train writes in a run directory."""
    file = path / "checkpoint.safetensors" if path.is_dir() else path
    if not file.is_file():
        raise SystemExit(f"--checkpoint: no checkpoint at {file} (train one: python -m models.train --model llama)")
    return file


def _metadata(file: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        return f.metadata()


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m models.generate",
        description="\n\n".join(__doc__.split("\n\n")[:3]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", choices=("llama",), required=True, help="the checkpoint's model")
    parser.add_argument("--checkpoint", type=Path, required=True,
                        help="a run directory of models.train, or its checkpoint.safetensors")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR, help="the prepared data (its tokenizer)")
    parser.add_argument("--prompt", default="And God said")
    parser.add_argument("--max-new-tokens", type=int,
                        help=f"default: {DEFAULT_NEW_TOKENS}, or what the model's context leaves after the prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this much probability")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                        help="positions per block of the paged KV cache (the kernel takes multiples of 128)")
    parser.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                        help="on a GPU with blocks the kernel takes, replay one captured decode step (default) "
                             "instead of launching each from Python")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), help="default: bf16 on GPU, fp32 on CPU")
    args = parser.parse_args(argv)
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if (args.max_new_tokens is not None and args.max_new_tokens < 1) or args.block_size < 1:
        parser.error("--max-new-tokens and --block-size must be >= 1")
    return args


def main(argv: Optional[list[str]] = None) -> Generation:
    args = parse_args(argv)
    file = _checkpoint_file(args.checkpoint)
    metadata = _metadata(file)
    if metadata.get("model") != args.model:
        raise SystemExit(f"{file} holds a {metadata.get('model')!r} model, not {args.model!r}")
    data = TokenData.load(args.data)
    trained_on = json.loads(metadata["data"])["text_sha256"]
    if data.meta["text_sha256"] != trained_on:
        raise SystemExit(f"{file} was trained on other data than {args.data}: pass the --data it was trained on")
    tokenizer = data.tokenizer()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    model = load_model(file).to(device=device, dtype=dtype)
    prompt = torch.tensor([tokenizer.encode(args.prompt)], device=device)
    new_tokens = args.max_new_tokens or min(DEFAULT_NEW_TOKENS, model.config.max_position_embeddings - prompt.shape[1])
    # Untimed, so that the times are those of a warm process: the first op call imports PyTorch's compiler
    # (seconds), the first of each kernel loads it.
    graph = args.cuda_graph and device.type == "cuda" and _kernel_takes_blocks(args.block_size)
    generate(model, prompt, min(2, new_tokens), block_size=args.block_size)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    result = generate(model, prompt, new_tokens, temperature=args.temperature, top_p=args.top_p,
                      block_size=args.block_size, generator=generator, cuda_graph=graph)
    parameters = sum(p.numel() for p in model.parameters())
    sampling = "greedy" if args.temperature == 0 else f"temperature {args.temperature}, top-p {args.top_p}"
    print(f"{args.model} ({parameters / 1e6:.1f}M parameters, step {metadata['step']}) from {file}; {device.type}, "
          f"{str(dtype).removeprefix('torch.')}, {sampling}, paged KV cache in blocks of {args.block_size}"
          f"{', decode steps replayed from a CUDA graph' if graph else ''}")
    print(tokenizer.decode(result.tokens[0].tolist()))
    rate = result.decode_tokens_per_s
    decode = f"{rate:,.1f} tokens/s" if rate else "no decode step"
    capture = f" (graph captured in {result.capture_s * 1e3:.1f} ms, not counted)" if result.capture_s else ""
    print(f"time to first token {result.time_to_first_token_s * 1e3:.1f} ms (prompt of {result.prefill_tokens} "
          f"tokens); decode {result.new_tokens - 1} tokens at {decode}{capture}")
    return result


if __name__ == "__main__":
    main()
