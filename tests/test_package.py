"""The package itself: the CUDA extension is optional, and ``tk_ops.backends()`` says what serves each op
(that every public op is a tk op with a backward op: tests/test_op_contract.py)."""

import subprocess
import sys
import textwrap

import pytest
import torch

import tk_ops
from tk_ops import _library
from tk_testing import IS_HOPPER, requires_cuda


def test_nn_modules_exist():
    for name in ("LayerNorm", "RMSNorm", "RotaryEmbedding", "Linear", "Mamba2Mixer"):
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
    reference = _library._warn_once_on_accelerator("demo", lambda x: x + 1)
    meta = torch.empty(3, device="meta")
    with pytest.warns(UserWarning, match=r"tk\.demo has no meta kernel .*float32\(3,\)"):
        reference(meta)
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("error")
        reference(meta)
    reference(torch.ones(2))  # CPU: never warns


@requires_cuda
def test_extension_loaded_on_hopper():
    if IS_HOPPER:
        assert tk_ops.extension_status() == "loaded"
        assert tk_ops.backends()["matmul"] == "cuda kernel"
