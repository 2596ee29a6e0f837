"""Distributed embedding runtime (issue 4, in progress): merged-table id tags, row-wise sharded
lookups with two-stage ID deduplication on torch.distributed (gloo on CPU), and a dynamic
hash-table embedding."""
from .dedup import DEDUP_MODES, LookupStats, ShardedEmbedding
from .hash_embedding import DynamicEmbedding
from .ids import TableTags, tag_bits

__all__ = ["DEDUP_MODES", "DynamicEmbedding", "LookupStats", "ShardedEmbedding", "TableTags", "tag_bits"]
