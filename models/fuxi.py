"""FuXi-α (Ye et al., WWW'25), written padded: an adaptive multi-channel self-attention
(semantic SiLU attention, positional and temporal channels, each causal and each applied to v)
followed by a SwiGLU multi-stage FFN, RMSNorm throughout."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import RelativePositionBias, RelativeTimeBias, SequentialEncoder, causal_padding_mask
from .config import ModelConfig


class FuXiBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        D, H = config.embedding_dim, config.num_heads
        self.num_heads, self.dqk, self.dv = H, config.attention_dim, config.linear_dim
        self.uvqk = nn.Linear(D, H * (3 * self.dv + self.dv + 2 * self.dqk), bias=False)
        self.output = nn.Linear(3 * H * self.dv, D)
        self.dropout = nn.Dropout(config.dropout)
        self.position_bias = RelativePositionBias(config.max_len)
        self.time_bias = RelativeTimeBias(config.num_time_buckets)
        self.ffn_gate = nn.Linear(D, config.ffn_dim, bias=False)
        self.ffn_up = nn.Linear(D, config.ffn_dim, bias=False)
        self.ffn_down = nn.Linear(config.ffn_dim, D, bias=False)

    def forward(self, x: torch.Tensor, valid: torch.Tensor, timestamps: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        H, dqk, dv = self.num_heads, self.dqk, self.dv
        normed = F.rms_norm(x, (D,), eps=1e-6)
        u, v, q, k = torch.split(F.silu(self.uvqk(normed)), [3 * H * dv, H * dv, H * dqk, H * dqk], dim=-1)
        q = q.view(B, N, H, dqk).transpose(1, 2)
        k = k.view(B, N, H, dqk).transpose(1, 2)
        v = v.view(B, N, H, dv).transpose(1, 2)

        mask = causal_padding_mask(valid).unsqueeze(1).to(x.dtype)  # [B, 1, N, N]
        semantic = F.silu(torch.matmul(q, k.transpose(-2, -1))) / N * mask
        positional = self.position_bias(N, x.device) * mask
        temporal = self.time_bias(timestamps, valid).unsqueeze(1) * mask
        channels = [torch.matmul(positional, v), torch.matmul(temporal, v), torch.matmul(semantic, v)]
        out = torch.cat(channels, dim=-1).transpose(1, 2).reshape(B, N, 3 * H * dv)

        x = x + self.output(self.dropout(F.rms_norm(out, (3 * H * dv,), eps=1e-6) * u))
        h = F.rms_norm(x, (D,), eps=1e-6)
        return x + self.dropout(self.ffn_down(F.silu(self.ffn_gate(h)) * self.ffn_up(h)))


class FuXiAlpha(SequentialEncoder):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.blocks = nn.ModuleList(FuXiBlock(config) for _ in range(config.num_blocks))

    def encode(self, x: torch.Tensor, valid: torch.Tensor, timestamps: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self.run_block(block, x, valid, timestamps)
        return x
