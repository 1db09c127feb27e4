"""``tk_ops.extension_status()`` says why the CUDA extension is not there: setup.py records what it
decided in tk_ops/_build_info.py (git-ignored) and the package reads that record."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from tk_ops import _library

REPO_ROOT = Path(__file__).resolve().parent.parent


def record(**fields) -> types.SimpleNamespace:
    return types.SimpleNamespace(**fields)


def test_not_built_status_names_setup_pys_reason():
    cpu = record(TORCH="2.13.0+cpu", BUILDS_EXTENSION=False, REASON="torch 2.13.0+cpu has no CUDA")
    assert _library.not_built_status(cpu, "2.13.0+cpu") == "not built: torch 2.13.0+cpu has no CUDA"
    assert _library.not_built_status(cpu, "2.13.0+cu130") == (
        "not built: torch 2.13.0+cpu has no CUDA (set up under torch 2.13.0+cpu, running torch 2.13.0+cu130: "
        "reinstall tk_ops to rebuild)"
    )
    no_torch = record(TORCH=None, BUILDS_EXTENSION=False, REASON="TK_OPS_NO_CUDA=1 was set")
    assert _library.not_built_status(no_torch, "2.13.0") == "not built: TK_OPS_NO_CUDA=1 was set"
    built = record(TORCH="2.13.0+cu130", BUILDS_EXTENSION=True, REASON="")
    assert _library.not_built_status(built, "2.13.0+cu130").startswith(
        "not built: setup.py compiled it (against torch 2.13.0+cu130), but there is no tk_ops/_C module"
    )
    assert _library.not_built_status(None, "2.13.0").startswith("not built: no build record (tk_ops/_build_info.py")


def setup_py_decision(*, env: dict[str, str], before: str = "") -> str:
    """The reason setup.py gives for building no extension ("" when it builds one), run with setup()
    replaced (nothing is built or written); ``before`` runs first (to fake a torch)."""
    code = f"""
        import runpy, setuptools
        setuptools.setup = lambda **kwargs: None
        {before}
        print(repr(runpy.run_path("setup.py")["why_not"]))
        """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO_ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return eval(result.stdout.strip())


def test_setup_py_says_why_it_builds_no_extension():
    assert setup_py_decision(env={"TK_OPS_NO_CUDA": "1"}) == "TK_OPS_NO_CUDA=1 was set"
    no_nvcc = setup_py_decision(
        env={"TK_OPS_NO_CUDA": "0"},
        before="import torch; from torch.utils import cpp_extension; torch.version.cuda = '13.0'; "
        "cpp_extension.CUDA_HOME = None",
    )
    assert no_nvcc == "nvcc not found (CUDA_HOME and CUDA_PATH unset, no nvcc on PATH, no /usr/local/cuda)"
    if not torch.version.cuda:
        assert setup_py_decision(env={"TK_OPS_NO_CUDA": "0"}) == f"torch {torch.__version__} has no CUDA"


def test_setup_py_commands_answer_to_their_names():
    """setup.py's recording commands keep their commands' names (distutils names a command by its
    class's name when it looks up its options)."""
    code = """
        import runpy, setuptools
        from setuptools.dist import Distribution
        captured = {}
        setuptools.setup = lambda **kwargs: captured.update(kwargs)
        runpy.run_path("setup.py")
        dist = Distribution({"cmdclass": captured["cmdclass"]})
        print(sorted(dist.get_command_obj(name).get_command_name() for name in captured["cmdclass"]))
        """
    env = {**os.environ, "TK_OPS_NO_CUDA": "1"}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "['build_ext', 'build_py', 'egg_info']"


def copy_package(destination: Path, no_cuda: str) -> dict[str, str]:
    """Copy what setup.py builds from (no build record, no extension) to ``destination``; returns the
    environment to build and import it there."""
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, destination / name)
    shutil.copytree(
        REPO_ROOT / "tk_ops",
        destination / "tk_ops",
        ignore=shutil.ignore_patterns("__pycache__", "_C*", "_build_info.py"),
    )
    env = {**os.environ, "TK_OPS_NO_CUDA": no_cuda, "PYTHONPATH": ""}
    env.pop("TK_OPS_DISABLE_EXTENSION", None)
    return env


def extension_status_of_copy(root: Path, env: dict[str, str]) -> str:
    """``tk_ops.extension_status()`` of the package copied to ``root``."""
    # An editable install (`pip install -e .`, the README's set-up) puts a finder (a class) on sys.meta_path
    # that maps tk_ops's modules to the checkout, so tk_ops._build_info missing from the copy would be read
    # from the checkout: drop that finder.
    status = [
        sys.executable,
        "-c",
        "import sys; sys.meta_path[:] = [f for f in sys.meta_path if not f.__module__.startswith('__editable__')]; "
        f"import tk_ops; assert tk_ops.__file__.startswith({str(root)!r}), tk_ops.__file__; "
        "print(tk_ops.extension_status())",
    ]
    return subprocess.run(status, cwd=root, env=env, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("no_cuda", ["1", "0"])
def test_build_ext_inplace_records_why_and_extension_status_says_it(tmp_path, no_cuda):
    """`python setup.py build_ext --inplace` (benchmarks/gpu_session.sh's build) in a copy of the
    package writes the record; the package imported from there reports it."""
    if no_cuda == "0" and torch.version.cuda:
        pytest.skip("torch has CUDA here: setup.py would compile the extension")
    env = copy_package(tmp_path, no_cuda)
    assert extension_status_of_copy(tmp_path, env).startswith("not built: no build record (tk_ops/_build_info.py")
    build = [sys.executable, "setup.py", "-q", "build_ext", "--inplace"]
    subprocess.run(build, cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert (tmp_path / "tk_ops" / "_build_info.py").is_file()
    reason = "TK_OPS_NO_CUDA=1 was set" if no_cuda == "1" else f"torch {torch.__version__} has no CUDA"
    assert extension_status_of_copy(tmp_path, env) == f"not built: {reason}"


def test_setup_py_builds_a_read_only_package_without_a_record(tmp_path):
    """Where tk_ops/ cannot be written, egg_info and build_py still complete, say that the record could
    not be written, and extension_status() then says there is no record."""
    # root writes through any permission; without CAP_DAC_OVERRIDE it meets them as other users do
    as_root = os.geteuid() == 0
    if as_root and shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: a read-only directory would be written anyway")
    prefix = ["setpriv", "--inh-caps=-dac_override", "--bounding-set=-dac_override"] if as_root else []
    if as_root and subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("setpriv cannot drop CAP_DAC_OVERRIDE here (no CAP_SETPCAP in this container)")
    env = copy_package(tmp_path, "1")
    package = tmp_path / "tk_ops"
    package.chmod(0o555)
    try:
        probe = [*prefix, sys.executable, "-c", f"open({str(package / 'probe')!r}, 'w')"]
        if subprocess.run(probe, capture_output=True).returncode == 0:
            pytest.skip("a read-only directory is still writable here (a file system or user that ignores modes)")
        build = [*prefix, sys.executable, "setup.py", "egg_info", "build_py"]
        result = subprocess.run(build, cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    finally:
        package.chmod(0o755)
    assert "tk_ops: could not write" in result.stdout
    assert not (package / "_build_info.py").exists()
    assert (tmp_path / "build" / "lib" / "tk_ops" / "__init__.py").is_file()
    assert extension_status_of_copy(tmp_path, env).startswith("not built: no build record (tk_ops/_build_info.py")
