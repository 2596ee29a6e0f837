"""Distributed embedding runtime (issue 4, in progress): merged-table id tags and row-wise sharded
lookups with two-stage ID deduplication on torch.distributed (gloo on CPU)."""
from .dedup import DEDUP_MODES, LookupStats, ShardedEmbedding
from .ids import TableTags, tag_bits

__all__ = ["DEDUP_MODES", "LookupStats", "ShardedEmbedding", "TableTags", "tag_bits"]
