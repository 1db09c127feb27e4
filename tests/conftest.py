import zlib

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_seed_and_dynamo(request):
    """Every test draws fresh random inputs from its own seed and starts with a clean Dynamo cache."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    torch._dynamo.reset()
    yield
