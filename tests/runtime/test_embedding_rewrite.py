"""The embedding rewrite in one process: which modules become sparse features, how they are merged
into tables, and that the rewritten model computes the original's values and gradients — eagerly
and compiled by grcompile, where the lookup stays inside the one graph and receives packed ids."""
import copy

import pytest
import torch
import torch.nn as nn

import grcompile
from grcompile.runtime import FeatureConfig, SparseFeature, shard_embeddings
from grcompile.runtime.sparse import TABLES_ATTR
from models import SampledSoftmaxRetrieval, build_encoder

V, N = 40, 12


def make_task(model="hstu", **overrides):
    torch.manual_seed(0)
    cfg = dict(max_len=N, num_blocks=1, dropout=0.0, embedding_dim=16, attention_dim=8, linear_dim=8, num_categories=5)
    cfg.update(overrides)
    return SampledSoftmaxRetrieval(build_encoder(model, "ml1m", V, **cfg)).double()


def length_mix(seed: int, B: int = 6):
    """Rows of length N (full), 0 (empty), 1, and random; right padding."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([N, 0, 1, *torch.randint(0, N + 1, (B - 3,), generator=g).tolist()])
    ids = torch.randint(1, V + 1, (B, N), generator=g)
    ids = ids * (torch.arange(N) < lengths[:, None])
    ts = torch.cumsum(torch.randint(1, 10_000, (B, N), generator=g), 1)
    negatives = torch.randint(1, V + 1, (B, 7), generator=g)
    return ids, ts, negatives


def test_features_found_and_merged_by_dim():
    task = make_task()
    runtime = shard_embeddings(task)
    plan = runtime.plan
    assert list(plan.features) == ["encoder.item_embedding", "encoder.category_embedding"]
    assert len(plan.tables) == 1  # equal dim and dtype: one merged table
    (table,) = plan.tables.values()
    assert table.num_rows == (V + 1) + 6 and plan.features["encoder.category_embedding"].offset == V + 1
    assert isinstance(task.encoder.item_embedding, SparseFeature)
    assert isinstance(task.encoder.position_embedding, nn.Embedding)  # no padding_idx: dense


def test_feature_config_overrides():
    task = make_task()
    runtime = shard_embeddings(task, features=[
        FeatureConfig("encoder.category_embedding", table="side", name="category"),
        FeatureConfig("encoder.position_embedding", sparse=True, name="position")])
    assert set(runtime.plan.tables) == {"side", "merged_float64_d16"}
    assert runtime.plan.tables["merged_float64_d16"].features == ["encoder.item_embedding", "position"]
    kept_dense = make_task()
    shard_embeddings(kept_dense, features=[FeatureConfig("encoder.category_embedding", sparse=False)])
    assert isinstance(kept_dense.encoder.category_embedding, nn.Embedding)
    with pytest.raises(ValueError, match="does not have"):
        shard_embeddings(make_task(), features=[FeatureConfig("encoder.nope")])
    with pytest.raises(ValueError, match="not nn.Embedding"):
        shard_embeddings(make_task(), features=[FeatureConfig("encoder.blocks.0.uvqk")])


def test_merged_table_needs_equal_dims():
    class TwoDims(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Embedding(5, 4, padding_idx=0)
            self.b = nn.Embedding(5, 8, padding_idx=0)

    runtime = shard_embeddings(TwoDims())
    assert len(runtime.plan.tables) == 2
    with pytest.raises(ValueError, match="share dim, dtype and kind"):
        shard_embeddings(TwoDims(), features=[FeatureConfig("a", table="t"), FeatureConfig("b", table="t")])


@pytest.mark.parametrize("model", ["hstu", "sasrec"])
@pytest.mark.parametrize("dedup", ["none", "two_stage"])
def test_rewritten_equals_original_values_and_gradients(model, dedup):
    reference = make_task(model)
    task = copy.deepcopy(reference)
    runtime = shard_embeddings(task, dedup=dedup)
    modules = dict(reference.named_modules())
    for seed in range(3):
        ids, ts, negatives = length_mix(seed)
        for per_position in (False, True):
            neg = torch.randint(1, V + 1, (ids.shape[0], N, 5)) if per_position else negatives
            expected = reference(ids, ts, neg)
            got = task(ids, ts, neg)
            torch.testing.assert_close(got, expected)
            expected.backward()
            got.backward()
            for name, feature in runtime.plan.features.items():
                grad = getattr(task, TABLES_ATTR).weights[feature.table].grad
                rows = grad[feature.offset:feature.offset + feature.num_embeddings]
                torch.testing.assert_close(rows, modules[feature.module].weight.grad, msg=name)
            dense = {n: p for n, p in reference.named_parameters() if "item_embedding" not in n and "category" not in n}
            for n, p in task.named_parameters():
                if n in dense:
                    torch.testing.assert_close(p.grad, dense[n].grad, msg=n)
            assert runtime.in_flight() == 0  # every kept lookup graph was consumed by its backward
            task.zero_grad()
            reference.zero_grad()


def test_grcompile_keeps_one_graph_and_packs_ids_before_the_lookup():
    reference = make_task()
    task = copy.deepcopy(reference)
    shard_embeddings(task)
    compiled = grcompile.optimize(task)
    for seed in range(2):
        ids, ts, negatives = length_mix(10 + seed)
        got, expected = compiled(ids, ts, negatives), reference(ids, ts, negatives)
        torch.testing.assert_close(got, expected)
        got.backward()
        expected.backward()
        table = getattr(task, TABLES_ATTR).weights["merged_float64_d16"]
        torch.testing.assert_close(table.grad[:V + 1], reference.encoder.item_embedding.weight.grad)
        task.zero_grad()
        reference.zero_grad()
    report = grcompile.report(compiled)
    assert report.graph_breaks == 0 and not report.fallbacks
    assert report.counters["jagged_rewrite.embedding"] >= 2  # item and category lookups on packed ids
    assert report.counters["fuse_attention.score_mod_attention"] == 1


def test_optimize_with_sparse_option_rewrites_then_compiles():
    reference = make_task()
    task = copy.deepcopy(reference)
    compiled = grcompile.optimize(task, sparse={"backend": "local", "dedup": "comm"})
    assert isinstance(task.encoder.item_embedding, SparseFeature)
    ids, ts, negatives = length_mix(5)
    torch.testing.assert_close(compiled(ids, ts, negatives), reference(ids, ts, negatives))
    report = grcompile.report(compiled)
    assert "sparse: local sparse runtime (dedup comm): table merged_float64_d16" in str(report)
    assert report.counters["sparse.features"] == 2 and report.counters["sparse.tables"] == 1
    with pytest.raises(TypeError, match="sparse must be a dict"):
        grcompile.optimize(make_task(), sparse="row")


def test_bad_ids_name_the_feature():
    task = make_task()
    shard_embeddings(task)
    ids, ts, negatives = length_mix(0)
    bad_cases = [(ids.clone().fill_(V + 1), r"encoder.item_embedding.*\[0, 41\)"),
                 (ids.clone().fill_(-1), r"encoder.item_embedding.*got values in \[-1"),
                 (ids.float(), "encoder.item_embedding.*int64")]
    for bad, message in bad_cases:
        with pytest.raises(ValueError, match=message):
            task.encoder.item_embedding(bad)


def test_no_sparse_feature_is_an_error():
    with pytest.raises(ValueError, match="no sparse feature"):
        shard_embeddings(nn.Sequential(nn.Linear(3, 3)))


def test_dynamic_feature_is_a_hash_table_with_tagged_ids():
    task = make_task()
    runtime = shard_embeddings(task, features=[FeatureConfig("encoder.category_embedding", dynamic=True),
                                               FeatureConfig("encoder.item_embedding", dynamic=True)],
                               fused_optimizer={"type": "sgd", "lr": 0.1})
    (table,) = runtime.plan.tables.values()
    assert table.dynamic and table.tags.features == ["encoder.item_embedding", "encoder.category_embedding"]
    hash_table = runtime.dynamic.tables[table.name]
    ids, ts, negatives = length_mix(3)
    loss = task(ids, ts, negatives)
    assert torch.isfinite(loss)
    # every distinct valid item id and category got its own row; the two features never share one
    items = ids[ids != 0].unique()
    categories = task.encoder.item_category[items].unique()
    assert hash_table.size >= len(items) + len(categories)
    tagged = torch.cat([table.tags.tag("encoder.item_embedding", items),
                        table.tags.tag("encoder.category_embedding", categories)])
    rows = hash_table.rows_of(tagged, insert=False)
    assert (rows >= 0).all() and rows.unique().numel() == rows.numel()
    before = torch.cat([b.detach().clone() for b in hash_table.blocks])
    loss.backward()  # the fused SGD update of the touched rows runs when the backward pass ends
    after = torch.cat([b.detach().clone() for b in hash_table.blocks])
    assert not torch.equal(before, after)
    runtime.after_backward()  # the training loop's explicit call: nothing left to apply
    assert torch.equal(after, torch.cat([b.detach() for b in hash_table.blocks]))
    # ids beyond the static table are fine for a dynamic feature; negative ids are not
    big = torch.full((1, N), 10**12)
    assert task.encoder.item_embedding(big).shape == (1, N, 16)
    with pytest.raises(ValueError, match="encoder.item_embedding.*negative"):
        task.encoder.item_embedding(torch.full((1, 2), -5))
