"""benchmarks/bench_fftconv.py without a GPU: its shapes, byte floors, dry run and correctness sweep."""

from __future__ import annotations

import json

import pytest
import torch

import tk_ops
import tk_testing
from benchmarks import bench_fftconv as bench

BASELINES = ("torch.fft eager", "torch.fft compiled")


def test_shapes_are_the_anchors_plus_2048_and_8192():
    assert [(s.batch, s.heads, s.seq_len) for s in bench.SHAPES] == [
        (16, 768, 256), (16, 768, 1024), (16, 768, 2048), (16, 768, 4096), (8, 768, 8192), (4, 768, 16384)]


def test_fp32_sweep_times_the_kernels_seq_lens_only():
    assert [s.seq_len for s in bench.shapes_for("fp32")] == [256, 1024, 2048, 4096, 8192]
    assert {s.dtype for s in bench.shapes_for("fp32")} == {"fp32"} and bench.shapes_for("bf16") == bench.SHAPES
    assert bench.bench("fp32").name == "fftconv_fp32" and bench.bench("bf16").name == "fftconv"


def test_check_sweeps_fp32_u():
    assert torch.float32 in bench.CHECK_TOLERANCE and bench.CHECK_TOLERANCE[torch.float32] <= 1e-4
    seq_lens = {n for _, _, n, *_ in bench.CHECK_SHAPES}
    assert {256, 512, 1024, 2048, 4096, 8192} <= seq_lens  # every fp32 kernel N


def test_hbm_floor():
    shape = bench.SHAPES[3]
    sequence, parameters = 16 * 768 * 4096 * 2, 768 * 4097 * 4
    assert shape.hbm_bytes("fwd") == 2 * sequence + parameters
    # + grad_out and u read, grad_u written, grad_k and grad_D written
    assert shape.hbm_bytes("fwd+bwd") == shape.hbm_bytes("fwd") + 3 * sequence + parameters


def test_dry_run_builds_every_row_and_the_plot(tmp_path):
    pytest.importorskip("matplotlib")
    bench.main(["--dry-run", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "fftconv.json").read_text())["rows"]
    tk_testing.assert_bench_rows(rows, bench.DRY_RUN_SHAPES, bench.PASSES, BASELINES)
    for row in rows:
        assert "error" not in row and row["rel_diff_vs_baseline"] < 1e-2  # bf16 outputs of the same convolution
    assert (tmp_path / "fftconv.png").stat().st_size > 0


def test_dry_run_with_fp32_u(tmp_path):
    pytest.importorskip("matplotlib")
    bench.main(["--dry-run", "--dtype", "fp32", "--pass", "fwd", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "fftconv_fp32.json").read_text())["rows"]
    tk_testing.assert_bench_rows(rows, bench.shapes_for("fp32", bench.DRY_RUN_SHAPES), ["fwd"], BASELINES)
    for row in rows:
        assert row["rel_diff_vs_baseline"] < 1e-5  # fp32 outputs of the same convolution
        assert row["dtype"] == "fp32" and row["hbm_bytes"] == 2 * 4 * row["batch"] * row["heads"] * row["seq_len"] + (
            4 * row["heads"] * (row["seq_len"] + 1))
    assert (tmp_path / "fftconv_fp32.png").stat().st_size > 0


def test_check_passes_on_cpu():
    bench.run_check("cpu")


def test_check_fails_on_a_wrong_output(monkeypatch):
    fftconv = tk_ops.fftconv
    monkeypatch.setattr(tk_ops, "fftconv", lambda *a, **kw: 1.05 * fftconv(*a, **kw))
    with pytest.raises(SystemExit) as exit_info:
        bench.run_check("cpu")
    assert exit_info.value.code == 1


def test_check_fails_on_a_wrong_filter_gradient(monkeypatch):
    backward = bench.ours_backward
    monkeypatch.setattr(bench, "ours_backward", lambda *a: (lambda gu, gk, gD: (gu, 1.05 * gk, gD))(*backward(*a)))
    with pytest.raises(SystemExit) as exit_info:
        bench.run_check("cpu")
    assert exit_info.value.code == 1


def test_backward_reference_is_the_ops():
    u, k, D, grad = bench.input_set(bench.Shape(3, 2, 100), "cpu", False)
    u, grad, k = u.double(), grad.double(), k[:, :37].double()
    for D_or_none in (D.double(), None):
        want = torch.ops.tk.fftconv_bwd.default(grad, u, k, D_or_none)
        for got, expected in zip(bench.float64_backward(grad, u, k, D_or_none), want):
            if got is not None:
                torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_baseline_is_the_op():
    u, k, D, _ = bench.input_set(bench.Shape(2, 3, 100), "cpu", False)
    u = u.double()  # the baseline computes in fp32 whatever u's dtype
    torch.testing.assert_close(bench.torch_fft(u, k, D), bench.ours(u, k.double(), D.double()), rtol=1e-5, atol=1e-5)
