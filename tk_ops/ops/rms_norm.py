"""PLACEHOLDER: replaced by this op's implementation (schema, checks, reference, fake, autograd)."""


def rms_norm(*args, **kwargs):
    raise NotImplementedError("tk_ops.rms_norm is not implemented yet")
