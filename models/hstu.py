"""HSTU (Zhai et al., ICML'24), research layer, written as a user writes it: padded [B, N],
dense [B, H, N, N] pointwise-SiLU attention under a causal × padding mask, relative bias."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import RelativePositionBias, RelativeTimeBias, SequentialEncoder, causal_padding_mask
from .config import ModelConfig


class HSTUBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        D, H = config.embedding_dim, config.num_heads
        self.num_heads, self.dqk, self.dv = H, config.attention_dim, config.linear_dim
        self.uvqk = nn.Linear(D, H * (2 * self.dv + 2 * self.dqk), bias=False)
        self.output = nn.Linear(H * self.dv, D)
        self.dropout = nn.Dropout(config.dropout)
        self.position_bias = RelativePositionBias(config.max_len)
        self.time_bias = RelativeTimeBias(config.num_time_buckets)

    def forward(self, x: torch.Tensor, valid: torch.Tensor, timestamps: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        H, dqk, dv = self.num_heads, self.dqk, self.dv
        normed = F.layer_norm(x, (D,), eps=1e-6)
        u, v, q, k = torch.split(F.silu(self.uvqk(normed)), [H * dv, H * dv, H * dqk, H * dqk], dim=-1)
        q = q.view(B, N, H, dqk).transpose(1, 2)
        k = k.view(B, N, H, dqk).transpose(1, 2)
        v = v.view(B, N, H, dv).transpose(1, 2)

        rab = self.position_bias(N, x.device).unsqueeze(0) + self.time_bias(timestamps, valid)
        scores = torch.matmul(q, k.transpose(-2, -1)) + rab.unsqueeze(1)
        attn = F.silu(scores) / N
        attn = attn * causal_padding_mask(valid).unsqueeze(1)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(B, N, H * dv)

        gated = u * F.layer_norm(out, (H * dv,), eps=1e-6)
        return x + self.output(self.dropout(gated))


class HSTU(SequentialEncoder):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.blocks = nn.ModuleList(HSTUBlock(config) for _ in range(config.num_blocks))

    def encode(self, x: torch.Tensor, valid: torch.Tensor, timestamps: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self.run_block(block, x, valid, timestamps)
        return x
