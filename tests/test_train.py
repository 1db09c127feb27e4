"""models.data and models.train: corpus preparation, batches, schedule, training, checkpoints and
bit-for-bit resume, the peer path (on the fakes of tests/fake_peers), and 2-process DDP / FSDP2 runs
(gloo on CPU, compiled blocks under FSDP2 for the linear-time models) against one process.

The corpus here is a synthetic English-like text in short chapters (the shipped KJV:
tests/test_corpus.py); the models are the ``nano`` presets, a few steps each.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from models import checkpoint, data, train

REPO_ROOT = Path(__file__).resolve().parent.parent
NOUNS = "king land city house people son daughter river mountain bread water fire servant law word day night".split()
VERBS = "went came spake built gave took saw heard kept sent called blessed".split()
CONNECTIVES = ["and", "unto", "for", "upon", "with", "before", "after", "because of"]

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# a heading between blank lines (a document's start, as the KJV's chapter headings) every this many lines
CHAPTER_LINES = 4


def synthetic_text(lines: int = 6000, seed: int = 0) -> str:
    rng = random.Random(seed)

    def phrase() -> str:
        return f"the {rng.choice(NOUNS)} {rng.choice(VERBS)} {rng.choice(CONNECTIVES)} the {rng.choice(NOUNS)}"

    def heading(line: int) -> str:
        chapter = line // CHAPTER_LINES + 1
        return ("" if chapter == 1 else "\n") + f"Chapter {chapter}\n\n" if line % CHAPTER_LINES == 0 else ""

    return "".join(f"{heading(line)}{phrase().capitalize()}, {phrase()}.\n" for line in range(lines))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data")
    data.prepare(out, synthetic_text(), source="synthetic", vocab_size=320)
    return out


def train_args(out: Path, data_dir: Path, *extra: str, model: str = "llama") -> list[str]:
    """models.train's command line for the nano preset on the synthetic data, without progress bars."""
    return [
        "--model",
        model,
        "--preset",
        "nano",
        "--data",
        str(data_dir),
        "--out",
        str(out),
        "--no-progress",
        "--eval-batches",
        "2",
        *extra,
    ]


def run(out: Path, data_dir: Path, *extra: str, model: str = "llama") -> dict:
    return train.main(train_args(out, data_dir, *extra, model=model))


def losses(summary: dict, which: str = "train_loss") -> list[float]:
    return [loss for _, loss in summary[which]]


# ------------------------------------------------------------------------------------ data


def test_prepare_writes_token_files_and_a_round_tripping_tokenizer(data_dir):
    meta = json.loads((data_dir / "meta.json").read_text())
    assert meta["vocab_size"] == 320 and meta["source"] == "synthetic"
    tokenizer = data.Tokenizer(data_dir / "tokenizer.json")
    assert tokenizer.mask_id == meta["mask_token_id"]
    train_ids = np.fromfile(data_dir / "train.bin", dtype=np.uint16)
    val_ids = np.fromfile(data_dir / "val.bin", dtype=np.uint16)
    assert len(train_ids) == meta["train_tokens"] and len(val_ids) == meta["val_tokens"] > 0
    assert len(val_ids) % data.VAL_BLOCK_TOKENS == 0
    assert 0.03 < len(val_ids) / (len(train_ids) + len(val_ids)) < 0.06
    all_ids = np.concatenate(data.split_train_val(tokenizer.encode_lines(synthetic_text())))
    assert np.array_equal(all_ids, np.concatenate([train_ids, val_ids]))
    for text in ("And the king went unto the city.\n", "naïve café — 42 ünïcödé\tok"):
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_prepare_rejects_short_text_and_bad_vocab(tmp_path):
    with pytest.raises(ValueError, match="too short"):
        data.prepare(tmp_path, "Too short.\n", vocab_size=300)
    with pytest.raises(ValueError, match="vocab_size"):
        data.prepare(tmp_path, synthetic_text(10), vocab_size=2**16 + 1)


def test_prepare_without_bible_kjv_says_what_is_missing(tmp_path):
    """``--corpus bible-kjv`` without the package (the default corpus ships in models/corpus:
    tests/test_corpus.py). No traceback: what is missing, how to install it, and the --text alternative; exit status 1."""
    result = subprocess.run(
        [sys.executable, "-m", "models.data", "prepare", "--corpus", "bible-kjv", "--out", str(tmp_path)],
        cwd=REPO_ROOT,
        env={**os.environ, "PATH": str(tmp_path)},  # no `bible` program
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "bible-kjv" in result.stderr and "apt-get install -y bible-kjv" in result.stderr
    assert "--text FILE" in result.stderr


def test_clean_kjv_drops_verse_numbers():
    raw = "\nGenesis 1\n\n  1 In the beginning God created the heaven and the earth.\n  2 And the earth was.\n"
    assert (
        data.clean_kjv(raw)
        == "Genesis 1\n\nIn the beginning God created the heaven and the earth.\nAnd the earth was.\n"
    )


def test_lm_batches_are_shifted_windows_given_by_seed_and_step(data_dir):
    ids = data.TokenData.load(data_dir).train
    make = lambda seed: data.Batches(ids, kind="lm", seq_len=16, global_batch=6, seed=seed)  # noqa: E731
    batches = make(0)
    inputs, targets = batches.global_batch_at(3)
    assert inputs.shape == targets.shape == (6, 16) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    starts = [int(s) for s in batches._window_starts(3)]
    assert all(s % 16 == 0 for s in starts)
    assert torch.equal(inputs[0], torch.from_numpy(ids[starts[0] : starts[0] + 16].astype(np.int64)))
    assert torch.equal(make(0).global_batch_at(3)[0], inputs)  # a pure function of (seed, step)
    assert not torch.equal(make(1).global_batch_at(3)[0], inputs)
    assert not torch.equal(batches.global_batch_at(4)[0], inputs)
    # one epoch visits every window once
    epoch = torch.cat([batches._window_starts(step) for step in range(batches.steps_per_epoch)])
    assert len(set(epoch.tolist())) == len(epoch) == batches.steps_per_epoch * 6


def test_heading_lines_begin_documents():
    lines = ["Genesis 1\n", "\n", "In the beginning.\n", "And the earth.\n", "\n", "Genesis 2\n", "\n", "Thus.\n"]
    assert data.heading_lines(lines) == [0, 5]
    assert data.heading_lines(["One paragraph.\n", "No headings.\n"]) == []


def test_prepare_records_where_documents_begin(data_dir):
    prepared = data.TokenData.load(data_dir)
    tokenizer = prepared.tokenizer()
    for ids, starts in ((prepared.train, prepared.train_documents), (prepared.val, prepared.val_documents)):
        assert starts[0] == 0 and (np.diff(starts) > 0).all() and starts[-1] < len(ids)
        # all but the starts where a split jumps over the other's blocks are chapter headings
        headings = [start for start in starts if tokenizer.decode(ids[start : start + 8]).startswith("Chapter")]
        jumps = len(ids) // data.VAL_BLOCK_TOKENS + 1
        assert len(starts) - jumps <= len(headings) <= len(starts)
    assert prepared.meta["train_documents"] == len(prepared.train_documents)


def test_split_document_starts_adds_the_jumps_between_blocks():
    block, every = data.VAL_BLOCK_TOKENS, data.VAL_EVERY_BLOCKS
    total = (every + 1) * block + 10  # train blocks 0..18, val block 19, train block 20 and 10 tokens of 21
    train, val = data.split_document_starts(np.array([5, (every - 1) * block + 7, every * block + 3]), total)
    assert train.tolist() == [0, 5, (every - 1) * block, (every - 1) * block + 3]
    assert val.tolist() == [0, 7]


def test_positions_restart_at_each_document_and_each_row(data_dir):
    prepared = data.TokenData.load(data_dir)
    batches = data.Batches(prepared.train, kind="lm", seq_len=64, global_batch=8, seed=0,
                           document_starts=prepared.train_documents)  # fmt: skip
    positions = batches.positions_at(5)
    starts = set(prepared.train_documents.tolist())
    for row, row_start in zip(positions.tolist(), batches._window_starts(5).tolist()):
        expected, position = [], 0
        for token in range(row_start, row_start + 64):
            position = 0 if token == row_start or token in starts else position + 1
            expected.append(position)
        assert row == expected
    assert (positions == 0).sum() > 8  # some rows hold more than one document


def test_mlm_batches_mask_fifteen_percent(data_dir):
    prepared = data.TokenData.load(data_dir)
    batches = data.Batches(
        prepared.train,
        kind="mlm",
        seq_len=64,
        global_batch=64,
        seed=0,
        vocab_size=prepared.meta["vocab_size"],
        mask_id=prepared.meta["mask_token_id"],
    )
    inputs, labels = batches.global_batch_at(0)
    original = torch.from_numpy(
        np.stack([prepared.train[s : s + 64] for s in batches._window_starts(0).tolist()]).astype(np.int64)
    )
    selected = labels != data.IGNORE_INDEX
    assert 0.13 < selected.float().mean() < 0.17
    assert torch.equal(labels[selected], original[selected])
    assert torch.equal(inputs[~selected], original[~selected])
    masked = (inputs == prepared.meta["mask_token_id"]) & selected
    assert 0.75 < masked.sum() / selected.sum() < 0.85
    assert torch.equal(batches.global_batch_at(0)[0], inputs)


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    args = train.parse_args(
        ["--model", "llama", "--preset", "nano", "--steps", "100", "--warmup", "10", "--lr", "1.0"]
    )[0]
    schedule = [train.learning_rate(step, args) for step in range(100)]
    assert schedule[0] == pytest.approx(0.1) and schedule[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(schedule[9:], schedule[10:]))
    assert schedule[-1] == pytest.approx(0.1, abs=1e-3)


# ----------------------------------------------------------------------------------- training


def test_training_lowers_the_loss_and_writes_checkpoint_plot_summary(data_dir, tmp_path):
    summary = run(tmp_path, data_dir, "--steps", "12", "--eval-every", "6", "--sample-tokens", "5")
    evals = losses(summary, "eval_loss")
    assert [step for step, _ in summary["eval_loss"]] == [0, 6, 12]
    assert evals[-1] < evals[0] - 0.5
    assert json.loads((tmp_path / "summary.json").read_text())["train_loss"] == summary["train_loss"]
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert isinstance(summary["sample"], str) and summary["sample"].startswith("And God said")
    checkpoint = load_file(str(tmp_path / "checkpoint.safetensors"))
    assert "model.model.embed_tokens.weight" in checkpoint and "model.lm_head.weight" not in checkpoint  # tied
    assert {"optimizer.model.embed_tokens.weight.exp_avg", "optimizer.model.norm.weight.step", "rng.cpu.0"} <= set(
        checkpoint
    )


def test_checkpoint_loads_as_a_model_and_into_hugging_face(data_dir, tmp_path):
    transformers = pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")
    run(tmp_path, data_dir, "--steps", "2", "--sample-tokens", "0")
    model = checkpoint.load_model(tmp_path / "checkpoint.safetensors")
    weights = load_file(str(tmp_path / "checkpoint.safetensors"))
    assert torch.equal(model.model.embed_tokens.weight, weights["model.model.embed_tokens.weight"])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**model.config.to_hf_dict())).eval()
    missing, unexpected = hf.load_state_dict(
        {key.removeprefix("model."): value for key, value in weights.items() if key.startswith("model.")}, strict=False
    )
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding, as in Hugging Face
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", ["llama", "bert", "based", "mamba2", "hyena", "gdn"])
def test_resume_continues_bit_for_bit(data_dir, tmp_path, model):
    """6 steps in one go == 3 steps, stop, resume for 3 (BERT also draws dropout masks)."""
    common = ["--steps", "6", "--eval-every", "2", "--sample-tokens", "0"]
    whole = run(tmp_path / "whole", data_dir, *common, model=model)
    run(tmp_path / "split", data_dir, *common, "--stop-at", "3", model=model)
    resumed = run(tmp_path / "split", data_dir, *common, "--resume", model=model)
    # Bit for bit is the contract: both runs are in this process, on one intra-op thread, with the
    # same shapes, so every step repeats the same operations on the same values.
    assert resumed["train_loss"] == whole["train_loss"]
    # the stopped run also evaluated at its stop (step 3)
    assert [entry for entry in resumed["eval_loss"] if entry[0] != 3] == whole["eval_loss"]
    final_whole = load_file(str(tmp_path / "whole" / "checkpoint.safetensors"))
    final_split = load_file(str(tmp_path / "split" / "checkpoint.safetensors"))
    assert final_whole.keys() == final_split.keys()
    assert all(torch.equal(final_whole[k], final_split[k]) for k in final_whole)


@pytest.mark.parametrize("model", ["based", "mamba2", "hyena", "gdn"])
def test_linear_time_models_lower_the_loss_and_sample(data_dir, tmp_path, model):
    summary = run(tmp_path, data_dir, "--steps", "12", "--eval-every", "12", "--sample-tokens", "3", model=model)
    evals = losses(summary, "eval_loss")
    assert evals[-1] < evals[0] - 0.5
    assert summary["sample"].startswith("And God said")
    reloaded = checkpoint.load_model(tmp_path / "checkpoint.safetensors", reference=True)
    assert type(reloaded).__module__ == f"models.{model}"


def test_resume_refuses_another_seed(data_dir, tmp_path):
    run(tmp_path, data_dir, "--steps", "2", "--sample-tokens", "0")
    with pytest.raises(SystemExit, match="seed"):
        run(tmp_path, data_dir, "--steps", "4", "--resume", "--seed", "1")


@pytest.mark.parametrize("model, tolerance", [("llama", 1e-4), ("bert", 2e-2)])
def test_reference_path_follows_the_same_loss_curve(data_dir, tmp_path, model, tolerance):
    """Same initial weights and batches; BERT's dropout masks differ between the paths (tk_ops.layer_norm
    draws its own), hence the looser tolerance there."""
    common = ["--steps", "4", "--sample-tokens", "0", "--no-save", "--eval-batches", "1"]
    tk = losses(run(tmp_path / "tk", data_dir, *common, model=model))
    reference = losses(run(tmp_path / "reference", data_dir, *common, "--reference", model=model))
    assert tk == pytest.approx(reference, rel=tolerance)


@pytest.mark.parametrize("model", ["based", "mamba2"])
def test_peer_path_follows_the_reference_path(data_dir, tmp_path, fake_peers, model):
    """--peer trains the reference model with the peer's mixer op (here the fakes of fla and mamba_ssm):
    the reference path's losses; its checkpoint loads on the tk path."""
    common = ["--steps", "3", "--eval-every", "3", "--sample-tokens", "0", "--eval-batches", "1"]
    peer = run(tmp_path / "peer", data_dir, *common, "--peer", model=model)
    reference = run(tmp_path / "reference", data_dir, *common, "--reference", "--no-save", model=model)
    assert peer["path"] == "peer" and peer["config"]["peer"] and peer["config"]["reference"]
    assert fake_peers[model], "the peer op was not called"
    assert losses(peer) == pytest.approx(losses(reference), rel=1e-5)
    reloaded = checkpoint.load_model(tmp_path / "peer" / "checkpoint.safetensors")
    assert not reloaded.config.reference and not reloaded.config.peer


def test_packed_training_lowers_the_loss_and_the_reference_path_follows(data_dir, tmp_path):
    """--pack on the tk path (attention_varlen) and on the reference path (the block-diagonal mask): the
    loss goes down, both paths give the same losses, and packing changed them (rows hold several documents)."""
    common = ["--steps", "12", "--eval-every", "6", "--sample-tokens", "0", "--no-save"]
    packed = run(tmp_path / "tk", data_dir, *common, "--pack")
    assert packed["pack"] and losses(packed, "eval_loss")[-1] < losses(packed, "eval_loss")[0] - 0.5
    reference = run(tmp_path / "reference", data_dir, *common, "--pack", "--reference")
    assert losses(packed) == pytest.approx(losses(reference), rel=1e-4)
    assert losses(packed, "eval_loss") == pytest.approx(losses(reference, "eval_loss"), rel=1e-4)
    unpacked = run(tmp_path / "unpacked", data_dir, "--steps", "1", "--sample-tokens", "0", "--no-save")
    assert losses(unpacked, "eval_loss")[0] != pytest.approx(losses(packed, "eval_loss")[0], rel=1e-6)


def test_pack_is_refused_without_documents(data_dir, tmp_path):
    with pytest.raises(SystemExit):
        train.parse_args(["--model", "bert", "--preset", "nano", "--pack"])
    old = tmp_path / "old"
    old.mkdir()
    for name in ("meta.json", "tokenizer.json", "train.bin", "val.bin"):
        (old / name).write_bytes((data_dir / name).read_bytes())
    with pytest.raises(SystemExit, match="prepare it again"):
        run(tmp_path / "run", old, "--steps", "1", "--pack")


def test_peer_is_refused_where_the_reference_is_the_peer():
    with pytest.raises(SystemExit):
        train.parse_args(["--model", "llama", "--preset", "nano", "--peer"])


def test_gradient_accumulation_matches_the_whole_batch(data_dir, tmp_path):
    common = ["--steps", "3", "--sample-tokens", "0", "--no-save", "--eval-every", "3"]
    whole = run(tmp_path / "whole", data_dir, *common, "--batch-size", "8")
    accumulated = run(tmp_path / "accum", data_dir, *common, "--batch-size", "4", "--grad-accum", "2")
    assert losses(accumulated) == pytest.approx(losses(whole), rel=1e-5)
    assert losses(accumulated, "eval_loss") == pytest.approx(losses(whole, "eval_loss"), rel=1e-5)


# ------------------------------------------------------------------------------- torchrun


def torchrun(out: Path, data_dir: Path, *extra: str, model: str = "llama") -> dict:
    """2 CPU processes (gloo), global batch 8 = 2 ranks x 4 rows."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "models.train",
        *train_args(out, data_dir, "--sample-tokens", "0", "--eval-every", "2", *extra, model=model),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def one_process_reference(data_dir, tmp_path_factory) -> dict:
    """The 2-rank runs' global batch (8 rows) on one process: 2 micro-steps of 4 rows."""
    out = tmp_path_factory.mktemp("one-process")
    return run(out, data_dir, "--steps", "4", "--eval-every", "2", "--sample-tokens", "0", "--grad-accum", "2")


def test_ddp_then_fsdp_resume_on_two_processes_match_one_process(data_dir, tmp_path, one_process_reference):
    """Steps 1-2 with DDP, a checkpoint, steps 3-4 resumed with FSDP2: the losses of one process."""
    stopped = torchrun(tmp_path, data_dir, "--steps", "4", "--stop-at", "2", "--parallel", "ddp")
    assert stopped["world_size"] == 2 and stopped["parallel"] == "ddp"
    with safe_open(str(tmp_path / "checkpoint.safetensors"), "pt") as f:
        assert {"rng.cpu.0", "rng.cpu.1"} <= set(f.keys()) and f.metadata()["world_size"] == "2"
    resumed = torchrun(tmp_path, data_dir, "--steps", "4", "--parallel", "fsdp", "--resume")
    assert resumed["world_size"] == 2 and resumed["parallel"] == "fsdp"
    assert losses(resumed) == pytest.approx(losses(one_process_reference), rel=1e-5)
    assert losses(resumed, "eval_loss") == pytest.approx(losses(one_process_reference, "eval_loss"), rel=1e-5)


@pytest.mark.parametrize("model", ["based", "mamba2", "hyena"])
def test_linear_time_models_under_ddp_and_compiled_fsdp_match_one_process(data_dir, tmp_path, model):
    """2 steps of 8 rows: one process (2 micro-steps of 4) against DDP and against FSDP2 with every block
    compiled, each on two processes."""
    common = ["--steps", "2", "--no-save"]
    one = run(tmp_path / "one", data_dir, *common, "--eval-every", "2", "--sample-tokens", "0", "--grad-accum", "2",
              model=model)  # fmt: skip
    ddp = torchrun(tmp_path / "ddp", data_dir, *common, "--parallel", "ddp", model=model)
    fsdp = torchrun(tmp_path / "fsdp", data_dir, *common, "--parallel", "fsdp", "--compile", model=model)
    assert (ddp["parallel"], fsdp["parallel"], fsdp["compile"]) == ("ddp", "fsdp", True)
    for summary, tolerance in ((ddp, 1e-5), (fsdp, 1e-4)):
        assert losses(summary) == pytest.approx(losses(one), rel=tolerance)
        assert losses(summary, "eval_loss") == pytest.approx(losses(one, "eval_loss"), rel=tolerance)
