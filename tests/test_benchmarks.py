"""The device-session plumbing, on the CPU: the kernel-family registry, the one `--check` flag of
every bench, and the commit in results files."""

import importlib
import pathlib
import shutil
import subprocess
import sys

import pytest

import tk_ops
from benchmarks import common, families, profile_kernels

BENCHMARKS = pathlib.Path(families.__file__).parent


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
        f"attention_bwd_d128_n8192 statistics_kernel|dkdv_kernel|dq_kernel {3 * skip} 3"]


def test_families_default_to_those_with_kernels():
    backends = tk_ops.backends()
    assert families.selected([]) == [f for f in families.FAMILIES if backends[f.op] == "cuda kernel"]
    with pytest.raises(SystemExit, match="unknown kernel families"):
        families.selected(["matmul", "conv"])


def test_gpu_session_parses():
    subprocess.run(["bash", "-n", str(BENCHMARKS / "gpu_session.sh")], check=True)


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
    monkeypatch.setenv("TK_OPS_COMMIT", "ignored when git knows")
    found = common.source_commit()
    head = subprocess.run(["git", "-C", str(common.ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert found["commit"] == head and isinstance(found["dirty"], bool)
