"""A stand-in for flash-linear-attention in the CPU tests (tests/fake_peers on sys.path or PYTHONPATH):
``fla.ops.based.parallel_based`` with fla-core 0.6.0's contract, in plain PyTorch."""

__version__ = "fake"
