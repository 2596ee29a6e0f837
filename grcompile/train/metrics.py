"""Full-ranking retrieval metrics: every item is scored, the user's history is filtered out
(never the target), and the target's 0-based rank counts the items scored strictly higher."""
from __future__ import annotations

from typing import Iterable

import torch


def target_ranks(scores: torch.Tensor, targets: torch.Tensor, history_ids: torch.Tensor | None = None,
                 pad_id: int = 0) -> torch.Tensor:
    """``scores [B, V+1]`` over item ids (column ``pad_id`` is padding), ``targets [B]``,
    ``history_ids [B, H]`` (``pad_id``-padded) → 0-based rank of each target ``[B]``."""
    scores = scores.float().clone()
    target_scores = scores.gather(1, targets.unsqueeze(1))
    if history_ids is not None and history_ids.numel():
        scores.scatter_(1, history_ids, float("-inf"))
    scores[:, pad_id] = float("-inf")
    scores.scatter_(1, targets.unsqueeze(1), target_scores)  # a re-consumed target stays rankable
    return (scores > target_scores).sum(dim=1)


def metrics_from_ranks(ranks: torch.Tensor, hr_ks: Iterable[int] = (10, 50, 200),
                       ndcg_ks: Iterable[int] = (10, 200)) -> dict[str, float]:
    ranks = ranks.double()
    out = {f"hr@{k}": (ranks < k).double().mean().item() for k in hr_ks}
    gain = 1.0 / torch.log2(ranks + 2.0)
    out.update({f"ndcg@{k}": torch.where(ranks < k, gain, torch.zeros_like(gain)).mean().item() for k in ndcg_ks})
    out["mrr"] = (1.0 / (ranks + 1.0)).mean().item()
    return out


@torch.no_grad()
def evaluate(encoder: torch.nn.Module, loader: Iterable[dict[str, torch.Tensor]],
             device: torch.device | str = "cpu") -> dict[str, float]:
    """Score all items for the last real position of each history; HR/NDCG/MRR over the examples.

    ``encoder`` is the (uncompiled) SequentialEncoder; evaluation runs it eagerly in eval mode.
    """
    was_training = encoder.training
    encoder.eval()
    pad = encoder.config.pad_id
    ranks = []
    try:
        items = encoder.all_item_embeddings()
        for batch in loader:
            ids, ts = batch["ids"].to(device), batch["timestamps"].to(device)
            out = encoder(ids, ts)
            last = ((ids != pad).sum(dim=1) - 1).clamp(min=0)
            user = out[torch.arange(len(ids), device=device), last]
            ranks.append(target_ranks(user @ items.T, batch["targets"].to(device),
                                      batch["history_ids"].to(device), pad_id=pad).cpu())
    finally:
        encoder.train(was_training)
    result = metrics_from_ranks(torch.cat(ranks))
    result["examples"] = float(sum(len(r) for r in ranks))
    return result
