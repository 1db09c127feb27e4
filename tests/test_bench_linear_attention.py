"""benchmarks/bench_linear_attention.py without a GPU: its shapes, byte floors, rows, dry run and correctness sweep."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

import tk_ops
import tk_testing
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
    """q, k (16 features) and v, out (64) of 32768 x 16 rows in bf16: 160 MiB forward (~0.06 ms at 3 TB/s)."""
    shape = bench.BASED_SHAPES[0]
    assert shape.hbm_bytes("fwd") == 32768 * 16 * (16 + 16 + 64 + 64) * 2
    # + q, k, v, grad_out read and grad_q, grad_k, grad_v written
    assert shape.hbm_bytes("fwd+bwd") == shape.hbm_bytes("fwd") + 32768 * 16 * (2 * 32 + 3 * 64) * 2


def baselines_of(shape, pass_):
    return bench.BASELINES[shape.kind]


def test_dry_run_builds_every_row_and_the_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    bench.main(["--dry-run", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "linear_attention.json").read_text())["rows"]
    tk_testing.assert_bench_rows(rows, bench.DRY_RUN_SHAPES, bench.PASSES, baselines_of)
    for row in rows:
        # fla is missing here, or imports but its Triton kernels cannot run on the CPU: the row says why
        assert row["error"].startswith(f"{row['baseline']}: ")
    assert (tmp_path / "linear_attention.png").stat().st_size > 0
    assert "based B=4 H=2 N=16 F=16 Dv=64" in capsys.readouterr().out


FAKE_FLA = {  # fla's two based and two linear-attention ops on (B, N, H, .) tensors, through ours
    "based.py": """
        import tk_ops


        def parallel_based(q, k, v, scale=None, use_norm=True):
            return tk_ops.based_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), eps=1e-6).transpose(1, 2)


        def fused_chunk_based(q, k, v, scale=None, use_norm=True):
            return 1.1 * parallel_based(q, k, v)  # 10% off: a mismatch
    """,
    "linear_attn.py": """
        import os

        import tk_ops


        def chunk_linear_attn(q, k, v, scale=1.0, normalize=False):
            out = tk_ops.linear_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), normalize=normalize)
            return out.transpose(1, 2), None


        def fused_chunk_linear_attn(q, k, v, scale=1.0, normalize=False):
            os._exit(3)  # a fault that takes the process down
    """,
}


@pytest.fixture
def fake_fla(tmp_path, monkeypatch):
    """A stand-in fla package, importable here and in subprocesses."""
    package = tmp_path / "site" / "fla" / "ops"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("__version__ = '0.0-fake'\n")
    (package / "__init__.py").write_text("")
    for name, source in FAKE_FLA.items():
        (package / name).write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    common.peer.cache_clear()
    yield
    common.peer.cache_clear()
    for module in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        del sys.modules[module]


def test_fla_on_its_own_layout_checked_against_ours(fake_fla, tmp_path):
    """Each fla op gets the (B, N, H, .) half of every input set, its outputs (and gradients) compared as ours."""
    bench.main(["--dry-run", "--only", "based", "--out", str(tmp_path)])
    rows = {(row["shape"], row["pass"], row["baseline"]): row
            for row in json.loads((tmp_path / "linear_attention.json").read_text())["rows"]}
    assert len(rows) == 2 * len(bench.PASSES) * 2
    for (shape, pass_, baseline), row in rows.items():
        assert "error" not in row, row
        if baseline == "parallel_based":
            assert row["rel_diff_vs_baseline"] < 1e-6 and "mismatch" not in row
        else:
            assert row["rel_diff_vs_baseline"] == pytest.approx(0.1 / 1.1, rel=1e-2) and row["mismatch"]


def test_isolated_baselines_cost_only_their_rows(fake_fla, tmp_path):
    """--isolate-baselines: each fla row measured in a process of its own, a crash costs that row."""
    bench.main(["--dry-run", "--isolate-baselines", "--only", "generic", "--features", "16", "--pass", "fwd",
                "--out", str(tmp_path)])
    rows = {row["baseline"]: row for row in json.loads((tmp_path / "linear_attention.json").read_text())["rows"]}
    assert rows["chunk_linear_attn"]["rel_diff_vs_baseline"] < 1e-6 and "error" not in rows["chunk_linear_attn"]
    assert rows["fused_chunk_linear_attn"]["error"].startswith("fused_chunk_linear_attn: subprocess exit 3")


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
