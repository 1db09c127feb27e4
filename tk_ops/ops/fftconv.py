"""PLACEHOLDER: replaced by this op's implementation (schema, checks, reference, fake, autograd)."""


def fftconv(*args, **kwargs):
    raise NotImplementedError("tk_ops.fftconv is not implemented yet")
