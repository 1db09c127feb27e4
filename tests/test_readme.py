"""README.md stays true: its example runs as written, its results tables are those of the results
JSON, and nothing in the repository points at a file outside it."""

import pathlib
import re
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (REPO_ROOT / "README.md").read_text()


def python_block(heading: str) -> str:
    """The first ```python block of the README's section ``heading`` (## or ###)."""
    section = re.split(rf"\n#+ {re.escape(heading)}\n", README, maxsplit=1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize("heading", ["Example: an attention block on tk_ops", "Hugging Face"])
def test_readme_example_runs_as_written(heading, tmp_path):
    """In a fresh interpreter, from a directory outside the repository (the package on the path)."""
    script = tmp_path / "example.py"
    script.write_text(python_block(heading))
    env = {"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"loss \d+\.\d+", done.stdout), done.stdout


def test_results_tables_are_those_of_the_json():
    from benchmarks import results_tables

    stale = [path for path, text in results_tables.generated().items() if path.read_text() != text]
    assert not stale, f"run python -m benchmarks.results_tables: {stale}"


def test_every_readme_table_has_its_json():
    names = set(re.findall(r"<!-- results:(\w+):begin -->", README))
    assert names and names <= set(__import__("benchmarks.results_tables").results_tables.FAMILIES)


def test_no_file_points_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    outside = re.compile(r"\.\./shared|/work/|anchors\.md")
    found = []
    for name in tracked.stdout.split():
        path = REPO_ROOT / name
        if path.suffix not in {".py", ".md", ".sh", ".cu", ".cuh", ".cpp", ".h", ".toml", ".txt", ""} or not path.is_file():
            continue
        if path.name == "test_readme.py":
            continue
        text = path.read_text(errors="ignore")
        found += [f"{name}: {m.group()}" for m in outside.finditer(text)]
    assert not found, found[:10]
