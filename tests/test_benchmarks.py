"""The device-session plumbing, on the CPU: the kernel-family registry, the one `--check` flag of every
bench, the commit in results files, and the A/B comparison of two runs' results."""

import copy
import importlib
import json
import pathlib
import shutil
import subprocess
import sys

import pytest

import tk_ops
from benchmarks import common, compare_results, families, profile_kernels

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
        f"attention_bwd_d128_n8192 attention::.*(statistics_kernel|dkdv_kernel|dq_convert_kernel) {3 * skip} 3"]


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
    ms = old["rows"][0]["tk_ops_fwd_bwd_ms"]
    assert anchor.old == pytest.approx([ms, 1.1 * ms]) and anchor.new == pytest.approx([0.8 * ms, 0.88 * ms])
    assert anchor.ratio == pytest.approx(0.8)
    assert anchor.spread(anchor.old) == pytest.approx(0.1 / 1.05)
    assert anchor.times_spread == pytest.approx(0.2 / (0.1 / 1.05))
    assert by_name[("mha-d64", "fwd", "eager")].ratio == pytest.approx(1.0)
    assert missing and {name[0] for name in missing} == {old["rows"][-1]["case"]}


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
