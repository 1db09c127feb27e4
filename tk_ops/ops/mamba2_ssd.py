"""PLACEHOLDER: replaced by this op's implementation (schema, checks, reference, fake, autograd)."""


def mamba2_ssd(*args, **kwargs):
    raise NotImplementedError("tk_ops.mamba2_ssd is not implemented yet")
