"""Unit tests of the pieces of grcompile/lowering/attention/ (the op itself: tests/lowering/test_jagged_ops.py)."""
