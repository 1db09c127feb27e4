"""benchmarks.bench_training's dry run (the nano presets for 2 steps on the CPU), each variant a models.train
process, the peer variants on the fakes of tests/fake_peers: the rows of the new models next to the
H100's Llama rows of the committed file (written before the file held several models), the
comparisons per model, a failed run's row, the plot."""

from __future__ import annotations

import json
import shutil

import pytest

from benchmarks import bench_training, common
from models import data
from test_train import synthetic_text

LLAMA_VARIANTS = ("tk-eager", "tk-compile", "reference-eager", "reference-compile")
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    data.prepare(out, synthetic_text(), source="synthetic", vocab_size=320)
    return out


def bench(data_dir, out, *options: str) -> dict:
    bench_training.main(["--dry-run", "--data", str(data_dir), "--out", str(out), *options])
    return json.loads((out / "training.json").read_text())


def test_new_models_rows_join_the_llama_rows(data_dir, tmp_path, fake_peers):
    shutil.copy(common.RESULTS / "training.json", tmp_path / "training.json")
    document = bench(data_dir, tmp_path, "--models", "based,hyena", "--variants", "tk-eager,peer-eager")
    rows = {(row["model"], row["preset"], row["variant"]): row for row in document["rows"]}
    new = [("based", "nano", "tk-eager"), ("based", "nano", "peer-eager"), ("hyena", "nano", "tk-eager")]
    stored_rows = {(r["model"], r["preset"], r["variant"]): r
                   for r in json.loads((common.RESULTS / "training.json").read_text())["rows"]}
    stored = set(stored_rows)
    assert {("llama", "1b", variant) for variant in LLAMA_VARIANTS} <= stored
    assert set(rows) == stored | set(new)  # the stored rows of other presets kept; no hyena peer run
    assert rows[("llama", "1b", "tk-compile")] == stored_rows[("llama", "1b", "tk-compile")]  # kept as stored
    for key in new:
        row = rows[key]
        assert "error" not in row and row["tokens_per_s"] > 0 and len(row["train_loss"]) == 2 and row["steps"] == 2
        assert row["gpu"] is None and row["commit"] == document["commit"]
    assert rows[new[1]]["path"] == "peer" and fake_peers["based"] == []  # the fakes ran in the subprocess
    assert rows[new[1]]["train_loss"] == pytest.approx(rows[new[0]]["train_loss"], rel=1e-4)
    summaries = {(s["model"], s["preset"]): s for s in document["models"]}
    stored_llama = next(s for s in json.loads((common.RESULTS / "training.json").read_text())["models"] if s["model"] == "llama")
    assert summaries[("llama", "1b")]["speedup"] == stored_llama["speedup"] and summaries[("llama", "1b")]["steps"] == 60
    based = summaries[("based", "nano")]
    assert based["peer"].startswith("fla") and based["loss_gap"] < 1e-3 and "speedup_vs_peer_eager" in based
    assert (tmp_path / "training.png").read_bytes()[:8] == PNG


def test_failure_line_names_the_exception_not_the_caret():
    stderr = """Traceback (most recent call last):
  File "x.py", line 1, in <module>
torch._inductor.exc.InductorError: SubprocException: An exception occurred in a subprocess:
triton.compiler.errors.CompilationError: at 84:15:
        b_dq = tl.dot(b_ds, b_k, b_dq)
               ^
"""
    assert common.failure_line(stderr) == "triton.compiler.errors.CompilationError: at 84:15:"
    assert common.failure_line("killed\n") == "killed"


def test_a_failed_run_leaves_a_row_with_its_error(data_dir, tmp_path, monkeypatch):
    broken = tmp_path / "broken"
    (broken / "fla").mkdir(parents=True)
    (broken / "fla" / "__init__.py").write_text('raise ImportError("broken on purpose")\n')
    monkeypatch.setenv("PYTHONPATH", str(broken))
    document = bench(data_dir, tmp_path, "--models", "based", "--variants", "peer-eager")
    (row,) = document["rows"]
    assert row["tokens_per_s"] is None and row["train_loss"] == []
    assert row["error"].startswith("models.peers.PeerUnavailable") and "broken on purpose" in row["error"]
    assert document["models"] == [
        {"model": "based", "preset": "nano", "parameters": None, "tokens_per_step": None, "steps": 2,
         "peer": "fla-core parallel_based"}
    ]  # fmt: skip
    assert (tmp_path / "training.png").read_bytes()[:8] == PNG
