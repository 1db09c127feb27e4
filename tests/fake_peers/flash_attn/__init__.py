"""A stand-in for FlashAttention-4 in the CPU tests (tests/fake_peers on sys.path or PYTHONPATH):
``flash_attn.cute.flash_attn_func`` with flash-attn-4 4.0.0b36's contract, in plain PyTorch."""
