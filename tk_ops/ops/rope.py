"""PLACEHOLDER: replaced by this op's implementation (schema, checks, reference, fake, autograd)."""


def rope(*args, **kwargs):
    raise NotImplementedError("tk_ops.rope is not implemented yet")


def rope_qk(*args, **kwargs):
    raise NotImplementedError("tk_ops.rope_qk is not implemented yet")
