"""User code that runs part of its block jagged by hand with fbgemm and pads back with
``jagged_to_padded_dense``: the padded tensor's axes are the batch's (rows, positions) exactly
when its offsets are the cumulative sum of a per-row value of the batch and it pads to ``N``;
then the attention after it fuses and the block goes jagged. Offsets in another row order, or a
different padded length, give no layout: that part stays as written. Exact in every case."""
from __future__ import annotations

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.passes.test_jagged_spellings import check, jagged_ops, make_ids

N, D, V = 8, 8, 40


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class HandJagged(nn.Module):
    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.emb = nn.Embedding(V, D, padding_idx=0)
        self.mlp = nn.Linear(D, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.o = nn.Linear(D, D)

    def forward(self, ids):
        B, n = ids.shape
        valid = ids != 0
        lengths = valid.sum(1)
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
        values = torch.ops.fbgemm.dense_to_jagged(self.emb(ids), [offsets])[0]
        values = values + torch.relu(self.mlp(values))
        pad_to = n + 2 if self.variant == "longer" else n
        if self.variant == "flipped":  # rows padded back in reverse order, then flipped by the user
            x = torch.ops.fbgemm.jagged_to_padded_dense(
                values.flip(0), [torch.ops.fbgemm.asynchronous_complete_cumsum(lengths.flip(0))], [n], 0.0).flip(0)
        else:
            x = torch.ops.fbgemm.jagged_to_padded_dense(values, [offsets], [pad_to], 0.0)[:, :n]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        mask = torch.tril(torch.ones(n, n, dtype=torch.bool, device=ids.device)) & valid[:, None, :]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return (x + self.o(a)) * valid.unsqueeze(-1)


def _tokens(outs, args):
    v = args[0] != 0
    return [v.unsqueeze(-1).expand_as(outs[0])]


@pytest.mark.parametrize("variant", ["plain", "longer", "flipped"])
def test_padded_back_by_hand(variant):
    torch.manual_seed(0)
    model = HandJagged(variant)  # fbgemm jagged ops have no float64 kernels
    optimized, report = check(model, (make_ids([0, 1, N, 5, 3]),), _tokens, train=True)
    check(model, (make_ids([2, 4, 7, N, 1], seed=1),), _tokens, train=False, optimized=optimized)
    fused = report.counters.get("fuse_attention.score_mod_attention", 0)
    if variant == "plain":
        assert fused == 1 and "jagged_attention" in jagged_ops(report), report
    else:  # no layout for the padded tensor: the attention stays as written
        assert fused == 0 and "jagged_attention" not in jagged_ops(report), report
