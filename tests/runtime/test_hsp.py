"""Hierarchical sparse parallelism on 4 gloo ranks (2 groups of 2): lookups equal the unsharded
table, and after the cross-group sparse sync every replica holds the centralized gradient of the
global batch (TurboGR eq. 1) — the same on both peers, bit for bit."""
import torch
import torch.distributed as dist

from grcompile.runtime.hsp import HSPEmbedding
from grcompile.runtime.launch import run_on_ranks

from .test_dedup import D, V, zipf_ids


def _worker(rank: int, world: int) -> tuple:
    full = torch.randn(V, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    emb = HSPEmbedding(V, D, group_size=2, full_weight=full).double()
    ids = zipf_ids(rank)
    g = torch.randn(*ids.shape, D, generator=torch.Generator().manual_seed(20 + rank), dtype=torch.float64)
    values = emb(ids)
    torch.testing.assert_close(values, full[ids])
    (values * g).sum().backward()
    emb.sync_gradients()
    central = torch.zeros_like(full).index_add_(0, ids.reshape(-1), g.reshape(-1, D))
    dist.all_reduce(central)  # the whole world's batch
    torch.testing.assert_close(emb.weight.grad, central[rank % 2::2])
    return (emb.weight.grad.clone(), emb.stats.as_dict(), emb.sync_stats.as_dict())


def test_hsp_gradients_are_the_centralized_ones():
    world = 4
    out = run_on_ranks(_worker, world)
    assert torch.equal(out[0][0], out[2][0]) and torch.equal(out[1][0], out[3][0])  # replicas agree exactly
    assert all(out[r][2]["rows_sent"] > 0 for r in range(world))
