"""The naive padded models: shapes, masking, presets, loss."""
from __future__ import annotations

import pytest
import torch

from models import PRESETS, SampledSoftmaxRetrieval, build_encoder, make_config

MODELS = ["hstu", "fuxi", "sasrec"]
TINY = dict(embedding_dim=16, num_blocks=2, num_heads=2, attention_dim=8, linear_dim=8, dropout=0.0)


def random_batch(B: int, N: int, num_items: int, lengths: list[int], side: str = "right", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths_t = torch.tensor(lengths)
    positions = torch.arange(N).unsqueeze(0)
    valid = positions < lengths_t.unsqueeze(1) if side == "right" else positions >= N - lengths_t.unsqueeze(1)
    ids = torch.randint(1, num_items + 1, (B, N), generator=g) * valid
    ts = torch.cumsum(torch.randint(1, 5000, (B, N), generator=g), dim=1) * valid
    return ids, ts, valid


@pytest.mark.parametrize("model", MODELS)
def test_shapes_and_normalisation(model: str) -> None:
    torch.manual_seed(0)
    enc = build_encoder(model, "ml1m", num_items=50, max_len=12, **TINY)
    ids, ts, valid = random_batch(4, 12, 50, [0, 1, 7, 12])
    out = enc(ids, ts)
    assert out.shape == (4, 12, 16)
    norms = out.norm(dim=-1)
    torch.testing.assert_close(norms[valid], torch.ones(int(valid.sum())))
    assert torch.all(out[~valid] == 0)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("model", MODELS)
def test_valid_outputs_ignore_padded_content(model: str, side: str) -> None:
    """Whatever sits in padded slots (timestamps, garbage ids mapped to padding) must not move a
    valid output: the property the compiler's padding analysis relies on."""
    torch.manual_seed(0)
    enc = build_encoder(model, "ml1m", num_items=50, max_len=10, **TINY).eval()
    ids, ts, valid = random_batch(5, 10, 50, [0, 1, 4, 9, 10], side=side)
    noisy_ts = torch.where(valid, ts, torch.randint(-10**9, 10**9, ts.shape))
    out, noisy = enc(ids, ts), enc(ids, noisy_ts)
    torch.testing.assert_close(out[valid], noisy[valid])
    assert torch.isfinite(out).all() and torch.isfinite(noisy).all()


@pytest.mark.parametrize("model", MODELS)
def test_causal(model: str) -> None:
    """Changing a later item never changes an earlier output."""
    torch.manual_seed(0)
    enc = build_encoder(model, "ml1m", num_items=50, max_len=8, **TINY).eval()
    ids, ts, _ = random_batch(2, 8, 50, [8, 8])
    changed = ids.clone()
    changed[:, 6] = (changed[:, 6] % 50) + 1
    a, b = enc(ids, ts), enc(changed, ts)
    # position 5's query timestamp is t[6], unchanged here; ids after 5 must not matter
    torch.testing.assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6], b[:, 6])


@pytest.mark.parametrize("model", MODELS)
def test_training_step_has_finite_grads(model: str) -> None:
    torch.manual_seed(0)
    enc = build_encoder(model, "ml1m", num_items=50, max_len=12, **TINY)
    task = SampledSoftmaxRetrieval(enc)
    ids, ts, _ = random_batch(4, 12, 50, [0, 1, 6, 12])
    loss = task(ids, ts, torch.randint(1, 51, (4, 7)))
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in task.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_loss_matches_per_position_reference() -> None:
    """The shared-negative bmm loss equals a plain per-position loop over valid positions."""
    torch.manual_seed(0)
    enc = build_encoder("sasrec", "ml1m", num_items=20, max_len=6, **TINY).eval()
    task = SampledSoftmaxRetrieval(enc, temperature=0.1)
    ids, ts, _ = random_batch(3, 6, 20, [0, 3, 6])
    negatives = torch.randint(1, 21, (3, 5))
    negatives[1, 0] = ids[1, 1]  # a negative equal to the positive of (row 1, position 0)
    user = enc(ids, ts)
    losses = []
    for b in range(3):
        for i in range(5):
            if ids[b, i] == 0 or ids[b, i + 1] == 0:
                continue
            cands = [ids[b, i + 1]] + [n for n in negatives[b] if n != ids[b, i + 1]]
            logits = enc.item_embeddings(torch.stack(cands)) @ user[b, i] / 0.1
            losses.append(-torch.log_softmax(logits, 0)[0])
    torch.testing.assert_close(task(ids, ts, negatives), torch.stack(losses).mean())


def test_empty_batch_loss_is_zero_not_nan() -> None:
    enc = build_encoder("hstu", "ml1m", num_items=20, max_len=6, **TINY)
    ids = torch.zeros(2, 6, dtype=torch.long)
    loss = SampledSoftmaxRetrieval(enc)(ids, ids, torch.randint(1, 21, (2, 3)))
    assert loss.item() == 0.0


@pytest.mark.parametrize("model", MODELS)
def test_presets(model: str) -> None:
    assert {"ml1m", "ml1m-large", "tiny", "small", "medium", "large", "long"} <= set(PRESETS[model])
    small = make_config(model, "small", num_items=10)
    assert (small.embedding_dim, small.num_blocks, small.num_heads, small.attention_dim) == (256, 4, 8, 32)
    assert make_config(model, "long", num_items=10).max_len == 4096
    large = make_config(model, "ml1m-large", num_items=10)
    assert (large.num_blocks, large.num_heads, large.attention_dim, large.embedding_dim) == (8, 2, 25, 50)
    with pytest.raises(ValueError, match="preset"):
        make_config(model, "huge", num_items=10)


def test_per_position_negatives_match_naive_gather():
    """[B, N, R] negatives scored via the whole table equal the naive [B, N, R, D] formulation."""
    import torch.nn.functional as F
    from models import SampledSoftmaxRetrieval, build_encoder

    torch.manual_seed(0)
    enc = build_encoder("sasrec", "ml1m", num_items=30, max_len=8, dropout=0.0).double()
    task = SampledSoftmaxRetrieval(enc, temperature=0.05)
    ids = torch.randint(1, 31, (3, 8))
    ids[1, 5:] = 0
    ts = torch.zeros_like(ids)
    neg = torch.randint(1, 31, (3, 8, 6))
    loss = task(ids, ts, neg)
    user = enc(ids, ts)[:, :-1]
    targets, n = ids[:, 1:], neg[:, :-1]
    pos = (user * enc.item_embeddings(targets)).sum(-1, keepdim=True)
    negl = (user.unsqueeze(2) * enc.item_embeddings(n)).sum(-1).masked_fill(n == targets.unsqueeze(2), float("-inf"))
    per = -F.log_softmax(torch.cat([pos, negl], -1) / 0.05, -1)[..., 0]
    valid = (ids[:, :-1] != 0) & (targets != 0)
    torch.testing.assert_close(loss, (per * valid).sum() / valid.sum())


@pytest.mark.parametrize("model", ["hstu", "fuxi", "sasrec"])
def test_checkpoint_blocks_changes_no_value(model: str) -> None:
    """``checkpoint_blocks``: the same outputs and gradients (dropout on, same seed: the
    checkpoint replays the draws), in training only."""
    results = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        encoder = build_encoder(model, "ml1m", 30, max_len=12, dropout=0.2, checkpoint_blocks=checkpointed).train()
        ids = torch.randint(1, 31, (3, 12))
        ids[0, 5:] = 0
        timestamps = torch.cumsum(torch.randint(0, 50, (3, 12)), 1) * (ids != 0)
        torch.manual_seed(1)
        out = encoder(ids, timestamps)
        out.pow(2).sum().backward()
        results.append((out.detach(), {n: p.grad for n, p in encoder.named_parameters() if p.grad is not None}))
    (out, grads), (out_ck, grads_ck) = results
    torch.testing.assert_close(out_ck, out)
    assert grads_ck.keys() == grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(grads_ck[name], g, msg=lambda s: f"{name}: {s}")
