"""The sparse optimizer is the algorithm the user chose, on 1 and N ranks (issue 13).

* Root cause of the old Adagrad gap (one process vs 2 TorchRec ranks: 0.85 % after 20 steps in the
  issue, 2.8 % at step 20 on test_distributed's config; SGD agreed to 2e-7): TorchRec's fused optimizer runs inside each lookup's backward, and the retrieval
  task looks the item table up three times a step (history, targets, negatives). SGD is linear, so
  three partial updates add up to the step's; Adagrad's accumulator takes g1², then g2², ... instead
  of (g1+g2+g3)², and each partial step divides by a different root. Shown here on fbgemm's own
  kernel: one lookup a step equals the torch optimizers below to float32 rounding, two lookups a
  step do not. (The epsilons differ too — fbgemm 1e-8, torch.optim.Adagrad 1e-10 — which moved the
  20-step losses by 2e-6 only; every Adagrad of the tables now uses 1e-8.) So TorchRec-sharded
  tables train with SGD only; Adam, Adagrad and row-wise Adagrad run on the native backend, whose
  shards accumulate the step's gradient and are stepped once by the same torch optimizer as one process.
* Defaults never change the algorithm silently: the default is the dense optimizer's (Adam), SGD
  where Adam cannot run (TorchRec-sharded or dynamic tables) — logged, and recorded with its reason
  in the JSON config.
* Slow: 20 steps on 2 native gloo ranks equal one process for adam, adagrad and rowwise_adagrad
  (and rowwise_adagrad with a dynamic hash table): losses within 1e-5 relative, as SGD on TorchRec.
"""
import dataclasses
import json

import pytest
import torch

from grcompile.train.config import TrainConfig, resolve_sparse_optimizer
from grcompile.train.sparse_optim import ADAGRAD_EPS, RowWiseAdagrad
from tests.train.test_train import TINY

ROWS, DIM, LR = 12, 4, 0.1


def fbgemm_table(kind: str, weight: torch.Tensor):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (ComputeDevice,
                                                                        SplitTableBatchedEmbeddingBagsCodegen)

    optimizer = {"sgd": EmbOptimType.EXACT_SGD, "adagrad": EmbOptimType.EXACT_ADAGRAD,
                 "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}[kind]
    tbe = SplitTableBatchedEmbeddingBagsCodegen([(ROWS, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)],
                                                optimizer=optimizer, learning_rate=LR, eps=ADAGRAD_EPS,
                                                pooling_mode=PoolingMode.SUM)
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(weight)
    return tbe


def torch_optimizer(kind: str, param: torch.Tensor) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD([param], lr=LR)
    if kind == "adagrad":
        return torch.optim.Adagrad([param], lr=LR, eps=ADAGRAD_EPS)
    return RowWiseAdagrad([param], lr=LR)


def train_both(kind: str, lookups_per_step: int, steps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The same ids and output gradients through fbgemm's fused kernel (``lookups_per_step`` lookups
    a step, each fused-updating) and through the torch optimizer (one update of the step's sum)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(ROWS, DIM, generator=gen)
    tbe, param = fbgemm_table(kind, weight), weight.clone().requires_grad_(True)
    opt = torch_optimizer(kind, param)
    for _ in range(steps):
        ids = [torch.randint(1, 6, (5,), generator=gen) for _ in range(lookups_per_step)]  # repeats rows
        grads = [torch.randn(5, DIM, generator=gen) for _ in ids]
        loss = sum((tbe(i, torch.arange(i.numel() + 1)) * g).sum() for i, g in zip(ids, grads))
        loss.backward()
        opt.zero_grad()
        sum((param[i] * g).sum() for i, g in zip(ids, grads)).backward()
        opt.step()
    return tbe.split_embedding_weights()[0].detach(), param.detach()


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad"])
def test_torch_optimizers_equal_fbgemm_kernels_with_one_lookup_a_step(kind):
    fused, ours = train_both(kind, lookups_per_step=1)
    torch.testing.assert_close(fused, ours, rtol=1e-6, atol=1e-6)


def test_several_lookups_a_step_make_fused_adagrad_another_algorithm():
    """The root cause: per-lookup fused updates equal the step's update for SGD only."""
    fused, ours = train_both("sgd", lookups_per_step=3)
    torch.testing.assert_close(fused, ours, rtol=1e-6, atol=1e-6)
    for kind in ("adagrad", "rowwise_adagrad"):
        fused, ours = train_both(kind, lookups_per_step=3)
        assert (fused - ours).abs().max() > 1e-2


def test_rowwise_adagrad_by_hand():
    param = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    opt = RowWiseAdagrad([param], lr=0.5)
    param.grad = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    opt.step()
    # row 0: accumulator (9 + 16) / 2 = 12.5, step 0.5 / sqrt(12.5) * g; row 1: no gradient, unchanged
    expected = torch.tensor([[1.0, 2.0]]) - 0.5 / (12.5 ** 0.5 + ADAGRAD_EPS) * torch.tensor([[3.0, 4.0]])
    torch.testing.assert_close(param.detach()[0:1], expected)
    assert param.detach()[1].tolist() == [3.0, 4.0] and opt.state[param]["sum"].tolist() == [12.5, 0.0]
    with pytest.raises(ValueError, match="2-D"):
        RowWiseAdagrad([torch.zeros(3, requires_grad=True)], lr=0.1)


@pytest.mark.parametrize("changes, name, reason", [
    ({}, "adam", "dense optimizer"),
    ({"dense_optimizer": "sgd"}, "sgd", "dense optimizer"),
    ({"sharding": "row", "sparse_backend": "native"}, "adam", "dense optimizer"),
    ({"sharding": "auto"}, "sgd", "TorchRec"),
    ({"dynamic_features": ["encoder.category_embedding"]}, "sgd", "dynamic hash tables"),
    ({"sparse_optimizer": "adagrad"}, "adagrad", "chosen by the user"),
])
def test_the_default_and_why(changes, name, reason):
    config = resolve_sparse_optimizer(dataclasses.replace(TrainConfig(), **changes))
    assert config.sparse_optimizer == name and reason in config.sparse_optimizer_reason


@pytest.mark.parametrize("changes, message", [
    ({"sharding": "row", "sparse_optimizer": "adam"}, "no fused Adam"),
    ({"sharding": "row", "sparse_optimizer": "adagrad"}, "inside each lookup's backward"),
    ({"sharding": "table", "sparse_optimizer": "rowwise_adagrad"}, "inside each lookup's backward"),
    ({"dynamic_features": ["encoder.category_embedding"], "sparse_optimizer": "adagrad"}, "row-wise Adagrad"),
    ({"dynamic_features": ["encoder.category_embedding"], "sparse_optimizer": "adam"}, "have no Adam"),
    ({"dense_optimizer": "sgd", "sparse_optimizer": "adam"}, "needs dense_optimizer 'adam'"),
])
def test_combinations_that_would_train_differently_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        resolve_sparse_optimizer(dataclasses.replace(TrainConfig(), **changes))


def test_the_cli_logs_and_records_the_choice(tmp_path, capsys, monkeypatch):
    from grcompile.train.__main__ import config_from_args, main, parse_args

    main(TINY + ["--steps", "1", "--json", str(tmp_path / "r.json")])
    config = json.loads((tmp_path / "r.json").read_text())["config"]
    assert config["sparse_optimizer"] == "adam" and "dense optimizer" in config["sparse_optimizer_reason"]
    assert "sparse optimizer adam: default" in capsys.readouterr().out
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun: TorchRec sharding by default
    config = config_from_args(parse_args(TINY))
    assert config.sharding == "auto" and config.sparse_optimizer == "sgd" and "TorchRec" in config.sparse_optimizer_reason
    with pytest.raises(SystemExit, match="--sparse-optimizer adagrad: TorchRec applies"):
        config_from_args(parse_args(TINY + ["--sparse-optimizer", "adagrad"]))


@pytest.mark.slow
def test_two_native_ranks_equal_one_process_for_every_optimizer():
    from grcompile.train.loop import train
    from tests.train.test_distributed import BASE, run_ranks

    configs = {name: dataclasses.replace(BASE, sparse_optimizer=name) for name in ("adam", "adagrad", "rowwise_adagrad")}
    configs["rowwise_adagrad_dynamic"] = dataclasses.replace(configs["rowwise_adagrad"],
                                                             dynamic_features=["encoder.category_embedding"])
    jobs = [(key, dataclasses.replace(c, sharding="row", sparse_backend="native"), {}) for key, c in configs.items()]
    results = run_ranks(2, jobs)
    for key, config in configs.items():
        one = train(config, progress=False, log=lambda *a: None)
        torch.testing.assert_close(torch.tensor(results[key]["losses"], dtype=torch.float64),
                                   torch.tensor(one["losses"], dtype=torch.float64), rtol=1e-5, atol=0, msg=key)
