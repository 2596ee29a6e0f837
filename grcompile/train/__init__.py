"""Training and evaluation of the naive padded models (``python -m grcompile.train``)."""
from .config import TrainConfig
from .loop import build, train
from .metrics import evaluate, metrics_from_ranks, target_ranks

__all__ = ["TrainConfig", "build", "evaluate", "metrics_from_ranks", "target_ranks", "train"]
