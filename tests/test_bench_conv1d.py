"""benchmarks/bench_conv1d.py without a GPU: its shapes, byte floors, rows, dry run and correctness sweep."""

from __future__ import annotations

import json

import pytest
import torch

import tk_ops
import tk_testing
from benchmarks import bench_conv1d as bench, common


def test_arguments():
    with pytest.raises(SystemExit):
        bench.main(["--pass", "bwd"])


def test_shapes_are_mamba2_shapes():
    """A Mamba-2 layer's conv channels: d_inner 4096 plus B and C (d_state 128, one group)."""
    assert {(s.batch, s.dim, s.width) for s in bench.SHAPES} == {(8, 4096 + 2 * 128, 4)}
    assert [(s.seq_len, s.layout) for s in bench.SHAPES] == [(2048, "bdl"), (4096, "bdl"), (4096, "bld")]


def test_hbm_floor():
    shape = bench.SHAPES[0]
    activations, parameters = 8 * 4352 * 2048, 4352 * 5
    assert shape.hbm_bytes("fwd") == 2 * (2 * activations + parameters)
    # + x, grad_out read, grad_x written, grad_weight and grad_bias written
    assert shape.hbm_bytes("fwd+bwd") == shape.hbm_bytes("fwd") + 2 * (3 * activations + parameters)


def test_row():
    shape = bench.SHAPES[1]
    row = common.comparison_row(shape, "fwd", "compiled", {"ms": 0.5}, {"ms": 1.5, "rel_diff": 1.234e-3}, 0.05, 3000.0)
    floor = shape.hbm_bytes("fwd") / 3000.0 / 1e6
    assert row["shape"] == "B=8 D=4352 L=4096 W=4 bdl" and row["pass"] == "fwd" and row["layout"] == "bdl"
    assert (row["ours_ms"], row["baseline_ms"], row["ratio"]) == (0.5, 1.5, 3.0)
    assert row["floor_ms"] == round(floor, 5) and row["ours_of_floor"] == round(floor / 0.5, 3)
    assert row["rel_diff_vs_baseline"] == 1.23e-3 and "error" not in row and "mismatch" not in row


def test_input_layouts():
    """x and the output gradient in the shape's layout; padded rows are 16-byte aligned whatever L."""
    for layout, channel_stride in (("bdl", 5), ("bld", 1), ("bdl-padded", 16)):
        x, weight, bias, grad_out = bench.input_set(bench.Shape(2, 8, 5, 4, layout), "cpu", torch.bfloat16, True)
        assert x.shape == grad_out.shape == (2, 8, 5) and x.stride(1) == grad_out.stride(1) == channel_stride
        assert weight.shape == (8, 4) and bias.shape == (8,) and x.requires_grad and weight.requires_grad


def test_check_shapes_cover_every_kernel_path():
    """Each width on both layouts, with and without vectors (bf16 and fp32 vectors), a cut vector, segments."""
    shapes = bench.CHECK_SHAPES
    for w in bench.KERNEL_WIDTHS:
        of_width = [(d, n, layout) for _, d, n, width, layout in shapes if width == w]
        assert any(layout == "bdl" and n % 8 == 0 for d, n, layout in of_width), w  # vectors of bf16 and fp32
        assert any(layout == "bdl" and n % 4 != 0 for d, n, layout in of_width), w  # element by element
        assert any(layout == "bld" and d % 2 == 0 for d, n, layout in of_width), w
        assert any(layout == "bld" and d % 2 == 1 for d, n, layout in of_width), w
    assert any(layout == "bdl-padded" and n % 8 != 0 for _, _, n, _, layout in shapes)
    assert any(n > 2048 for _, _, n, _, _ in shapes) and any(n == 1 for _, _, n, _, _ in shapes)
    assert any(w > n for _, _, n, w, _ in shapes) and any(w == 1 for *_, w, _ in shapes)


def test_dry_run_builds_every_row_and_the_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    bench.main(["--dry-run", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "conv1d.json").read_text())["rows"]
    tk_testing.assert_bench_rows(rows, bench.DRY_RUN_SHAPES, bench.PASSES, ("eager", "compiled"))
    for row in rows:
        assert "error" not in row  # eager and compiled conv1d both run on the CPU
        assert row["rel_diff_vs_baseline"] < 1e-2  # bf16: the baselines compute the same function
    assert (tmp_path / "conv1d.png").stat().st_size > 0
    assert "B=2 D=24 L=33 W=4 bld" in capsys.readouterr().out


def test_check_passes_on_cpu():
    bench.run_check("cpu")


def test_check_fails_on_a_wrong_output(monkeypatch):
    causal_conv1d = tk_ops.causal_conv1d
    monkeypatch.setattr(tk_ops, "causal_conv1d", lambda *a, **kw: 1.05 * causal_conv1d(*a, **kw))
    with pytest.raises(SystemExit) as exit_info:
        bench.run_check("cpu")
    assert exit_info.value.code == 1


def test_baseline_is_causal_conv1d_reference():
    x, weight, bias, _ = bench.input_set(bench.Shape(2, 6, 19, 3, "bld"), "cpu", torch.float64, False)
    torch.testing.assert_close(bench.conv1d_silu(x, weight, bias), bench.ours(x, weight, bias))
