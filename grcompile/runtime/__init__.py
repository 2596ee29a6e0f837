"""Distributed embedding runtime: the embedding rewrite (padded ``nn.Embedding`` → sharded jagged
lookups over merged tables, ``sparse.py``), TorchRec / native / local table backends, two-stage ID
dedup, hierarchical sparse parallelism, dynamic hash-table embeddings, merged-table id tags."""
from .dedup import DEDUP_MODES, LookupStats, ShardedEmbedding
from .features import FeatureConfig, TablePlan, find_sparse_features, plan_tables
from .hash_embedding import DynamicEmbedding
from .ids import TableTags, tag_bits
from .sparse import SparseFeature, SparseRuntime, dense_parameters, shard_embeddings, sparse_runtime

__all__ = ["DEDUP_MODES", "DynamicEmbedding", "FeatureConfig", "LookupStats", "ShardedEmbedding", "SparseFeature",
           "SparseRuntime", "TablePlan", "TableTags", "dense_parameters", "find_sparse_features", "plan_tables",
           "shard_embeddings", "sparse_runtime", "tag_bits"]
