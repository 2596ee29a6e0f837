"""Next-item retrieval objective of the HSTU paper: sampled softmax over L2-normalised
embeddings with temperature, uniform negatives."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SampledSoftmaxRetrieval(nn.Module):
    """``forward(ids, timestamps, negatives) -> mean loss over valid positions``.

    Position i predicts ``ids[:, i + 1]``; it counts when both items are real. A negative that
    equals the positive is masked out. ``negatives`` is either
      * ``[B, R]``: shared by the positions of a row; logits are one batched matmul
        [B, N, D]·[B, D, R] (cheap at any catalogue size), or
      * ``[B, N, R]``: per position, as in the HSTU paper; logits are scored against the whole
        normalised table once ([B·N, D]·[D, V+1], one GEMM) and the R columns of each position
        gathered, so no [B, N, R, D] tensor is built (for catalogues that fit a [B·N, V+1] matrix).
    """

    def __init__(self, encoder: nn.Module, temperature: float = 0.05) -> None:
        super().__init__()
        self.encoder = encoder
        self.temperature = temperature

    def count_targets(self, ids: torch.Tensor) -> int:
        """How many positions of ``ids`` the loss averages over (to weight a slice of a batch)."""
        pad = self.encoder.config.pad_id
        return int(((ids[:, :-1] != pad) & (ids[:, 1:] != pad)).sum())

    def forward(self, ids: torch.Tensor, timestamps: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
        pad = self.encoder.config.pad_id
        user = self.encoder(ids, timestamps)[:, :-1]  # [B, N-1, D]
        targets = ids[:, 1:]
        valid = (ids[:, :-1] != pad) & (targets != pad)

        positive = (user * self.encoder.item_embeddings(targets)).sum(-1, keepdim=True)
        if negatives.dim() == 3:
            negatives = negatives[:, :-1]
            table = self.encoder.all_item_embeddings()  # [V + 1, D]
            negative = torch.matmul(user, table.T).gather(-1, negatives)  # [B, N-1, R]
            same = negatives == targets.unsqueeze(2)
        else:
            negative = torch.bmm(user, self.encoder.item_embeddings(negatives).transpose(1, 2))
            same = negatives.unsqueeze(1) == targets.unsqueeze(2)
        negative = negative.masked_fill(same, float("-inf"))
        logits = torch.cat([positive, negative], dim=-1) / self.temperature
        loss = -F.log_softmax(logits, dim=-1)[..., 0]
        return (loss * valid).sum() / valid.sum().clamp(min=1)
