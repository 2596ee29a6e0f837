"""Dynamic hash tables train in a plain ``loss.backward(); opt.step()`` loop — the README's — with
nothing else to call, eagerly and through ``grcompile.optimize``; the update is exactly the
fused row-wise rule, applied once per backward pass; forwards whose backward never comes do not
hold their lookup graphs forever."""
import copy
import warnings

import pytest
import torch

import grcompile
from grcompile.runtime import FeatureConfig, shard_embeddings, sparse_runtime
from tests.runtime.test_embedding_rewrite import length_mix, make_task

LR = 0.1


def hash_rows(runtime) -> torch.Tensor:
    (table,) = runtime.dynamic.tables.values()
    return torch.cat([b.detach().clone() for b in table.blocks])


def dynamic_task(optimizer: str = "sgd"):
    task = make_task()
    features = [FeatureConfig("encoder.category_embedding", dynamic=True)]
    return task, features, {"type": optimizer, "lr": LR}


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_readme_loop_trains_the_hash_table_exactly_once_per_backward(optimizer):
    """The user's loop vs the same steps with the update applied by hand from the gradients."""
    task, features, fused = dynamic_task(optimizer)
    runtime = shard_embeddings(task, features=features, fused_optimizer=fused)
    reference_task, _, _ = dynamic_task(optimizer)
    reference = shard_embeddings(reference_task, features=features, fused_optimizer=fused)
    reference._queue_end_of_backward = lambda: None  # the reference applies it explicitly below
    opt = torch.optim.SGD([p for n, p in task.named_parameters() if "dynamic" not in n], lr=LR)
    ref_opt = torch.optim.SGD([p for n, p in reference_task.named_parameters() if "dynamic" not in n], lr=LR)
    for step in range(3):
        ids, ts, negatives = length_mix(step)
        opt.zero_grad()
        loss = task(ids, ts, negatives)
        before = hash_rows(runtime)  # after the forward: this batch's new ids are in
        loss.backward()
        opt.step()
        assert not torch.equal(before, hash_rows(runtime))
        ref_opt.zero_grad()
        reference_task(ids, ts, negatives).backward()
        assert reference._dynamic_grads_pending
        reference.after_backward()
        ref_opt.step()
        torch.testing.assert_close(hash_rows(runtime), hash_rows(reference), rtol=0, atol=0)
    assert runtime.in_flight() == 0


def test_optimized_model_trains_the_hash_table_in_the_readme_loop():
    task, features, fused = dynamic_task()
    eager_task = copy.deepcopy(task)
    eager_runtime = shard_embeddings(eager_task, features=features, fused_optimizer=fused)
    fast = grcompile.optimize(task, sparse={"backend": "local", "features": features, "fused_optimizer": fused})
    runtime = sparse_runtime(fast)
    assert runtime is task.encoder.category_embedding.runtime
    for step in range(2):
        ids, ts, negatives = length_mix(10 + step)
        fast(ids, ts, negatives).backward()
        eager_task(ids, ts, negatives).backward()
        torch.testing.assert_close(hash_rows(runtime), hash_rows(eager_runtime))
    assert runtime.in_flight() == 0


def test_forwards_without_backward_do_not_accumulate_lookup_graphs():
    task, features, fused = dynamic_task()
    runtime = shard_embeddings(task, features=features, fused_optimizer=fused, max_in_flight=4)
    ids, ts, negatives = length_mix(0)
    with pytest.warns(UserWarning, match="more than 4 lookups waiting for a backward.*torch.no_grad"):
        for _ in range(10):
            task(ids, ts, negatives)  # training mode, gradients on, loss dropped
    assert runtime.in_flight() <= 2 * 4  # two features (item, category), each bounded
    assert runtime.dropped_lookups > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        task(ids, ts, negatives).backward()  # the newest lookups are still there: trains normally
    with pytest.raises(ValueError, match="max_in_flight"):
        shard_embeddings(make_task(), features=features, max_in_flight=0)


def test_lookups_of_dropped_losses_are_released_by_the_next_backward_and_summed_losses_work():
    task, features, fused = dynamic_task()
    runtime = shard_embeddings(task, features=features, fused_optimizer=fused)
    batches = [length_mix(20 + k) for k in range(12)]
    # twelve forwards summed into one backward (40+ lookups in flight): all of them consumed
    sum(task(*b) for b in batches).backward()
    assert runtime.in_flight() == 0 and runtime.dropped_lookups == 0
    # a forward whose loss is dropped (metrics in training mode), then an ordinary step
    task(*batches[0])
    assert runtime.in_flight() > 0
    task(*batches[1]).backward()
    assert runtime.in_flight() == 0  # the dropped forward's lookups were released at the pass's end
    # backward passes in the order of the forwards, each one's lookups still there
    a, b = task(*batches[2]), task(*batches[3])
    a.backward()
    b.backward()
    assert runtime.in_flight() == 0
