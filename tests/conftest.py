import importlib
import os
import pathlib
import sys
import zlib

import pytest
import torch

import tk_ops  # defines the tk ops before a test library registers kernels for them

# A shared library of extra kernels for the tk ops, loaded before any test runs: how
# tests/test_cpp_autograd.py runs tests through the C++ autograd kernels built for the CPU (it also
# lets any test file run that way: TK_OPS_TEST_LIBRARY=path/to/lib.so python -m pytest tests/...).
if os.environ.get("TK_OPS_TEST_LIBRARY"):
    torch.ops.load_library(os.environ["TK_OPS_TEST_LIBRARY"])
    tk_ops._library.register_cpp_autograd()  # a C++ autograd interpreter there takes the ops' tables


@pytest.fixture(autouse=True)
def _fresh_seed_and_dynamo(request):
    """Every test draws fresh random inputs from its own seed and starts with a clean Dynamo cache."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    torch._dynamo.reset()
    yield


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """For modules of tiny shapes: one intra-op thread is faster than two, and robust to a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def poisoned_allocations():
    """Every tensor the test allocates, the kernels' outputs included, starts as NaN (torch's
    deterministic mode fills uninitialised memory): an element a kernel never writes cannot pass."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    assert torch.empty(1, device="cuda", dtype=torch.float16).isnan().all()
    yield
    torch.utils.deterministic.fill_uninitialized_memory = fill
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)


FAKE_PEERS = pathlib.Path(__file__).parent / "fake_peers"
PEER_PACKAGES = ("fla", "mamba_ssm", "flash_attn")


@pytest.fixture
def fake_peers(monkeypatch):
    """The peer libraries of models.peers and FlashAttention-4 (bench_attention's fa4 rows) replaced by
    tests/fake_peers (their contracts in PyTorch), in this process (first on sys.path, any real fla /
    mamba_ssm / flash_attn modules set aside) and in the subprocesses it starts (first on PYTHONPATH).
    Yields the fakes' call records by model ("fa4": flash_attn.cute's)."""

    def peer_modules() -> list[str]:
        return [name for name in sys.modules if name.split(".")[0] in PEER_PACKAGES]

    for name in peer_modules():
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(FAKE_PEERS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(FAKE_PEERS), str(FAKE_PEERS.parent.parent),
                                                                   os.environ.get("PYTHONPATH")])))
    yield {
        "based": importlib.import_module("fla.ops.based").CALLS,
        "mamba2": importlib.import_module("mamba_ssm.ops.triton.ssd_combined").CALLS,
        "fa4": importlib.import_module("flash_attn.cute").CALLS,
    }
    for name in peer_modules():  # the fakes; monkeypatch then puts back what it set aside
        del sys.modules[name]
