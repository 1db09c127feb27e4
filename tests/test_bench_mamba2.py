"""benchmarks/bench_mamba2.py without a GPU: its shapes, byte floors, the harness's chunk-size sweep and worker
process on its rows, dry run and correctness sweep."""

from __future__ import annotations

import dataclasses
import json
import textwrap

import pytest
import torch

import tk_ops
from benchmarks import bench_mamba2 as bench
from benchmarks import common


def test_arguments():
    args = bench.parse_args([])
    assert (args.out, args.check, args.dry_run, args.passes, args.chunks) == (None, False, False, None, [64, 128, 256])
    args = bench.parse_args(["--dry-run", "--pass", "fwd", "--chunks", "64", "256", "--out", "somewhere"])
    assert args.dry_run and args.passes == ["fwd"] and args.chunks == [64, 256] and str(args.out) == "somewhere"
    with pytest.raises(SystemExit):
        bench.parse_args(["--chunks", "32"])


def test_shapes_are_the_anchor_shapes_and_64k_tokens():
    assert [(s.batch, s.seq_len, s.heads, s.state_size) for s in bench.ANCHOR_SHAPES] == [
        (8, 2048, 80, 128), (8, 4096, 80, 128), (8, 4096, 32, 64), (2, 16384, 80, 128)]
    assert bench.SHAPES[-1].seq_len == 65536 and bench.SHAPES[:-1] == bench.ANCHOR_SHAPES
    assert {(s.head_dim, s.groups) for s in bench.SHAPES} == {(64, 1)}


def test_hbm_floor():
    shape = bench.SHAPES[0]
    tokens = 8 * 2048
    x, bc, dt, parameters = tokens * 80 * 64, tokens * 2 * 128, tokens * 80, 3 * 80
    # x, B, C read and y written in bf16; dt and the parameters read in fp32
    assert shape.hbm_bytes("fwd") == 2 * (2 * x + bc) + 4 * (dt + parameters)
    # + x, B, C, grad_y read and grad_x, grad_B, grad_C written; dt read and grad_dt written; parameters and theirs
    assert shape.hbm_bytes("fwd+bwd") == shape.hbm_bytes("fwd") + 2 * (3 * x + 2 * bc) + 4 * 2 * (dt + parameters)


def test_rows_pair_each_chunk_size_and_each_side_at_its_fastest(monkeypatch):
    """The harness's sweep on made-up measurements: a row per chunk size and one of each side at its fastest."""
    shape = bench.SHAPES[0]
    results = {
        "tk_ops": {64: {"ms": 3.0, "peak_bytes": 2 * 2**20}, 128: {"ms": 1.0, "peak_bytes": 2**20},
                   256: {"error": "OutOfMemoryError: out"}},
        "mamba_ssm": {64: {"ms": 2.0, "peak_bytes": 2**20, "rel_diff": 1e-3},
                      128: {"ms": 3.0, "peak_bytes": 4 * 2**20, "rel_diff": 2e-3},
                      256: {"ms": 1.5, "peak_bytes": 2**20, "error": "no relative difference: OutOfMemoryError: out"}},
    }

    def measured(provider, case, pass_, *args, **kwargs):
        return dict(results[provider.name][case.chunk])

    monkeypatch.setattr(common, "measure", measured)
    monkeypatch.setattr(common, "input_sets", lambda *args: [])
    rows = {row["baseline"]: row for row in common.measure_case(bench.BENCH, shape, ["fwd+bwd"], "cuda", None, 3000.0)}
    assert list(rows) == ["mamba_ssm@64", "mamba_ssm@128", "mamba_ssm@256", "mamba_ssm@best"]
    assert (rows["mamba_ssm@128"]["ratio"], rows["mamba_ssm@128"]["peak_ratio"]) == (3.0, 0.25)
    assert rows["mamba_ssm@128"]["rel_diff_vs_baseline"] == 2e-3 and "error" not in rows["mamba_ssm@128"]
    assert rows["mamba_ssm@64"]["ours_peak_mib"] == 2.0 and rows["mamba_ssm@64"]["baseline_peak_mib"] == 1.0
    assert rows["mamba_ssm@256"]["ours_ms"] is None and rows["mamba_ssm@256"]["baseline_ms"] == 1.5
    assert rows["mamba_ssm@256"]["error"] == ("tk_ops: OutOfMemoryError: out; "
                                             "mamba_ssm@256: no relative difference: OutOfMemoryError: out")
    best = rows["mamba_ssm@best"]
    assert (best["ours_chunk"], best["baseline_chunk"], best["ours_ms"], best["baseline_ms"]) == (128, 256, 1.0, 1.5)
    assert best["floor_ms"] == round(shape.hbm_bytes("fwd+bwd") / 3000.0 / 1e6, 5) and "chunk" not in best
    assert {row["best_baseline"] for row in rows.values()} == {"mamba_ssm@256"} and best["ratio_vs_best"] == 1.5
    results["mamba_ssm"] = {chunk: {"error": "mamba_ssm not importable"} for chunk in bench.CHUNKS}
    best = common.measure_case(bench.BENCH, shape, ["fwd"], "cuda", None)[-1]
    assert (best["baseline_chunk"], best["baseline_ms"], best["ratio"]) == (None, None, None)
    assert best["error"] == "mamba_ssm@best: mamba_ssm not importable"


def test_inputs_are_a_fresh_mamba2_layers():
    x, dt, A, B, C, D, dt_bias, grad_y = bench.input_set(bench.Shape(2, 5, 3, 8), "cpu", backward=True)
    assert x.shape == grad_y.shape == (2, 5, 3, 64) and B.shape == C.shape == (2, 5, 1, 8) and dt.shape == (2, 5, 3)
    assert {x.dtype, B.dtype, C.dtype, grad_y.dtype} == {torch.bfloat16} and {dt.dtype, A.dtype, D.dtype} == {torch.float32}
    assert ((-16 <= A) & (A <= -1)).all() and (D == 1).all()
    step = torch.nn.functional.softplus(dt_bias)
    assert ((1e-3 <= step) & (step <= 1e-1 + 1e-6)).all()
    assert all(t.requires_grad for t in (x, dt, A, B, C, D, dt_bias)) and not grad_y.requires_grad
    again = bench.input_set(bench.Shape(2, 5, 3, 8), "cpu", backward=False)
    assert torch.equal(again[0], x.detach()) and not again[0].requires_grad


def test_dry_run_without_mamba_ssm_runs_ours_and_writes_json_and_plot(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # no mamba_ssm there
    bench.main(["--dry-run", "--out", str(tmp_path)])
    document = json.loads((tmp_path / "mamba2.json").read_text())
    rows = document["rows"]
    assert len(rows) == len(bench.DRY_RUN_SHAPES) * len(bench.PASSES) * (len(bench.CHUNKS) + 1)
    assert document["mamba_ssm"].startswith("mamba_ssm not importable") and document["gpu"] is None
    assert document["chunks"] == list(bench.CHUNKS) and document["ours_backends"]["mamba2_ssd"]
    for row in rows:
        assert row["baseline_ms"] is None and row["floor_ms"] is None
        assert row["error"].startswith(f"{row['baseline']}: mamba_ssm not importable")
    assert (tmp_path / "mamba2.png").stat().st_size > 0
    assert "Bt=2 L=80 H=3 N=8" in capsys.readouterr().out


FAKE_MAMBA_SSM = """
    import os

    import tk_ops


    def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False):
        if chunk_size == 128:
            os._exit(7)  # a crash that takes the process down
        if chunk_size == 256:
            raise RuntimeError("unsupported")
        return 1.1 * tk_ops.mamba2_ssd(x, dt, A, B, C, chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus)
"""


def test_worker_measures_the_baseline_and_a_failure_costs_only_its_row(tmp_path, monkeypatch):
    """A stand-in mamba_ssm (10% off ours) that kills its process at chunk 128 and raises at 256."""
    package = tmp_path / "mamba_ssm" / "ops" / "triton"
    package.mkdir(parents=True)
    for folder in (package.parent.parent, package.parent, package):
        (folder / "__init__.py").write_text("")
    (package / "ssd_combined.py").write_text(textwrap.dedent(FAKE_MAMBA_SSM))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    shape = bench.DRY_RUN_SHAPES[1]
    worker = common.Worker("benchmarks.bench_mamba2", dry_run=True)
    try:
        results = {(pass_, chunk): worker.measure("mamba_ssm", dataclasses.replace(shape, chunk=chunk), pass_)
                   for pass_ in bench.PASSES for chunk in (64, 128, 256, 64)}
    finally:
        worker.close()
    assert worker.ready["path"] == str(tmp_path / "mamba_ssm")
    for pass_ in bench.PASSES:
        assert "ms" in results[pass_, 64] and results[pass_, 64]["rel_diff"] == pytest.approx(0.1, rel=0.1)
        assert results[pass_, 128] == {"error": "worker exited with status 7"}
        assert results[pass_, 256] == {"error": "RuntimeError: unsupported"}
    # three failures in a row, and no more workers are started
    worker = common.Worker("benchmarks.bench_mamba2", dry_run=True)
    failures = [worker.measure("mamba_ssm", dataclasses.replace(shape, chunk=chunk), "fwd") for chunk in (128, 256, 256, 64)]
    assert worker.process is None and failures[3] == {
        "error": "not run after 3 failures in a row, the last: RuntimeError: unsupported"}


def test_check_passes_on_cpu():
    summary, failures, largest = bench.run_check("cpu")
    assert failures == [] and "42 cases" in summary
    assert 0 < largest["bfloat16"]["forward"] < bench.TARGET_REL_ERR and 0 < largest["float16"]["gradients"] < 1e-3


def test_check_fails_on_a_wrong_forward_or_gradient(monkeypatch):
    forward = bench.forward
    monkeypatch.setattr(bench, "forward", lambda t, chunk_size: [1.05 * u for u in forward(t, chunk_size)])
    _, failures, _ = bench.run_check("cpu")
    assert failures and all(failure.startswith("forward ") for failure in failures)
    monkeypatch.setattr(bench, "forward", forward)

    class Scaled(torch.autograd.Function):
        """The identity forward, a backward 5% off."""

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return 1.05 * grad

    def off_in_16_bits(x, *args, **kwargs):  # the float64 reference stays right
        return mamba2_ssd(x if x.dtype == torch.float64 else Scaled.apply(x), *args, **kwargs)

    mamba2_ssd = tk_ops.mamba2_ssd
    monkeypatch.setattr(tk_ops, "mamba2_ssd", off_in_16_bits)
    _, failures, _ = bench.run_check("cpu")
    assert failures and all(failure.startswith("backward ") and "grad_x" in failure for failure in failures)


def test_check_exits_non_zero_on_a_failure(monkeypatch):
    monkeypatch.setattr(bench, "run_check", lambda device: ("sweep", ["wrong"], {}))
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--check"])
    assert exit_info.value.code == 1
