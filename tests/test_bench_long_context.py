"""benchmarks.bench_long_context and benchmarks.mixer_share on the CPU: the dry run (nano preset,
N = 32 and 64 at 128 tokens per step, one worker process per variant, the peers on the fakes of
tests/fake_peers) with the mixer share, the rows of an out-of-memory step, a failed peer and a dead
worker, and the mixer timer against a mixer made slow on purpose."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from unittest.mock import ANY

import pytest
import torch

from benchmarks import bench_long_context, common, mixer_share
from models import train

PNG = b"\x89PNG\r\n\x1a\n"
CPU = torch.device("cpu")
KEY = {"model": "based", "impl": "tk", "preset": "nano", "seq_len": 32, "batch_size": 2}

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def test_dry_run_measures_every_variant_and_length(tmp_path, fake_peers, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the workers: two threads on a busy CPU only wait for each other
    variants = ["based-tk", "based-peer", "mamba2-peer", "hyena-reference"]
    bench_long_context.main(["--dry-run", "--mixer-share", "--variants", ",".join(variants), "--out", str(tmp_path)])
    document = json.loads((tmp_path / "long_context.json").read_text())
    assert document["tokens_per_step"] == 128 and document["preset"] == "nano"
    rows = {(row["variant"], row["seq_len"]): row for row in document["rows"]}
    assert set(rows) == {(variant, n) for variant in variants for n in (32, 64)}
    for (variant, n), row in rows.items():
        assert "error" not in row, row
        assert row["batch_size"] * n == 128 and row["tokens_per_s"] > 0 and 0 < row["mixer_share"] < 1
        assert row["fallbacks"] == []  # the CPU runs every tk op's reference without a warning
    assert rows[("based-peer", 32)]["peer"] == "fla-core parallel_based" and rows[("based-tk", 32)]["peer"] is None
    assert rows[("hyena-reference", 64)]["peer"].startswith("torch.fft")
    assert all(row["gpu"] is None and row["commit"] == document["commit"] for row in rows.values())
    assert (tmp_path / "long_context.png").read_bytes()[:8] == PNG
    (tmp_path / "long_context.png").unlink()
    bench_long_context.main(["--plot-from", str(tmp_path / "long_context.json")])  # redrawn from the results file
    assert (tmp_path / "long_context.png").read_bytes()[:8] == PNG


def test_an_out_of_memory_step_and_a_missing_peer_leave_rows_with_their_error(monkeypatch):
    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    with monkeypatch.context() as patch:
        patch.setattr(train, "train_step", out_of_memory)
        row = mixer_share.measure_row(KEY, CPU, warmup=1, steps=1)
    assert row == {**KEY, "error": "out of memory"}
    monkeypatch.setitem(sys.modules, "fla", None)
    row = mixer_share.measure_row({**KEY, "impl": "peer"}, CPU, warmup=1, steps=1)
    assert row["error"].startswith("PeerUnavailable: models.based with peer=True runs fla.ops.based.parallel_based")


def test_a_dead_worker_leaves_rows_for_the_lengths_it_did_not_reach(monkeypatch):
    args = bench_long_context.parse_args(["--dry-run", "--variants", "mamba2-peer"])

    def dies_after_one_length(command, **kwargs):
        rows_file = command[command.index("--rows-file") + 1]
        with open(rows_file, "a") as f:
            f.write(json.dumps({"variant": "mamba2-peer", "seq_len": 32, "tokens_per_s": 1.0}) + "\n")
        return subprocess.CompletedProcess(command, -6, stderr="RuntimeError: CUDA error: an illegal memory access\n")

    monkeypatch.setattr(common.subprocess, "run", dies_after_one_length)
    first, second = bench_long_context.run_variant("mamba2-peer", args)
    assert first["seq_len"] == 32 and "error" not in first
    assert second["seq_len"] == 64 and second["batch_size"] == 2 and second["peer"].startswith("mamba_ssm")
    assert second["error"] == "worker exit status -6: RuntimeError: CUDA error: an illegal memory access"


def test_merged_rows_replace_only_what_was_measured_again(tmp_path):
    """A stored row keeps its run's GPU and commit (its file's, where it has none of its own); a new row gets this run's."""
    old = [{"variant": "based-tk", "seq_len": n, "tokens_per_s": n} for n in (32, 64)]
    stored = {"date": "2026-01-01", "gpu": "H100", "commit": "a37fcb9", "rows": old}
    (tmp_path / "long_context.json").write_text(json.dumps(stored))
    new = [{"variant": "based-tk", "seq_len": 64, "tokens_per_s": 1}]
    run = {key: common.environment()[key] for key in ("gpu", "commit")}
    merged = common.merged_rows("long_context", new, [tmp_path], ("variant", "seq_len"))
    assert [{key: row[key] for key in (*old[0], "gpu", "commit")} for row in merged] == [
        {**old[0], "gpu": "H100", "commit": "a37fcb9"}, {**new[0], **run}]
    assert common.merged_rows("long_context", new, [], ("variant", "seq_len"))[0]["tokens_per_s"] == 1  # no file: new rows


def test_mixer_timer_counts_the_mixers_and_nothing_else():
    setup = mixer_share.Setup("based", "tk", "nano", 32, 2, CPU)
    delay_s = 0.02

    def slow(forward):
        def run(*args, **kwargs):
            time.sleep(delay_s)
            return forward(*args, **kwargs)

        return run

    for mixer in setup.mixers:
        mixer.forward = slow(mixer.forward)
    timer = mixer_share.MixerTimer(setup.mixers, CPU)
    setup.run_steps(1)
    assert timer.milliseconds("forward") == 0  # disabled
    timer.enabled = True
    step_ms = setup.run_steps(2) * 1e3
    forward, backward = timer.milliseconds("forward") / 2, timer.milliseconds("backward") / 2
    assert len(timer.intervals["forward"]) == len(timer.intervals["backward"]) == 2 * len(setup.mixers)
    assert len(setup.mixers) * delay_s * 1e3 <= forward and 0 < backward and forward + backward < step_ms
    timer.remove()
    hooks = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
    assert not any(getattr(mixer, kind) for mixer in setup.mixers for kind in hooks)


def test_mixer_share_cli_writes_its_rows(tmp_path):
    (row,) = mixer_share.main(
        ["--models", "hyena", "--preset", "nano", "--steps", "1", "--warmup", "1", "--device", "cpu",
         "--out", str(tmp_path)]
    )  # fmt: skip
    assert row["seq_len"] == 32 and row["batch_size"] == 4 and 0 < row["mixer_share"] < 1
    assert json.loads((tmp_path / "mixer_share.json").read_text())["rows"] == [row | {"date": ANY, "gpu": None, "commit": ANY}]
