import zlib

import pytest
import torch


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
