"""The package itself: the CUDA extension is optional, ``tk_ops.backends()`` says what serves each
op, and the set-up (README, CI, pyproject.toml) holds together (that every public op is a tk op
with a backward op: tests/test_op_contract.py)."""

import ast
import importlib.metadata
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tk_ops
from tk_ops import _library
from tk_testing import IS_HOPPER, requires_cuda

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_nn_modules_exist():
    for name in ("LayerNorm", "RMSNorm", "RotaryEmbedding", "Linear", "Mamba2Mixer", "GatedDeltaNet"):
        assert issubclass(getattr(tk_ops.nn, name), torch.nn.Module)


def test_backends_report_reference_without_extension():
    if tk_ops.extension_status() == "loaded":
        pytest.skip("the CUDA extension is built here")
    assert set(tk_ops.backends().values()) == {"reference"}


def _run_python(code: str, **env) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, **env},
        check=True,
    )
    return result.stdout.strip()


def test_extension_can_be_disabled():
    out = _run_python(
        """
        import tk_ops
        print(tk_ops.extension_status(), sorted(set(tk_ops.backends().values())))
        """,
        TK_OPS_DISABLE_EXTENSION="1",
    )
    assert out == "disabled by TK_OPS_DISABLE_EXTENSION=1 ['reference']"


def test_setup_builds_no_extension_without_cuda_torch():
    if torch.version.cuda:
        pytest.skip("torch has CUDA here: setup.py builds the extension")
    out = _run_python(
        """
        import runpy, setuptools
        captured = {}
        setuptools.setup = lambda **kwargs: captured.update(kwargs)
        runpy.run_path("setup.py")
        print(len(captured["ext_modules"]), sorted(captured["packages"])[:2])
        """
    )
    assert out == "0 ['tk_ops', 'tk_ops.inductor']"


def test_reference_on_accelerator_warns_once(monkeypatch):
    """The fallback warning names the op and the inputs; it is emitted once per op."""
    monkeypatch.setattr(_library, "_REFERENCE_WARNED", set())
    reference = _library._reference_kernel("demo", lambda x: x + 1)
    meta = torch.empty(3, device="meta")
    with pytest.warns(UserWarning, match=r"tk\.demo has no meta kernel .*float32\(3,\)"):
        reference(meta)
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("error")
        reference(meta)
    reference(torch.ones(2))  # CPU: never warns


def test_references_run_with_autocast_off():
    """A reference computes in fp32 (fp64) whatever autocast the op is called under: the public functions
    have already cast the inputs as autocast would, and its internal matmuls must not go to 16 bits."""
    seen = _library._reference_kernel("demo", lambda x: torch.is_autocast_enabled(x.device.type))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not seen(torch.ones(2))
    q, k, v = (torch.randn(1, 2, 33, 64, dtype=torch.bfloat16) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = tk_ops.attention(q, k, v, causal=True)
    torch.testing.assert_close(under_autocast, tk_ops.attention(q, k, v, causal=True), rtol=0, atol=0)


@requires_cuda
def test_extension_loaded_on_hopper():
    if IS_HOPPER:
        assert tk_ops.extension_status() == "loaded"
        assert tk_ops.backends()["matmul"] == "cuda kernel"


# ------------------------------------------------------------------- set-up: README, CI, pyproject

# the benchmarks' GPU baselines: imported only where installed (the tests that need one skip)
OPTIONAL_BASELINES = {"fla", "liger_kernel", "mamba_ssm"}


def readme_command(heading: str) -> str:
    """The command of the README's section ``heading``: its ```bash block, which must be one line."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = section.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert len(lines) == 1, f"the README's {heading!r} is not one command: {lines}"
    return lines[0]


# .ci/run: the README's commands, then (from this line on) the transformers-dependent tests again on the
# oldest transformers of the supported range
CI_OLDEST_TRANSFORMERS_STEP = "# The oldest transformers of the supported range"

# a test file that uses transformers
USES_TRANSFORMERS = re.compile(r'^\s*(?:import|from) transformers\b|importorskip\(\s*"transformers"', re.M)


def ci_commands() -> tuple[list[str], list[str]]:
    """The commands (lines starting with pip or python -m) of .ci/run before and after its oldest-transformers step."""
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    readme_part, marker, oldest_part = ci.partition(f"\n{CI_OLDEST_TRANSFORMERS_STEP}")
    assert marker, f".ci/run has no line starting with {CI_OLDEST_TRANSFORMERS_STEP!r}"
    return tuple([line for line in part.splitlines() if re.match(r"(pip|python -m) ", line)]
                 for part in (readme_part, oldest_part))


def test_ci_runs_exactly_the_readme_commands():
    assert ci_commands()[0] == [readme_command("Set up and run the demo"), readme_command("Test")]


def test_ci_tests_the_oldest_supported_transformers():
    """After the README's commands CI installs the lower bound of the test extra's transformers range (the
    range tk_ops.transformers supports) and runs every test file that uses transformers again."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    from tk_ops.transformers import SUPPORTED_TRANSFORMERS

    extra = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert f"transformers{SUPPORTED_TRANSFORMERS}" in extra
    oldest = re.fullmatch(r">=([0-9.]+),<[0-9.]+", SUPPORTED_TRANSFORMERS).group(1)
    files = sorted(path.relative_to(REPO_ROOT).as_posix() for path in (REPO_ROOT / "tests").glob("test_*.py")
                   if USES_TRANSFORMERS.search(path.read_text()))
    assert {"tests/test_nn_mamba2.py", "tests/test_models.py", "tests/test_train.py"} <= set(files)
    assert ci_commands()[1] == [f'pip install -q "transformers=={oldest}"', f"python -m pytest -q {' '.join(files)}"]


def test_readme_set_up_installs_every_extra():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f'-e ".[{",".join(sorted(extras))}]"' in readme_command("Set up and run the demo")


def _distribution(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group()).lower()


def _third_party_imports(folders: tuple[str, ...]) -> set[str]:
    tests = REPO_ROOT / "tests"
    local = ({path.stem for path in REPO_ROOT.iterdir()} | {path.stem for path in tests.rglob("*.py")}
             | {path.name for path in tests.iterdir() if (path / "__init__.py").exists()})  # tests/inputs
    names = set()
    for path in (path for folder in folders for path in (REPO_ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - local


@pytest.mark.parametrize("extra, folders", [("demo", ("models",)), ("test", ("tests", "models", "benchmarks"))])
def test_pyproject_declares_what_the_demo_and_the_tests_import(extra, folders):
    """Each third-party module the demo (models/) or the tests (which also run models/ and benchmarks/)
    import comes from torch or the extra."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    declared = {_distribution(r) for r in project["dependencies"] + project["optional-dependencies"][extra]}
    distributions = importlib.metadata.packages_distributions()
    names = _third_party_imports(folders) - OPTIONAL_BASELINES
    assert {_distribution(distributions.get(name, [name])[0]) for name in names} <= declared
