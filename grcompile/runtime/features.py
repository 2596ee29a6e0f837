"""Which of a model's embeddings are sparse features, and how they are grouped into tables.

Discovery (the embedding rewrite's match): every ``nn.Embedding`` with a ``padding_idx`` is a
sparse feature — the user marked its id space as padded sequences, exactly the lookups TurboGR
makes jagged. Embeddings without one (positions, buckets) are small dense parameters and stay
data-parallel. ``FeatureConfig`` entries override the rule per module (``sparse=False`` keeps one
dense, a module without padding can be named to shard it) and pick the table a feature goes to.

Grouping (MTGRBoost §4.2): features of equal embedding dimension and dtype are merged into one
table unless a config names another, so one sharded lookup serves several features. A static
table's ids must be dense row numbers, so a merged static table stacks its features' rows (feature
``f`` at row offset ``o_f``); the high-bit tag of eq. (8) (``ids.TableTags``) is what a dynamic
(hash) table uses instead, where ids are arbitrary int64 keys.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn as nn

from .ids import TableTags


@dataclass(frozen=True)
class FeatureConfig:
    """Control over one embedding module (``module``: its qualified name in the model)."""

    module: str
    sparse: bool = True
    table: Optional[str] = None  # merge group; default: one table per (dim, dtype)
    name: Optional[str] = None  # feature name in reports and errors; default: the module name
    dynamic: bool = False  # a hash table: any id >= 0, inserted on first sight (its weights are not kept)


@dataclass
class Feature:
    name: str
    module: str  # qualified module name in the model
    num_embeddings: int
    dim: int
    dtype: torch.dtype
    pad: Optional[int]
    table: str = ""
    offset: int = 0  # first row of this feature in its (static) table
    dynamic: bool = False


@dataclass
class TableSpec:
    name: str
    dim: int
    dtype: torch.dtype
    features: list[str] = field(default_factory=list)
    num_rows: int = 0  # static tables
    dynamic: bool = False
    tags: Optional[TableTags] = None  # dynamic tables: the feature tag in the id's high bits


@dataclass
class TablePlan:
    features: dict[str, Feature]
    tables: dict[str, TableSpec]

    def describe(self) -> str:
        lines = []
        for t in self.tables.values():
            if t.dynamic:
                lines.append(f"dynamic table {t.name}: hash table x {t.dim}, id tags ({t.tags.bits} high bits) <- "
                             + ", ".join(t.features))
                continue
            parts = ", ".join(f"{f} rows [{self.features[f].offset}, {self.features[f].offset + self.features[f].num_embeddings})"
                              for f in t.features)
            lines.append(f"table {t.name}: {t.num_rows} x {t.dim} {str(t.dtype).removeprefix('torch.')} <- {parts}")
        return "\n".join(lines)


def find_sparse_features(model: nn.Module, configs: Sequence[FeatureConfig] = ()) -> list[Feature]:
    by_module = {c.module: c for c in configs}
    modules = dict(model.named_modules())
    unknown = sorted(set(by_module) - set(modules))
    if unknown:
        raise ValueError(f"FeatureConfig names modules the model does not have: {unknown}")
    features = []
    for qualname, module in modules.items():
        config = by_module.get(qualname)
        if not isinstance(module, nn.Embedding):
            if config is not None:
                raise ValueError(f"FeatureConfig {qualname!r}: module is a {type(module).__name__}, not nn.Embedding")
            continue
        sparse = config.sparse if config is not None else module.padding_idx is not None
        if not sparse:
            continue
        if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
            raise ValueError(f"{qualname}: nn.Embedding options max_norm / sparse / scale_grad_by_freq are not "
                             f"supported by the sharded lookup; mark it FeatureConfig({qualname!r}, sparse=False)")
        name = (config.name if config is not None and config.name else qualname)
        table = config.table if config is not None and config.table else ""
        features.append(Feature(name=name, module=qualname, num_embeddings=module.num_embeddings,
                                dim=module.embedding_dim, dtype=module.weight.dtype, pad=module.padding_idx,
                                table=table, dynamic=config is not None and config.dynamic))
    names = [f.name for f in features]
    if len(set(names)) != len(names):
        raise ValueError(f"feature names repeat: {names}")
    return features


def plan_tables(features: Sequence[Feature]) -> TablePlan:
    """Merge features into tables: by explicit name, else by (dim, dtype); rows stacked in order."""
    tables: dict[str, TableSpec] = {}
    for f in features:
        if not f.table:
            f.table = f"{'dynamic' if f.dynamic else 'merged'}_{str(f.dtype).removeprefix('torch.')}_d{f.dim}"
        spec = tables.setdefault(f.table, TableSpec(f.table, f.dim, f.dtype, dynamic=f.dynamic))
        if (spec.dim, spec.dtype, spec.dynamic) != (f.dim, f.dtype, f.dynamic):
            raise ValueError(f"table {f.table!r}: feature {f.name!r} is {f.dim} x {f.dtype}"
                             f"{' dynamic' if f.dynamic else ''}, but the table holds {spec.dim} x {spec.dtype}"
                             f"{' dynamic' if spec.dynamic else ''} (merged features share dim, dtype and kind)")
        f.offset = spec.num_rows
        spec.num_rows += 0 if f.dynamic else f.num_embeddings
        spec.features.append(f.name)
    for spec in tables.values():
        if spec.dynamic:
            spec.tags = TableTags(spec.features)
    return TablePlan({f.name: f for f in features}, tables)


__all__ = ["Feature", "FeatureConfig", "TablePlan", "TableSpec", "find_sparse_features", "plan_tables"]
