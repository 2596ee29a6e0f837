"""Tests of the op library (grcompile/lowering).

Hypothesis profiles: ``lowering`` (default, 25 examples) and ``lowering-slow`` (300 examples);
pick one with ``GRCOMPILE_HYPOTHESIS_PROFILE=lowering-slow``. The ``slow``-marked test re-runs the
attention properties under ``lowering-slow`` regardless.
"""
import os

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               derandomize=False, print_blob=True)
settings.register_profile("lowering", max_examples=25, **_COMMON)
settings.register_profile("lowering-slow", max_examples=300, **_COMMON)

PROFILE = os.environ.get("GRCOMPILE_HYPOTHESIS_PROFILE", "lowering")
