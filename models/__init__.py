"""Naive padded generative-recommendation models, written the way users write them.

These are grcompile's *inputs*: plain PyTorch over padded ``[B, N]`` ids with a padding id,
boolean masks from ``ids != pad``, dense ``[B, H, N, N]`` attention. Nothing here is jagged.
"""
from .config import ModelConfig
from .fuxi import FuXiAlpha
from .hstu import HSTU
from .presets import PRESETS, build_encoder, make_config
from .retrieval import SampledSoftmaxRetrieval
from .sasrec import SASRec

__all__ = ["ModelConfig", "PRESETS", "build_encoder", "make_config", "HSTU", "FuXiAlpha", "SASRec",
           "SampledSoftmaxRetrieval"]
