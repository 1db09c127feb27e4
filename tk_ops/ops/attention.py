"""PLACEHOLDER: replaced by this op's implementation (schema, checks, reference, fake, autograd)."""


def attention(*args, **kwargs):
    raise NotImplementedError("tk_ops.attention is not implemented yet")
