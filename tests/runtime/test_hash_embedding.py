"""DynamicEmbedding: any int64 id gets its own row on first sight, rows survive key-table doubling
(values never move), evicted ids free their rows for reuse, unknown ids in eval give zeros, bad
ids raise with the feature's name; checked against a dict on random operation sequences."""
import pytest
import torch

from grcompile.runtime.hash_embedding import EMPTY, DynamicEmbedding


def test_matches_a_dict_through_growth_and_values_do_not_move():
    emb = DynamicEmbedding(4, name="item_id", capacity=8, block_rows=64)
    g = torch.Generator().manual_seed(0)
    reference: dict[int, int] = {}
    snapshots = {}
    for step in range(30):
        ids = torch.randint(0, 2**62, (50,), generator=g)
        ids[:20] = ids[:20] % 97  # many repeats across batches (and within one)
        rows = emb.rows_of(ids)
        for i, r in zip(ids.tolist(), rows.tolist()):
            assert reference.setdefault(i, r) == r, "an id changed rows"
        assert len(set(reference.values())) == len(reference), "two ids share a row"
        assert emb.size == len(reference) and emb.size <= emb.max_load * emb.capacity
        if step == 3:
            used = emb.next_row  # rows taken so far (later ids fill the rest of the last block)
            snapshots = {b: emb.blocks[b].detach().clone() for b in range(len(emb.blocks))}
            pointers = [p.data_ptr() for p in emb.blocks]
    assert emb.rehashes >= 3 and emb.capacity >= 2048
    for b, before in snapshots.items():  # the blocks that existed then: same storage, same values
        assert emb.blocks[b].data_ptr() == pointers[b]
        taken = max(0, min(emb.block_rows, used - b * emb.block_rows))
        torch.testing.assert_close(emb.blocks[b].detach()[:taken], before[:taken])
    all_ids = torch.tensor(list(reference))
    assert torch.equal(emb.rows_of(all_ids, insert=False), torch.tensor(list(reference.values())))


def test_values_gradients_and_fused_update():
    emb = DynamicEmbedding(3, capacity=4, block_rows=2)  # several blocks
    ids = torch.tensor([[5, 2**40, 5], [7, 9, 11]])
    out = emb(ids)
    rows = emb.rows_of(ids, insert=False).reshape(-1)
    blocks = torch.cat([b.detach() for b in emb.blocks])
    torch.testing.assert_close(out.reshape(-1, 3), blocks[rows])
    out.sum().backward()
    before = torch.cat([b.detach() for b in emb.blocks]).clone()
    emb.apply_gradients(lr=0.5)
    after = torch.cat([b.detach() for b in emb.blocks])
    counts = torch.bincount(rows, minlength=before.shape[0]).to(before.dtype)
    torch.testing.assert_close(after, before - 0.5 * counts[:, None].expand_as(before))


def test_eval_lookup_of_unknown_ids_gives_zeros_without_inserting():
    emb = DynamicEmbedding(2)
    emb(torch.tensor([1, 2]))
    emb.eval()
    out = emb(torch.tensor([2, 3]))
    assert emb.size == 2 and torch.equal(out[1], torch.zeros(2)) and out[0].abs().sum() > 0
    assert emb.rows_of(torch.tensor([3]), insert=False).item() == EMPTY


def test_evict_frees_rows_for_reuse():
    emb = DynamicEmbedding(2, capacity=16)
    emb(torch.tensor([10, 11, 12]))
    emb.tick()
    emb(torch.tensor([11]))
    old_rows = emb.rows_of(torch.tensor([10, 11, 12]), insert=False)
    assert emb.evict(lambda last_seen, counts: last_seen < emb.step) == 2  # 10 and 12
    assert emb.size == 1
    assert torch.equal(emb.rows_of(torch.tensor([10, 12]), insert=False), torch.tensor([EMPTY, EMPTY]))
    assert emb.rows_of(torch.tensor([11]), insert=False).item() == old_rows[1].item()
    new = emb.rows_of(torch.tensor([99, 98]))
    assert set(new.tolist()) == {old_rows[0].item(), old_rows[2].item()}  # freed rows reused


def test_bad_ids_name_the_feature():
    emb = DynamicEmbedding(2, name="action")
    with pytest.raises(ValueError, match="action: ids must be >= 0"):
        emb(torch.tensor([1, -2]))
    with pytest.raises(ValueError, match="action: ids must be an int64"):
        emb(torch.tensor([1.0]))


def test_new_rows_depend_on_the_id_only():
    """Initial values are a function of (seed, id): the same on any rank, in any insertion order."""
    a, b = DynamicEmbedding(6, seed=3), DynamicEmbedding(6, seed=3)
    ids = torch.tensor([5, 2**50 + 1, 77, 12])
    a(ids)
    b(ids.flip(0)[:2])
    b(ids)
    torch.testing.assert_close(a(ids), b(ids))
    assert not torch.equal(a(ids)[0], a(ids)[1])
    sample = DynamicEmbedding(64, init_std=1.0)(torch.arange(2000)).detach()
    assert abs(float(sample.mean())) < 0.02 and abs(float(sample.std()) - 1.0) < 0.02
