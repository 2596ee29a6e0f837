"""Hierarchical sparse parallelism (TurboGR §4.2.1) on CPU: ranks in groups of ``group_size``,
each group holding a full row-wise sharded replica of the table, the lookup all-to-alls confined
to the group, and the sparse gradients (touched row indices + values) all-gathered across the
groups so every replica applies the same update — exactly the centralized gradient of the
global batch (TurboGR eq. 1). TorchRec's DMPCollection does this on CUDA only.

Layout: world ``W = G · group_size``; rank ``r`` is in group ``r // group_size`` at position
``r % group_size``; ``replica peers`` are the ranks at the same position in every group (they
hold the same shard). Every rank must construct the module (process groups are created
collectively, in the same order everywhere).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .dedup import LookupStats, ShardedEmbedding


def hsp_groups(group_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup, int]:
    """``(my shard group, my replica-peer group, number of groups)``; collective over the world."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if group_size < 1 or world % group_size:
        raise ValueError(f"group_size must divide the world size {world}, got {group_size}")
    n_groups = world // group_size
    mine = peers = None
    for g in range(n_groups):
        pg = dist.new_group(list(range(g * group_size, (g + 1) * group_size)))
        if rank // group_size == g:
            mine = pg
    for p in range(group_size):
        pg = dist.new_group(list(range(p, world, group_size)))
        if rank % group_size == p:
            peers = pg
    return mine, peers, n_groups


class HSPEmbedding(nn.Module):
    """A ``ShardedEmbedding`` per group plus the cross-group sparse gradient sync
    (``sync_gradients()`` after ``backward()``, before the optimizer step)."""

    def __init__(self, num_embeddings: int, dim: int, *, group_size: int, name: str = "embedding",
                 dedup: str = "two_stage", full_weight: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.group, self.peers, self.n_groups = hsp_groups(group_size)
        self.table = ShardedEmbedding(num_embeddings, dim, name=name, dedup=dedup, group=self.group,
                                      full_weight=full_weight)
        self.sync_stats = LookupStats()  # rows_sent / embedding_bytes of the gradient sync

    @property
    def weight(self) -> nn.Parameter:
        return self.table.weight

    @property
    def stats(self) -> LookupStats:
        return self.table.stats

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids)

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Sum the shard's gradient over the replica peers, sending only touched rows."""
        grad = self.weight.grad
        if self.n_groups == 1 or grad is None:
            return
        rows = (grad != 0).any(dim=1).nonzero().squeeze(1)
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.n_groups)]
        dist.all_gather(counts, torch.tensor([rows.numel()]), group=self.peers)
        longest = int(max(c.item() for c in counts))
        pad = longest - rows.numel()
        idx = torch.cat([rows, rows.new_full((pad,), -1)])
        val = torch.cat([grad[rows], grad.new_zeros(pad, grad.shape[1])])
        all_idx = [torch.empty_like(idx) for _ in range(self.n_groups)]
        all_val = [torch.empty_like(val) for _ in range(self.n_groups)]
        dist.all_gather(all_idx, idx, group=self.peers)
        dist.all_gather(all_val, val, group=self.peers)
        total = torch.zeros_like(grad)
        for i, v in zip(all_idx, all_val):  # same order on every peer: identical sums
            keep = i >= 0
            total.index_add_(0, i[keep], v[keep])
        self.weight.grad = total
        self.sync_stats.add(LookupStats(rows_sent=rows.numel() * (self.n_groups - 1),
                                        embedding_bytes=rows.numel() * (self.n_groups - 1) * grad.shape[1]
                                        * grad.element_size(), lookups=1))


__all__ = ["HSPEmbedding", "hsp_groups"]
