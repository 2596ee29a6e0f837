"""SASRec (Kang & McAuley, ICDM'18), written padded: pre-LN transformer blocks with softmax
attention under a causal and key-padding mask, point-wise FFN, final LayerNorm."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import SequentialEncoder, causal_padding_mask
from .config import ModelConfig

# The SASRec authors' masking constant: finite, so a query with no visible key (an empty or
# padded row) gets uniform weights instead of NaN, which would leak into valid rows via 0·NaN.
MASKED_SCORE = -(2.0**32) + 1


class SASRecBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        D, H = config.embedding_dim, config.num_heads
        self.num_heads, self.dqk, self.dv = H, config.attention_dim, config.linear_dim
        self.attention_norm = nn.LayerNorm(D, eps=1e-8)
        self.query = nn.Linear(D, H * self.dqk)
        self.key = nn.Linear(D, H * self.dqk)
        self.value = nn.Linear(D, H * self.dv)
        self.output = nn.Linear(H * self.dv, D)
        self.ffn_norm = nn.LayerNorm(D, eps=1e-8)
        self.ffn = nn.Sequential(
            nn.Linear(D, config.ffn_dim), nn.ReLU(), nn.Dropout(config.dropout), nn.Linear(config.ffn_dim, D)
        )
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        H, dqk, dv = self.num_heads, self.dqk, self.dv
        h = self.attention_norm(x)
        q = self.query(h).view(B, N, H, dqk).transpose(1, 2)
        k = self.key(h).view(B, N, H, dqk).transpose(1, 2)
        v = self.value(h).view(B, N, H, dv).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(dqk)
        scores = scores.masked_fill(~causal_padding_mask(valid).unsqueeze(1), MASKED_SCORE)
        attn = self.dropout(torch.softmax(scores, dim=-1))
        out = torch.matmul(attn, v).transpose(1, 2).reshape(B, N, H * dv)
        x = x + self.dropout(self.output(out))
        x = x + self.dropout(self.ffn(self.ffn_norm(x)))
        return x * valid.unsqueeze(-1)


class SASRec(SequentialEncoder):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.blocks = nn.ModuleList(SASRecBlock(config) for _ in range(config.num_blocks))
        self.final_norm = nn.LayerNorm(config.embedding_dim, eps=1e-8)

    def encode(self, x: torch.Tensor, valid: torch.Tensor, timestamps: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self.run_block(block, x, valid)
        return self.final_norm(x)
