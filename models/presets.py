"""Published model configurations.

``ml1m`` / ``ml1m-large``: the ML-1M configs of the HSTU paper (D=50, max_len 200, dropout 0.2;
HSTU 2 blocks × 1 head, HSTU-large 8 blocks × 2 heads with dqk = dv = 25), used for SASRec and
FuXi-α alike. ``tiny`` … ``long``: TurboGR Appendix A (emb 128/256/512/1024, blocks 2/4/8/16,
8 heads, qkv 16/32/64/128 per head, seq len 2000, long = large at 4096, 32 time buckets,
dropout 0.5).
"""
from __future__ import annotations

from typing import Any

import torch.nn as nn

from .config import ModelConfig

_ML1M = dict(embedding_dim=50, max_len=200, dropout=0.2, num_time_buckets=128)
_ML1M_BASE = dict(_ML1M, num_blocks=2, num_heads=1, attention_dim=50, linear_dim=50)
_ML1M_LARGE = dict(_ML1M, num_blocks=8, num_heads=2, attention_dim=25, linear_dim=25)


def _turbogr(dim: int, blocks: int, head_dim: int, max_len: int = 2000) -> dict[str, Any]:
    return dict(embedding_dim=dim, num_blocks=blocks, num_heads=8, attention_dim=head_dim,
                linear_dim=head_dim, max_len=max_len, dropout=0.5, num_time_buckets=32)


_TURBOGR = {
    "tiny": _turbogr(128, 2, 16),
    "small": _turbogr(256, 4, 32),
    "medium": _turbogr(512, 8, 64),
    "large": _turbogr(1024, 16, 128),
    "long": _turbogr(1024, 16, 128, max_len=4096),
}

# FFN width: SASRec keeps the paper's D-wide point-wise FFN; FuXi-α's SwiGLU gets 4·D.
_FFN_MULT = {"hstu": 1, "sasrec": 1, "fuxi": 4}

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    model: {
        "ml1m": dict(_ML1M_BASE),
        "ml1m-large": dict(_ML1M_LARGE),
        **{name: dict(cfg) for name, cfg in _TURBOGR.items()},
    }
    for model in ("hstu", "fuxi", "sasrec")
}


def make_config(model: str, preset: str, num_items: int, **overrides: Any) -> ModelConfig:
    """Preset values, then ``overrides`` (``None`` values are ignored)."""
    if model not in PRESETS:
        raise ValueError(f"unknown model {model!r}; choose from {sorted(PRESETS)}")
    if preset not in PRESETS[model]:
        raise ValueError(f"unknown preset {preset!r} for {model}; choose from {sorted(PRESETS[model])}")
    values = dict(PRESETS[model][preset])
    values.update({k: v for k, v in overrides.items() if v is not None})
    values.setdefault("ffn_dim", _FFN_MULT[model] * values["embedding_dim"])
    return ModelConfig(model=model, num_items=num_items, **values)


def build_encoder(model: str, preset: str, num_items: int, **overrides: Any) -> nn.Module:
    """The naive padded encoder of ``model`` in configuration ``preset``."""
    from .fuxi import FuXiAlpha
    from .hstu import HSTU
    from .sasrec import SASRec

    config = make_config(model, preset, num_items, **overrides)
    return {"hstu": HSTU, "fuxi": FuXiAlpha, "sasrec": SASRec}[model](config)
