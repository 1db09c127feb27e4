"""benchmarks/bench_linear_attention.py without a GPU: its shapes, byte floors, rows, dry run and correctness sweep."""

from __future__ import annotations

import pytest
import torch

import tk_ops
from benchmarks import bench_linear_attention as bench, common


def test_arguments():
    args = bench.parse_args([])
    assert (args.out, args.check, args.dry_run, args.only) == (None, False, False, None)
    args = bench.parse_args(["--dry-run", "--only", "generic", "--out", "somewhere"])
    assert args.dry_run and args.only == "generic" and str(args.out) == "somewhere"
    with pytest.raises(SystemExit):
        bench.parse_args(["--only", "mamba"])


def test_shapes_are_the_anchor_shapes():
    assert [s.seq_len for s in bench.BASED_SHAPES] == [1024, 2048, 4096, 8192, 16384]
    assert {(s.batch * s.seq_len, s.heads, s.features, s.value_dim) for s in bench.BASED_SHAPES} == {(32768, 16, 16, 64)}
    assert [(s.features, s.value_dim) for s in bench.GENERIC_SHAPES] == [(16, 64), (32, 64), (64, 64), (128, 128), (256, 64)]
    assert {(s.batch, s.heads, s.seq_len) for s in bench.GENERIC_SHAPES} == {(8, 16, 4096)}
    full, generic = bench.parse_args([]), bench.parse_args(["--only", "generic"])
    assert bench.selected_shapes(full) == bench.BASED_SHAPES + bench.GENERIC_SHAPES
    assert bench.selected_shapes(generic) == bench.GENERIC_SHAPES


def test_hbm_floor_of_the_based_shapes():
    """q, k (16 features) and v, out (64) of 32768 x 16 rows in bf16: 160 MiB forward (anchors.md: ~0.06 ms)."""
    shape = bench.BASED_SHAPES[0]
    assert shape.hbm_bytes("fwd", 2) == 32768 * 16 * (16 + 16 + 64 + 64) * 2
    # + q, k, v, grad_out read and grad_q, grad_k, grad_v written
    assert shape.hbm_bytes("fwd+bwd", 2) == shape.hbm_bytes("fwd", 2) + 32768 * 16 * (2 * 32 + 3 * 64) * 2


def test_row():
    shape = bench.GENERIC_SHAPES[3]
    row = common.floor_row(shape, "fwd", "chunk_linear_attn", 0.5, 1.5, 3000.0, bench.DTYPE.itemsize, 1.234e-3)
    floor = shape.hbm_bytes("fwd", 2) / 3000.0 / 1e6
    assert row["shape"] == "generic B=8 H=16 N=4096 F=128 Dv=128" and row["pass"] == "fwd"
    assert (row["ours_ms"], row["baseline_ms"], row["ratio"]) == (0.5, 1.5, 3.0)
    assert row["floor_ms"] == round(floor, 5) and row["ours_of_floor"] == round(floor / 0.5, 3)
    assert row["rel_diff_vs_ours"] == 1.23e-3 and "error" not in row
    missing = common.floor_row(shape, "fwd+bwd", "fused_chunk_linear_attn", 0.5, None, None, bench.DTYPE.itemsize, error="fla not importable")
    assert (missing["baseline_ms"], missing["ratio"], missing["floor_ms"], missing["baseline_of_floor"]) == (None,) * 4
    assert missing["error"] == "fla not importable"


def test_dry_run_builds_every_row_and_the_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rows = bench.dry_run(bench.parse_args(["--dry-run", "--out", str(tmp_path)]))
    assert len(rows) == len(bench.DRY_RUN_SHAPES) * len(bench.PASSES) * 2
    assert {(r["kind"], r["baseline"]) for r in rows} == {(kind, name) for kind, names in bench.BASELINES.items() for name in names}
    for row in rows:
        assert row["ours_ms"] is None and row["floor_ms"] is None  # nothing timed on the CPU
        # fla is missing here, or imports but its Triton kernels cannot run on the CPU: the row says why
        assert row["baseline_ms"] is None and row["error"]
    assert (tmp_path / "linear_attention.png").stat().st_size > 0
    assert "based B=4 H=2 N=16 F=16 Dv=64" in capsys.readouterr().out


def test_check_passes_on_cpu():
    bench.run_check("cpu")


def test_check_fails_on_a_wrong_output(monkeypatch):
    based_attention = tk_ops.based_attention
    monkeypatch.setattr(tk_ops, "based_attention", lambda q, k, v, **kw: 1.05 * based_attention(q, k, v, **kw))
    with pytest.raises(SystemExit) as exit_info:
        bench.run_check("cpu")
    assert exit_info.value.code == 1


def test_reference_is_the_contract():
    """The sweep's quadratic float64 form: Based scores 1 + s + s^2/2 with s = q . k / sqrt(F)."""
    q, k, v = torch.randn(1, 1, 3, 4, dtype=torch.float64), torch.randn(1, 1, 3, 4, dtype=torch.float64), torch.randn(1, 1, 3, 2, dtype=torch.float64)
    s = (q[0, 0, 2] @ k[0, 0].T) / 2
    scores = 1 + s + s**2 / 2
    expected = (scores @ v[0, 0]) / (scores.sum() + 0.5)
    out = bench.quadratic_reference("based", q, k, v, True, 0.5)
    torch.testing.assert_close(out[0, 0, 2], expected)
