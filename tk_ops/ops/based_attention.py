"""PLACEHOLDER: replaced by this op's implementation (schema, checks, reference, fake, autograd)."""


def based_attention(*args, **kwargs):
    raise NotImplementedError("tk_ops.based_attention is not implemented yet")
