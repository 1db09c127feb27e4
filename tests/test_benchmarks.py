"""The benchmark harness and the device-session plumbing, on the CPU: the harness's rows, table, plot
and results file, the dry runs of the benches that have no test file of their own, the kernel-family
registry, the one `--check` flag of every bench, the commit in results files, and the A/B comparison
of two runs' results (across the change to one row schema too)."""

import copy
import dataclasses
import importlib
import json
import pathlib
import shutil
import subprocess
import sys
from unittest import mock

import pytest
import torch

import tk_ops
import tk_testing
from benchmarks import (bench_attention, bench_compile, bench_conv1d, bench_decode, bench_fftconv, bench_gated_delta_rule,
                        bench_gemm, bench_linear_attention, bench_linear_cross_entropy, bench_mamba2, bench_norms,
                        bench_overhead, bench_rope, common, compare_results, families, profile_kernels)

BENCHMARKS = pathlib.Path(families.__file__).parent
RESULTS = common.RESULTS


def test_every_family_names_a_real_op_and_bench_with_check(monkeypatch, capsys):
    backends = tk_ops.backends()
    for family in families.FAMILIES:
        assert family.op in backends, family
        module = importlib.import_module(family.check[0])
        monkeypatch.setattr(sys, "argv", [family.check[0], "--help"])
        with pytest.raises(SystemExit) as exit_info:
            module.main()
        assert exit_info.value.code == 0
        assert "--check" in capsys.readouterr().out, f"{family.check[0]} has no --check"


def test_profile_cases_are_the_registry_cases():
    registered = [p.case for family in families.FAMILIES for p in family.profiles]
    assert len(registered) == len(set(registered))
    assert set(registered) == set(profile_kernels.CASES)
    for case in registered:
        assert families.profile(case).per_call >= 1


def test_families_cli_lines(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["families", "checks", "matmul", "layer_norm"])
    families.main()
    assert capsys.readouterr().out.splitlines() == [
        "matmul benchmarks.bench_gemm --check", "layer_norm benchmarks.bench_norms --check"]
    monkeypatch.setattr(sys, "argv", ["families", "profiles", "attention"])
    families.main()
    skip = profile_kernels.WARMUP_CALLS
    assert capsys.readouterr().out.splitlines() == [
        f"attention_fwd_d128_n8192 forward_kernel {skip} 1",
        f"attention_bwd_d128_n8192 attention::.*(statistics_kernel|dkdv_kernel|dq_convert_kernel) {3 * skip} 3",
        f"decode_paged_b8_l8k_57k attention::.*(prepare_kernel|forward_kernel|combine_kernel) {3 * skip} 3",
        f"decode_paged_b16_nq4 attention::.*(prepare_kernel|forward_kernel|combine_kernel) {4 * skip} 4"]


def test_families_default_to_those_with_kernels():
    backends = tk_ops.backends()
    assert families.selected([]) == [f for f in families.FAMILIES if backends[f.op] == "cuda kernel"]
    with pytest.raises(SystemExit, match="unknown kernel families"):
        families.selected(["matmul", "conv"])


def test_gpu_session_parses():
    subprocess.run(["bash", "-n", str(BENCHMARKS / "gpu_session.sh")], check=True)
    subprocess.run(["bash", "-n", str(BENCHMARKS / "ab_prepare.sh")], check=True)


def test_commit_from_environment_outside_a_checkout(monkeypatch, tmp_path):
    monkeypatch.setattr(common, "ROOT", tmp_path)
    monkeypatch.setenv("TK_OPS_COMMIT", "0123abc")
    monkeypatch.setenv("TK_OPS_DIRTY", "1")
    assert common.source_commit() == {"commit": "0123abc", "dirty": True}
    monkeypatch.delenv("TK_OPS_COMMIT")
    monkeypatch.delenv("TK_OPS_DIRTY")
    assert common.source_commit() == {"commit": None, "dirty": None}


@pytest.mark.skipif(shutil.which("git") is None or not (common.ROOT / ".git").exists(), reason="not a git checkout")
def test_commit_from_git_in_a_checkout(monkeypatch):
    monkeypatch.delenv("TK_OPS_COMMIT", raising=False)
    found = common.source_commit()
    head = subprocess.run(["git", "-C", str(common.ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert found["commit"] == head and isinstance(found["dirty"], bool)


def test_the_environment_wins_over_git(monkeypatch):
    """A device copy's .git names the session's first commit, not the tree's: an explicit commit wins."""
    monkeypatch.setenv("TK_OPS_COMMIT", "0123abc")
    monkeypatch.setenv("TK_OPS_DIRTY", "0")
    assert common.source_commit() == {"commit": "0123abc", "dirty": False}


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


OURS = ("ours", "tk_ops")  # how the benches name tk_ops' timings: ours_ms, tk_ops_fwd_ms


def scaled(document: dict, factor: float, prefixes: tuple[str, ...] = ("",)) -> dict:
    """A copy with the timings whose key starts with one of prefixes multiplied by factor."""
    document = copy.deepcopy(document)
    for row in document["rows"]:
        for key in row:
            if key.endswith("_ms") and key.startswith(prefixes):
                row[key] *= factor
    return document


@pytest.mark.parametrize("bench", sorted(compare_results.ROW_NAMES))
def test_comparison_names_every_timing_of_the_stored_results(bench):
    document = load(bench)
    assert compare_results.bench_name(document, RESULTS / f"{bench}.json") == bench
    rows, missing = compare_results.compare([document, scaled(document, 0.5, OURS)], bench)
    assert not missing
    assert {r.name[2] for r in rows} >= {"tk_ops"}
    for r in rows:
        assert r.ratio == pytest.approx(0.5 if r.name[2].startswith("tk_ops") else 1.0), r.name


def test_comparison_of_two_pairs_and_missing_rows():
    old = load("rope")
    new = scaled(old, 0.8, OURS)
    old2, new2 = scaled(old, 1.1), scaled(new, 1.1)
    new2["rows"] = new2["rows"][:-1]
    rows, missing = compare_results.compare([old, new, old2, new2], "rope")
    by_name = {r.name: r for r in rows}
    anchor = by_name[("llama-gqa", "fwd_bwd", "tk_ops")]
    ms = next(r["ours_ms"] for r in old["rows"] if (r["name"], r["pass"]) == ("llama-gqa", "fwd_bwd"))
    assert anchor.old == pytest.approx([ms, 1.1 * ms]) and anchor.new == pytest.approx([0.8 * ms, 0.88 * ms])
    assert anchor.ratio == pytest.approx(0.8)
    assert anchor.spread(anchor.old) == pytest.approx(0.1 / 1.05)
    assert anchor.times_spread == pytest.approx(0.2 / (0.1 / 1.05))
    assert by_name[("mha-d64", "fwd", "eager")].ratio == pytest.approx(1.0)
    assert missing and {name[0] for name in missing} == {old["rows"][-1]["name"]}


def test_comparison_refuses_timings_it_cannot_tell_apart(monkeypatch):
    monkeypatch.setitem(compare_results.ROW_NAMES, "norms", (("norm",), "case"))
    with pytest.raises(SystemExit, match="two timings named"):
        compare_results.timings(load("norms"), "norms")


def test_compare_results_cli(tmp_path, capsys, monkeypatch):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps({**load("gemm"), "commit": None}))
    new.write_text(json.dumps({**scaled(load("gemm"), 0.9, OURS), "commit": "f" * 40, "dirty": False}))
    monkeypatch.setattr(sys, "argv", ["compare_results", str(old), str(new), str(old), str(new)])
    compare_results.main()
    out = capsys.readouterr().out
    assert "new1  ffffffffffff  NVIDIA" in out and "old1  unknown" in out
    assert "tk_ops graph" in out and "x spread" in out
    monkeypatch.setattr(sys, "argv", ["compare_results", str(old), str(new), str(old)])
    with pytest.raises(SystemExit):
        compare_results.main()


# ------------------------------------------------------------------------------------------ the harness


@dataclasses.dataclass(frozen=True)
class Toy:
    n: int
    group: str = "toy"

    @property
    def label(self) -> str:
        return f"n={self.n}"

    def flops(self, pass_: str) -> float:
        return 2.0 * self.n

    def hbm_bytes(self, pass_: str) -> int:
        return 8 * self.n


def broken(x):
    raise RuntimeError("no kernel for this")


def missing(case, pass_):
    raise common.Missing("peer not importable (ModuleNotFoundError: peer)")


TOY = common.Bench(
    "toy", "Toy", common.Provider("tk_ops", lambda case, pass_: lambda x: 2 * x),
    baselines=(
        common.Provider("same", lambda case, pass_: lambda x: x + x),
        common.Provider("off", lambda case, pass_: lambda x: 2.2 * x),  # ours is 1/11 off it: a mismatch
        common.Provider("missing", missing),
        common.Provider("broken", lambda case, pass_: broken),
        common.Provider("absent", lambda case, pass_: None),  # no form of any case: no row
        common.Provider("reversed", lambda case, pass_: lambda x: 2 * x, prepare=lambda case, pass_, inputs: (inputs[0].flip(0),),
                        as_ours=lambda case, pass_, outputs: [t.flip(0) for t in outputs]),
    ),
    inputs=lambda case, pass_, device: (torch.randn(case.n, device=device),), passes=("fwd", "bwd"),
)


def test_harness_rows_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rows = common.run(TOY, [Toy(5), Toy(7)], device="cpu", out=tmp_path, note="a header field")
    names = ("same", "off", "missing", "broken", "reversed")
    tk_testing.assert_bench_rows([r for r in rows if r["baseline"] != "off"], [Toy(5), Toy(7)], TOY.passes,
                                 [n for n in names if n != "off"])
    by_baseline = {row["baseline"]: row for row in rows if row["shape"] == "n=7" and row["pass"] == "bwd"}
    assert list(by_baseline) == list(names)
    # x + x and 2 * x (flipped or not) are exact doublings: no difference on any machine.
    assert by_baseline["same"]["rel_diff_vs_baseline"] == 0 and by_baseline["reversed"]["rel_diff_vs_baseline"] == 0
    assert by_baseline["off"]["rel_diff_vs_baseline"] == pytest.approx(0.2 / 2.2, rel=1e-3) and by_baseline["off"]["mismatch"]
    assert by_baseline["missing"]["error"] == "missing: peer not importable (ModuleNotFoundError: peer)"
    assert by_baseline["broken"]["error"] == "broken: RuntimeError: no kernel for this"
    assert by_baseline["same"]["n"] == 7 and by_baseline["same"]["hbm_bytes"] == 56 and by_baseline["same"]["flops"] == 14
    document = json.loads((tmp_path / "toy.json").read_text())
    assert document["rows"] == rows and document["note"] == "a header field" and document["rel_diff_tolerance"] == 0.05
    assert {"commit", "dirty", "gpu", "torch", "date"} <= set(document)
    assert (tmp_path / "toy.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "MISMATCH: 4 rows" in out and ["n=7", "bwd", "broken"] in [line.split()[:3] for line in out.splitlines()]


def test_harness_names_the_copy_ceiling_it_was_given(tmp_path):
    # The GPU path of every memory-bound bench: the measured copy bandwidth goes to the rows' floor
    # columns and, with its description, into the results header (once).
    pytest.importorskip("matplotlib")
    common.run(TOY, [Toy(5)], device="cpu", out=tmp_path, copy_gbps=3000.04, note="a header field")
    document = json.loads((tmp_path / "toy.json").read_text())
    assert (document["copy_gbps"], document["ceiling"], document["note"]) == (3000.0, common.COPY_CEILING, "a header field")


def test_comparison_row_numbers():
    row = common.comparison_row(Toy(10**9), "fwd", "b", {"ms": 0.5, "graph_ms": 0.25}, {"ms": 1.5, "graph_ms": 1.0}, 0.05,
                                copy_gbps=16000.0, tflops_ceiling=8.0)
    assert (row["ours_ms"], row["baseline_ms"], row["ratio"]) == (0.5, 1.5, 3.0)
    assert (row["ours_graph_ms"], row["baseline_graph_ms"], row["graph_ratio"]) == (0.25, 1.0, 4.0)
    assert (row["flops"], row["ours_tflops"], row["baseline_tflops"], row["fraction_of_ceiling"]) == (2e9, 4.0, 1.3, 0.5)
    assert (row["hbm_bytes"], row["floor_ms"], row["ours_of_floor"], row["baseline_of_floor"]) == (8e9, 0.5, 1.0, 0.333)
    assert (row["ours_gbps"], row["baseline_gbps"], row["ours_graph_of_floor"]) == (16000.0, 5333.3, 2.0)
    rows = [common.comparison_row(Toy(1), "fwd", name, {"ms": 1.0}, {"ms": ms}, 0.05) for name, ms in (("a", 3.0), ("b", 2.0))]
    rows.append(common.comparison_row(Toy(1), "fwd", "c", {"ms": 1.0}, {"error": "x"}, 0.05))
    common.mark_best(rows)
    assert [(r["best_baseline"], r["ratio_vs_best"]) for r in rows] == [("b", 2.0)] * 3
    assert rows[2]["error"] == "c: x" and rows[2]["ratio"] is None


# ------------------------------------------------------ dry runs of the benches without a test file of their own


def dry_run(module, tmp_path, name: str, *args: str) -> list[dict]:
    """The bench's --dry-run rows, after checking its JSON and plot were written into --out."""
    pytest.importorskip("matplotlib")
    module.main(["--dry-run", "--out", str(tmp_path), *args])
    assert (tmp_path / f"{name}.png").stat().st_size > 0
    return json.loads((tmp_path / f"{name}.json").read_text())["rows"]


def test_gemm_dry_run(tmp_path):
    rows = dry_run(bench_gemm, tmp_path, "gemm")
    cublas = {"matmul": ["torch.matmul (cuBLAS)"], "linear": ["F.linear (cuBLAS)"]}
    tk_testing.assert_bench_rows(rows, bench_gemm.DRY_RUN_CASES, ["fwd"], lambda case, pass_: cublas[case.op])
    assert {row["group"] for row in rows} == set(bench_gemm.GROUPS)
    assert all(row["rel_diff_vs_baseline"] < 1e-2 and row["flops"] == 2 * row["m"] * row["n"] * row["k"] for row in rows)
    (tmp_path / "gemm.png").unlink()
    bench_gemm.main(["--plot-from", str(tmp_path / "gemm.json")])  # redrawn from the results file
    assert (tmp_path / "gemm.png").stat().st_size > 0


@pytest.fixture
def fa4_lookup():
    """common.peer's cache emptied before and after (whether flash_attn.cute imports is asked afresh)."""
    common.peer.cache_clear()
    yield
    common.peer.cache_clear()


def test_attention_dry_run(tmp_path, monkeypatch, capsys, fa4_lookup):
    """Without FlashAttention-4 (flash_attn.cute not importable) one line says so and the run goes on
    without fa4 rows. The CPU has SDPA's flash backend but not cuDNN's (its rows say why); GQA's
    gradients of the repeated K/V heads are summed per head to compare."""
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # import flash_attn.cute: ImportError
    rows = dry_run(bench_attention, tmp_path, "attention")
    absent = [line for line in capsys.readouterr().out.splitlines() if "FlashAttention-4" in line]
    assert len(absent) == 1 and absent[0].startswith("FlashAttention-4 absent, no fa4 rows: flash-attn-4 not importable")
    tk_testing.assert_bench_rows(rows, bench_attention.DRY_RUN_CASES, bench_attention.PASSES, ["sdpa_cudnn", "sdpa_flash"])
    for row in rows:
        if row["baseline"] == "sdpa_flash":
            assert "error" not in row and row["rel_diff_vs_baseline"] < 1e-2
        else:
            assert row["error"].startswith("sdpa_cudnn: RuntimeError")
    assert {row["group"] for row in rows} == set(bench_attention.GROUPS)


@pytest.mark.parametrize("flag, name, cases", [
    ("--features", "attention_features", "DRY_RUN_FEATURE_CASES"),
    ("--varlen", "attention_varlen", "DRY_RUN_VARLEN_CASES"),
    ("--head-dims", "attention_head_dims", "DRY_RUN_HEAD_DIM_CASES"),
])
def test_attention_other_benches_dry_run(tmp_path, monkeypatch, flag, name, cases):
    """bench_attention's other modes write their own results file (not attention.json), a row per case, pass and
    baseline; on the CPU the baselines agree with ours, or say why they cannot run (cuDNN; FlexAttention's
    backward and its lse, which a CPU compiles for inference only)."""
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    rows = dry_run(bench_attention, tmp_path, name, flag)
    assert not (tmp_path / "attention.json").exists()
    assert {row["shape"] for row in rows} == {case.label for case in getattr(bench_attention, cases)}
    for row in rows:
        assert ("error" not in row and row["rel_diff_vs_baseline"] < 1e-2) or any(
            reason in row["error"] for reason in ("sdpa_cudnn: RuntimeError", "sdpa_cudnn_padded: RuntimeError",
                                                  "on CPU only supports inference",
                                                  "does not support backward on CPU"))


def test_decode_dry_run(tmp_path, monkeypatch, capsys, fa4_lookup):
    """Without FlashAttention-4 the rows are SDPA's, on the dense cache (a paged one gathered) cut to the
    longest sequence: equal to ours where every sequence has that length, not compared elsewhere."""
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    rows = dry_run(bench_decode, tmp_path, "decode")
    assert "FlashAttention-4 absent, no fa4 rows" in capsys.readouterr().out
    tk_testing.assert_bench_rows(rows, bench_decode.DRY_RUN_CASES, ["fwd"], ["sdpa"])
    assert all("error" not in row for row in rows)
    compared = [row["rel_diff_vs_baseline"] for row in rows]
    assert compared[:2] == [None, None] and compared[2] < 1e-2
    assert rows[0]["hbm_bytes"] == bench_decode.DRY_RUN_CASES[0].hbm_bytes("fwd")


def test_linear_cross_entropy_dry_run(tmp_path, monkeypatch):
    """The loss and the gradients of x and weight equal the unfused form's, eager and compiled; Liger's rows
    say it is absent (no liger-kernel on the CPU machine)."""
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    common.peer.cache_clear()
    rows = dry_run(bench_linear_cross_entropy, tmp_path, "linear_cross_entropy")
    common.peer.cache_clear()
    tk_testing.assert_bench_rows(rows, bench_linear_cross_entropy.DRY_RUN_CASES, bench_linear_cross_entropy.PASSES,
                                 ["eager", "compiled", "liger"])
    for row in rows:
        if row["baseline"] == "liger":
            assert "liger-kernel not importable" in row["error"]
        else:
            assert "error" not in row and row["rel_diff_vs_baseline"] < 1e-2
    case = bench_linear_cross_entropy.DRY_RUN_CASES[0]
    assert rows[0]["flops"] == 2 * case.tokens * case.hidden * case.vocab


def test_gated_delta_rule_dry_run(tmp_path, monkeypatch):
    """Ours runs forward and backward (the final state's gradient included); fla's rows say it is absent."""
    monkeypatch.setitem(sys.modules, "fla", None)
    common.peer.cache_clear()
    rows = dry_run(bench_gated_delta_rule, tmp_path, "gated_delta_rule")
    common.peer.cache_clear()
    tk_testing.assert_bench_rows(rows, bench_gated_delta_rule.DRY_RUN_CASES, bench_gated_delta_rule.PASSES, ["fla"])
    assert all("fla-core not importable" in row["error"] for row in rows)
    case = bench_gated_delta_rule.DRY_RUN_CASES[0]
    outputs = bench_gated_delta_rule.BENCH.ours.build(case, "fwd+bwd")(*bench_gated_delta_rule.make_inputs(case, "cpu"))
    assert [tuple(t.shape) for t in outputs[2:]] == [(2, 70, 2, 16), (2, 70, 2, 16), (2, 70, 4, 16), (2, 70, 4),
                                                      (2, 70, 4)]


def test_compile_dry_run(tmp_path):
    """The tiny Llama's forward compiled with and without tk_ops.inductor: the same logits, and the tk ops
    of ours' generated code in the rows (none on the CPU)."""
    pytest.importorskip("transformers")
    rows = dry_run(bench_compile, tmp_path, "compile", "--pass", "forward")
    tk_testing.assert_bench_rows(rows, bench_compile.DRY_RUN_MODELS, ["forward"], ["torch.compile"])
    for row in rows:
        assert row["rel_diff_vs_baseline"] < 1e-2 and row["tk_ops_called"] == []


def test_attention_dry_run_with_fa4(tmp_path, fake_peers, capsys, fa4_lookup):
    """Where flash_attn.cute imports (here tests/fake_peers' FA4 contract in PyTorch), fa4 rows join every
    case and pass: FA4 called on contiguous (B, N, H, D) tensors with K/V's own head count (GQA) and the
    case's causal flag and scale, its forward and gradients equal to ours once laid out as ours."""
    rows = dry_run(bench_attention, tmp_path, "attention")
    assert "FlashAttention-4 baseline (fa4): flash-attn-4 fake" in capsys.readouterr().out
    tk_testing.assert_bench_rows(rows, bench_attention.DRY_RUN_CASES, bench_attention.PASSES,
                                 ["sdpa_cudnn", "sdpa_flash", "fa4"])
    for row in rows:
        if row["baseline"] == "fa4":
            assert "error" not in row and row["rel_diff_vs_baseline"] < 1e-2, row
    expected = []
    for case in bench_attention.DRY_RUN_CASES:
        q_shape = (case.batch, case.n, case.q_heads, case.head_dim)
        kv_shape = (case.batch, case.n, case.kv_heads, case.head_dim)
        call = {"q": q_shape, "k": kv_shape, "v": kv_shape, "softmax_scale": case.head_dim**-0.5, "causal": case.causal,
                "contiguous": True}
        # fwd: the first call and one timed call (a dry run's) on the one set; each backward: the forward in prepare
        expected += [call] * (2 + len(bench_attention.OUR_BACKWARDS))
    assert [{key: value for key, value in c.items() if key != "q_data_ptr"} for c in fake_peers["fa4"]] == expected


def test_fa4_layout_is_prepared_outside_the_timed_call(fake_peers, fa4_lookup):
    """The (B, N, H, D) copies are prepare's: the timed forward hands FA4 the prepared tensors as they are,
    and the timed backward runs no forward."""
    case = bench_attention.DRY_RUN_CASES[1]  # GQA, causal
    inputs = bench_attention.make_inputs(case, "cpu")
    prepared = bench_attention.fa4_prepare(case, "fwd", inputs)
    assert prepared[0].shape == (case.batch, case.n, case.q_heads, case.head_dim) and prepared[0].is_contiguous()
    assert torch.equal(prepared[0], inputs[0].transpose(1, 2))
    out, _ = bench_attention.fa4_forward(case, "fwd")(*prepared)
    assert fake_peers["fa4"][-1]["q_data_ptr"] == prepared[0].data_ptr()
    backward = bench_attention.fa4_prepare(case, "bwd", inputs)
    calls = len(fake_peers["fa4"])
    grads = bench_attention.fa4_forward(case, "bwd")(*backward)
    assert len(fake_peers["fa4"]) == calls and [g.shape for g in grads] == [t.transpose(1, 2).shape for t in inputs[:3]]


def test_norms_dry_run(tmp_path):
    rows = dry_run(bench_norms, tmp_path, "norms")

    def timed(case, pass_):
        return [name for name in ("eager", "liger", "compiled") if (name, pass_) not in bench_norms.NOT_TIMED]

    tk_testing.assert_bench_rows(rows, bench_norms.DRY_RUN_CASES, bench_norms.PASSES, timed)
    for row in rows:
        if row["baseline"] == "liger" and not common.peer(*bench_norms.LIGER)[0]:
            assert row["error"].startswith("liger: liger-kernel not importable")
        else:
            assert "error" not in row and row["rel_diff_vs_baseline"] < 2e-2, row


def test_rope_dry_run(tmp_path):
    cases = [case for case in bench_rope.DRY_RUN_CASES if case.name in ("mha-d64", "single-tensor-q")]
    rows = dry_run(bench_rope, tmp_path, "rope", "--only", *(case.name for case in cases))

    def baselines(case, pass_):  # Liger has no single-tensor form
        return ["eager", "compiled"] + ["liger"] * bool(case.k_heads)

    tk_testing.assert_bench_rows(rows, cases, bench_rope.PASSES, baselines)
    for row in rows:
        assert row["rel_err_vs_fp32_formula"] < 1e-2 and row["hbm_bytes"] > 0
        assert "error" in row if row["baseline"] == "liger" else row["rel_diff_vs_baseline"] < 1e-2


def test_overhead_dry_run(tmp_path):
    rows = dry_run(bench_overhead, tmp_path, "overhead")
    tk_testing.assert_bench_rows(rows, bench_overhead.CASES, ["fwd", "fwd_bwd"], ["torch"])
    for row in rows:  # the forward's outputs are compared; fwd_bwd returns none
        assert (row["rel_diff_vs_baseline"] < 1e-2) if row["pass"] == "fwd" else row["rel_diff_vs_baseline"] is None


# -------------------------------------------- every case of the stored results is still named by the new rows


def all_rows(bench: common.Bench, cases) -> list[dict]:
    """The rows a GPU run of every case would write, with made-up times (a missing peer's rows too)."""
    rows = []
    for case in cases:
        for pass_ in bench.passes:
            for provider in bench.baselines:
                try:
                    runs = provider.build(case, pass_) is not None
                except common.Missing:
                    runs = True
                if runs:
                    rows.append(common.comparison_row(case, pass_, provider.name, {"ms": 1.0, "graph_ms": 0.5},
                                                      {"ms": 2.0, "graph_ms": 1.0}, 0.05, 3000.0))
    return rows


GPU_ROWS = {  # stored results -> the rows the bench writes now, every case
    "attention": lambda: all_rows(  # FA4 among the baselines, as on a GPU where it imports
        dataclasses.replace(bench_attention.BENCH, baselines=(*bench_attention.BENCH.baselines, bench_attention.FA4_PROVIDER)),
        bench_attention.cases(set(bench_attention.GROUPS))),
    "gemm": lambda: all_rows(bench_gemm.BENCH, bench_gemm.cases(set(bench_gemm.GROUPS))),
    "norms": lambda: all_rows(bench_norms.BENCH, bench_norms.CASES),
    "rope": lambda: all_rows(bench_rope.BENCH, bench_rope.CASES),
    "overhead": lambda: all_rows(bench_overhead.BENCH, bench_overhead.CASES),
    "conv1d": lambda: all_rows(bench_conv1d.BENCH, bench_conv1d.SHAPES),
    "fftconv": lambda: all_rows(bench_fftconv.bench("bf16"), bench_fftconv.shapes_for("bf16")),
    "fftconv_fp32": lambda: all_rows(bench_fftconv.bench("fp32"), bench_fftconv.shapes_for("fp32")),
    "linear_attention": lambda: all_rows(bench_linear_attention.BENCH, bench_linear_attention.BASED_SHAPES
                                         + bench_linear_attention.GENERIC_SHAPES),
    # every chunk size, each one in turn the fastest (the "best" rows name it): equal times, the fastest
    # first in the sweep, so that the rows of the turns agree on every timing they share
    "mamba2": lambda: [row for fastest in bench_mamba2.CHUNKS for row in swept_rows(
        dataclasses.replace(bench_mamba2.BENCH, sweep=("chunk", tuple(dict.fromkeys((fastest, *bench_mamba2.CHUNKS))))),
        bench_mamba2.SHAPES)],
    "compile": lambda: all_rows(bench_compile.BENCH, bench_compile.MODELS),
}


def swept_rows(bench: common.Bench, cases) -> list[dict]:
    """The rows a GPU run of a bench with a sweep would write, with made-up times (ours 1 ms, a baseline 2)."""
    def measured(provider, *args, **kwargs):
        return {"ms": 1.0 if provider is bench.ours else 2.0}

    with mock.patch.object(common, "measure", measured), mock.patch.object(common, "input_sets", lambda *args: []):
        return [row for case in cases for row in common.measure_case(bench, case, bench.passes, "cuda", None, 3000.0)]


@pytest.mark.parametrize("stored", sorted(GPU_ROWS))
def test_no_case_of_the_stored_results_is_lost(stored):
    """Every timing of the stored results (rows written before the one schema) has its name among the
    rows the bench writes now: no case lost, and compare_results pairs an old tree's run with a new one's."""
    old = load(stored)
    bench = compare_results.bench_name(old, RESULTS / f"{stored}.json")
    rows, missing = compare_results.compare([old, {"rows": GPU_ROWS[stored]()}], bench)
    old_names = set(compare_results.timings(old, bench))
    assert old_names and not old_names & set(missing), sorted(old_names & set(missing))[:5]


def test_profile_training_groups_kernels_by_library():
    from benchmarks.profile_training import group_of

    tk_forward = "void tk::pipeline::producer_consumer_kernel<tk::attention::(anonymous namespace)::forward_kernel<bf16, 64>>"
    assert group_of(tk_forward) == "tk::attention"
    assert group_of("void tk::rope::rope_kernel<float>(params)") == "tk::rope"
    assert group_of("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_TNT") == "cuBLAS"
    assert group_of("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "cuDNN"
    assert group_of("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "Triton (Inductor)"
    assert group_of("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<adam>") == "optimizer"
    assert group_of("void at::native::vectorized_elementwise_kernel<4>") == "other"


def test_profile_training_runs_on_the_cpu(tmp_path):
    from benchmarks import profile_training
    from models import data
    from test_train import synthetic_text

    data.prepare(tmp_path / "data", synthetic_text(), source="synthetic", vocab_size=320)
    profile_training.main(["--warmup", "1", "--steps", "1", "--out", str(tmp_path), "--", "--model", "llama",
                           "--preset", "nano", "--device", "cpu", "--data", str(tmp_path / "data")])  # fmt: skip
    document = json.loads((tmp_path / "profile_training_llama_nano_tk_ops.json").read_text())
    assert document["kernel_ms_per_step"] > 0 and document["top_kernels_ms"]


def test_against_flex_table_shows_masked_sdpa_where_measured():
    """The options table: a column pair per baseline the file has, '-' for a case one of them does not take."""
    from benchmarks import results_tables

    def row(shape, baseline, ratio):
        return dict(shape=shape, baseline=baseline, ratio=ratio, ours_tflops=500.0, baseline_tflops=500.0 / ratio,
                    **{"pass": "fwd"})

    window, softcap = "N=8192 window=(255, -1)", "N=8192 softcap=50"
    table = results_tables.against_flex({"rows": [row(window, "flex", 1.5), row(window, "sdpa_masked", 4.0),
                                                  row(softcap, "flex", 2.5)]}, summary=True)
    lines = table.strip().splitlines()
    assert lines[0] == "| shape | pass | ours TFLOP/s | FlexAttention | x Flex | masked SDPA | x SDPA |"
    assert lines[2] == f"| {window} | fwd | 500 | 333 | 1.50 | 125 | 4.00 |"
    assert lines[3] == f"| {softcap} | fwd | 500 | 200 | 2.50 | - | - |"
    only_flex = results_tables.against_flex({"rows": [row(softcap, "flex", 2.5)]}, summary=True)
    assert "SDPA" not in only_flex


def test_varlen_padded_baseline_is_exact_on_the_real_rows():
    """bench_attention's padded-batch baseline: padding is undone by unpadded, and right padding under is_causal
    leaves each document's rows exactly what the packed call gives (here on the CPU's SDPA)."""
    case = bench_attention.VarlenCase("packed", (5, 17, 1), heads=2, head_dim=16)
    q, k, v = (torch.randn(sum(case.lengths), 2, 16, dtype=torch.float64) for _ in range(3))
    assert torch.equal(bench_attention.unpadded(case, bench_attention.padded(case, q)), q)
    batch = torch.nn.functional.scaled_dot_product_attention(*(bench_attention.padded(case, t) for t in (q, k, v)),
                                                             is_causal=True)
    cu = bench_attention.cu_seqlens(case, "cpu")
    want = tk_ops.attention_varlen(q, k, v, cu, cu, 17, 17, causal=True)
    torch.testing.assert_close(bench_attention.unpadded(case, batch), want)
