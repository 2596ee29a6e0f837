"""Compile-mode training benchmark: ``python -m grcompile.bench`` (see README.md here).

One subprocess per mode (``grcompile.bench.worker``) on identical seeded batches and weights;
analytic valid-token FLOPs in ``grcompile.bench.flops``; bar chart in ``grcompile.bench.plot``.
Sparse-runtime measurements on N gloo ranks: ``python -m grcompile.bench.step_split`` (sharded
training steps, time split and bytes moved) and ``python -m grcompile.bench.dedup_stats`` (the item
table's all-to-all traffic per dedup mode).
"""
from .flops import forward_flops, training_flops, valid_lengths

__all__ = ["forward_flops", "training_flops", "valid_lengths"]
