"""A stand-in for mamba_ssm in the CPU tests (tests/fake_peers on sys.path or PYTHONPATH):
``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`` with mamba-ssm 2.3.2's contract, on
models.mamba2's reference SSD."""

__version__ = "fake"
