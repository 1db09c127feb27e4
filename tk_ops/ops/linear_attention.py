"""PLACEHOLDER: replaced by this op's implementation (schema, checks, reference, fake, autograd)."""


def linear_attention(*args, **kwargs):
    raise NotImplementedError("tk_ops.linear_attention is not implemented yet")
