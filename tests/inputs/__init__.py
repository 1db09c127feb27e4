"""Inputs and references that the op-contract table (tests/op_db.py) and an op's own tests
(tests/test_<op>.py) both use, one module per op: both import them from here, and the table imports
no test module."""
