"""Everything that determines a training run (written into the JSON and the checkpoints), the
bounds every number must respect (one table: the CLI's argparse types and ``TrainConfig.validate``
read it, so a bad value fails the same way from the command line and from Python), and which sparse
optimizer runs when the user names none."""
from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

SPARSE_OPTIMIZERS = ("adam", "sgd", "adagrad", "rowwise_adagrad")


@dataclass(frozen=True)
class Bound:
    """``kind`` (int or float) with ``value >= low`` (``inclusive``) or ``value > low``; ``high``: an
    exclusive upper bound. A value of None always passes (the field's "not set")."""

    kind: type
    low: float
    inclusive: bool = True
    high: float | None = None

    def describe(self) -> str:
        noun = "an integer" if self.kind is int else "a number"
        text = f"{noun} {'>=' if self.inclusive else '>'} {self.low:g}"
        return text + (f" and < {self.high:g}" if self.high is not None else "")

    def holds(self, value: Any) -> bool:
        if value is None:
            return True
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind is int and not isinstance(value, int):
            return False
        if not math.isfinite(value):
            return False
        above = value >= self.low if self.inclusive else value > self.low
        return above and (self.high is None or value < self.high)


# Field (and CLI flag: field with '-' for '_') -> its bound. 0 for epochs / steps: evaluate only.
BOUNDS: dict[str, Bound] = {
    "epochs": Bound(int, 0), "steps": Bound(int, 0), "max_minutes": Bound(float, 0, inclusive=False),
    "batch_size": Bound(int, 1), "eval_batch_size": Bound(int, 1),
    "max_len": Bound(int, 2),  # one input position and its target at least
    "seed": Bound(int, 0),  # numpy's generators take non-negative seeds only
    "lr": Bound(float, 0, inclusive=False), "sparse_lr": Bound(float, 0, inclusive=False),
    "weight_decay": Bound(float, 0), "temperature": Bound(float, 0, inclusive=False),
    "num_negatives": Bound(int, 1),  # 0 negatives: a softmax over the positive alone, loss exactly 0
    "patience": Bound(int, 1), "eval_every": Bound(int, 1), "k_core": Bound(int, 0), "threads": Bound(int, 1),
    "hsp_group_size": Bound(int, 1), "checkpoint_every": Bound(int, 1), "micro_batches": Bound(int, 1),
    "token_budget": Bound(float, 0, inclusive=False), "bucket_mb": Bound(float, 0, inclusive=False),
    # model_overrides / synthetic entries
    "dropout": Bound(float, 0, high=1), "embedding_dim": Bound(int, 1), "num_blocks": Bound(int, 1),
    "num_categories": Bound(int, 0), "num_users": Bound(int, 1), "num_items": Bound(int, 1),
}


def argparse_type(name: str, bound: Bound | None = None) -> Callable[[str], Any]:
    """An argparse ``type=`` that parses the flag and checks ``BOUNDS[name]`` (argparse prefixes the
    flag: "argument --batch-size: must be an integer >= 1, got 0")."""
    bound = bound or BOUNDS[name]

    def parse(text: str) -> Any:
        try:
            value = bound.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {bound.describe()}, got {text!r}") from None
        if not bound.holds(value):
            raise argparse.ArgumentTypeError(f"must be {bound.describe()}, got {text}")
        return value

    parse.__name__ = bound.kind.__name__  # argparse names the type in its own messages
    return parse


@dataclass
class TrainConfig:
    model: str = "hstu"
    preset: str = "ml1m"
    data: str = "synthetic"
    compile: str = "eager"
    precision: str = "fp32"  # "bf16": training steps under torch.autocast(bfloat16); "fp8": also FP8 GEMMs (grcompile)
    epochs: int = 100
    steps: int | None = None  # stop after this many optimizer steps in total
    max_minutes: float | None = None
    batch_size: int = 128
    eval_batch_size: int = 256
    max_len: int | None = None  # None: the preset's
    seed: int = 0
    lr: float = 1e-3
    weight_decay: float = 0.0
    temperature: float = 0.05
    num_negatives: int = 128
    negatives: str = "per-position"  # or "per-row" (shared by a row's positions; cheaper)
    patience: int = 10  # epochs without a better validation NDCG@10 before stopping
    eval_every: int = 1
    k_core: int = 0
    threads: int | None = None
    # distributed (torchrun): None = one process; row | table | column | auto shards the sparse tables
    sharding: str | None = None
    sparse_backend: str = "torchrec"  # or "native" (row-wise on torch.distributed; HSP)
    dedup: str = "two_stage"  # none | comm | lookup | two_stage
    hsp_group_size: int | None = None  # hierarchical sparse parallelism (native backend)
    dense_optimizer: str = "adam"  # or "sgd"
    # adam (same as dense) | sgd | adagrad | rowwise_adagrad; None: the default of the setting
    # (``resolve_sparse_optimizer``), which also fills in ``sparse_optimizer_reason``
    sparse_optimizer: str | None = None
    sparse_optimizer_reason: str | None = None
    sparse_lr: float | None = None  # None: lr
    dynamic_features: list[str] = field(default_factory=list)  # embedding modules made hash tables
    checkpoint_every: int | None = None  # steps between checkpoints (besides every epoch's end)
    pipeline: str = "sync"  # sync | fwp | dbp | dbp+fwp: same training; semi-async | six-stage: stale (train/pipeline.py)
    micro_batches: int = 4  # fwp: micro-batches per step
    balance: str = "equal"  # rows to ranks: equal slices | tokens | cost (data/balance.py)
    token_budget: float | None = None  # tokens per rank and step: batches cut by it, not batch_size (token_batching.py)
    lbsl: bool = False  # ULTRA-HSTU's load-balanced stochastic length: cuts long sequences (stochastic_length.py)
    # the dense gradient all-reduce in buckets during the last backward (grad_sync.py); same sums
    overlap_allreduce: bool = False
    bucket_mb: float = 25.0  # its bucket size cap
    synthetic: dict[str, Any] = field(default_factory=dict)  # SyntheticConfig overrides
    model_overrides: dict[str, Any] = field(default_factory=dict)  # ModelConfig overrides

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field outside its bound (``BOUNDS``)."""
        values = {**{k: getattr(self, k) for k in BOUNDS if hasattr(self, k)}, **self.synthetic,
                  **self.model_overrides}
        for name, value in values.items():
            bound = BOUNDS.get(name)
            if bound is not None and not bound.holds(value):
                raise ValueError(f"TrainConfig.{name} must be {bound.describe()}, got {value!r}")
        if self.negatives not in ("per-position", "per-row"):
            raise ValueError(f"TrainConfig.negatives must be 'per-position' or 'per-row', got {self.negatives!r}")
        if self.dense_optimizer not in ("adam", "sgd"):
            raise ValueError(f"TrainConfig.dense_optimizer must be 'adam' or 'sgd', got {self.dense_optimizer!r}")
        if self.sparse_optimizer is not None and self.sparse_optimizer not in SPARSE_OPTIMIZERS:
            raise ValueError(f"TrainConfig.sparse_optimizer must be one of {SPARSE_OPTIMIZERS} (or None: the "
                             f"setting's default), got {self.sparse_optimizer!r}")
        if self.pipeline not in ("sync", "fwp", "dbp", "dbp+fwp", "semi-async", "six-stage"):
            raise ValueError(f"TrainConfig.pipeline must be sync, fwp, dbp, dbp+fwp, semi-async or six-stage, "
                             f"got {self.pipeline!r}")
        if self.balance not in ("equal", "tokens", "cost"):
            raise ValueError(f"TrainConfig.balance must be equal, tokens or cost, got {self.balance!r}")
        if self.precision not in ("fp32", "bf16", "fp8"):
            raise ValueError(f"TrainConfig.precision must be fp32, bf16 or fp8, got {self.precision!r}")
        if self.precision == "fp8" and self.compile != "grcompile":
            raise ValueError("TrainConfig.precision 'fp8' is a grcompile rewrite: it needs compile 'grcompile' "
                             f"(got {self.compile!r})")
        if self.token_budget is not None and self.lbsl:
            raise ValueError("TrainConfig.lbsl cuts the rows of a global batch; token_budget has none (not combined)")
        if self.token_budget is not None and (self.pipeline != "sync" or self.balance != "equal"):
            raise ValueError("TrainConfig.token_budget cuts every rank's batch itself: it goes with pipeline 'sync' "
                             "and balance 'equal' (not combined yet)")


# -- the sparse optimizer: the default of each setting, and the combinations that are refused -------
def _torchrec_sharded(config: TrainConfig) -> bool:
    return config.sharding is not None and config.sparse_backend == "torchrec"


def sparse_optimizer_problem(config: TrainConfig, name: str) -> str | None:
    """Why ``name`` cannot train the sparse tables of ``config`` as it trains them in one process
    (None: it can). Every optimizer that passes gives the same training on 1 and N ranks (tested)."""
    if name == "adam" and config.dense_optimizer != "adam":
        return "sparse optimizer 'adam' is the dense Adam stepping the tables too: it needs dense_optimizer 'adam'"
    if config.dynamic_features and name == "adam":
        return ("dynamic hash tables have no Adam (their fused update is SGD or row-wise Adagrad): "
                "choose --sparse-optimizer sgd or rowwise_adagrad")
    if config.dynamic_features and name == "adagrad":
        return ("dynamic hash tables step row-wise Adagrad (one accumulator per row, the mean of g^2), not "
                "element-wise Adagrad: choose --sparse-optimizer rowwise_adagrad (or sgd)")
    if _torchrec_sharded(config) and name == "adam":
        return ("TorchRec's CPU kernels have no fused Adam: use --sparse-backend native (its shards are stepped "
                "by the same torch Adam as one process) or --sparse-optimizer sgd")
    if _torchrec_sharded(config) and name in ("adagrad", "rowwise_adagrad"):
        return (f"TorchRec applies its fused {name} inside each lookup's backward, and the retrieval task looks "
                f"the item table up several times a step (history, targets, negatives): the accumulator would "
                f"take each lookup's partial gradient in turn instead of the step's gradient, which is not "
                f"{name}. Use --sparse-backend native (same update as "
                f"one process) or --sparse-optimizer sgd (linear: per-lookup updates add up to the step's)")
    return None


def resolve_sparse_optimizer(config: TrainConfig) -> TrainConfig:
    """Fill in ``sparse_optimizer`` where it is None (the setting's default) and
    ``sparse_optimizer_reason`` (why this optimizer: the user's choice, or which default and why);
    raise ``ValueError`` for a combination that would train differently from one process."""
    from dataclasses import replace

    if config.sparse_optimizer is not None:
        name = config.sparse_optimizer
        reason = config.sparse_optimizer_reason or "chosen by the user (--sparse-optimizer)"
    elif config.dynamic_features:
        name = "sgd"
        reason = "default with dynamic hash tables, which have no Adam (one process without them: Adam)"
    elif _torchrec_sharded(config):
        name = "sgd"
        reason = ("default on TorchRec-sharded tables: its CPU kernels have no fused Adam and its fused Adagrads "
                  "step per lookup, so SGD is the one algorithm it runs as one process does; one process "
                  "defaults to Adam (--sparse-backend native keeps Adam)")
    else:
        name = config.dense_optimizer
        reason = "default: the dense optimizer steps the sparse tables too"
    if name not in SPARSE_OPTIMIZERS:
        raise ValueError(f"sparse optimizer must be one of {SPARSE_OPTIMIZERS}, got {name!r}")
    problem = sparse_optimizer_problem(config, name)
    if problem is not None:
        raise ValueError(f"--sparse-optimizer {name}: {problem}")
    return replace(config, sparse_optimizer=name, sparse_optimizer_reason=reason)
