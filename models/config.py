"""Model configuration shared by the naive padded reference models."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class ModelConfig:
    model: str  # "hstu" | "fuxi" | "sasrec"
    num_items: int
    max_len: int
    embedding_dim: int
    num_blocks: int
    num_heads: int
    attention_dim: int  # q/k width per head (dqk)
    linear_dim: int  # v/u width per head (dv)
    dropout: float
    num_time_buckets: int = 128  # time table holds num_time_buckets + 1 weights
    ffn_dim: int = 0  # FuXi SwiGLU / SASRec FFN hidden width; 0 = embedding_dim
    pad_id: int = 0
    num_categories: int = 0  # > 0: a second sparse feature, the item's category (side information)
    checkpoint_blocks: bool = False  # training runs each block under torch.utils.checkpoint

    def __post_init__(self) -> None:
        if self.ffn_dim == 0:
            self.ffn_dim = self.embedding_dim
        for name in ("num_items", "max_len", "embedding_dim", "num_blocks", "num_heads",
                     "attention_dim", "linear_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelConfig.dropout must be in [0, 1), got {self.dropout}")

    def to_dict(self) -> dict:
        return asdict(self)
