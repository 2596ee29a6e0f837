"""Next-item retrieval objective of the HSTU paper: sampled softmax over L2-normalised
embeddings with temperature, uniform negatives."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SampledSoftmaxRetrieval(nn.Module):
    """``forward(ids, timestamps, negatives [B, R]) -> mean loss over valid positions``.

    Position i predicts ``ids[:, i + 1]``; it counts when both items are real. The R negatives of
    a row are shared by its positions, so the logits are one batched matmul [B, N, D]·[B, D, R]
    rather than a [B, N, R, D] gather. A negative that equals the positive is masked out.
    """

    def __init__(self, encoder: nn.Module, temperature: float = 0.05) -> None:
        super().__init__()
        self.encoder = encoder
        self.temperature = temperature

    def forward(self, ids: torch.Tensor, timestamps: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
        pad = self.encoder.config.pad_id
        user = self.encoder(ids, timestamps)[:, :-1]  # [B, N-1, D]
        targets = ids[:, 1:]
        valid = (ids[:, :-1] != pad) & (targets != pad)

        positive = (user * self.encoder.item_embeddings(targets)).sum(-1, keepdim=True)
        negative = torch.bmm(user, self.encoder.item_embeddings(negatives).transpose(1, 2))
        negative = negative.masked_fill(negatives.unsqueeze(1) == targets.unsqueeze(2), float("-inf"))
        logits = torch.cat([positive, negative], dim=-1) / self.temperature
        loss = -F.log_softmax(logits, dim=-1)[..., 0]
        return (loss * valid).sum() / valid.sum().clamp(min=1)
