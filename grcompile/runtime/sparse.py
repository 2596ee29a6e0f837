"""The embedding rewrite and the sparse runtime behind it.

``shard_embeddings(model, ...)`` finds the model's sparse features (``features.py``: every
``nn.Embedding`` with a ``padding_idx``, or as configured), merges them into tables, moves their
weights into a table backend, and replaces each module by a ``SparseFeature`` that calls
``grcompile::sparse_lookup`` (``lookup_op.py``). The model's code is untouched; it still calls
``self.item_embedding(ids)`` on padded ``[B, N]`` ids.

Per lookup the runtime (``SparseRuntime.forward``):
  1. checks the ids (dtype, range) — on this rank, before any collective, naming the feature;
  2. keeps the valid ids only (``ids != padding_idx``: no work and no bytes for padding);
  3. stage-1 dedup (``comm`` / ``two_stage``): ``unique`` before anything leaves the rank;
  4. looks the rows up in the backend (offset into the merged table) — the backend does the
     id all-to-all, stage-2 dedup on the owner (``lookup`` / ``two_stage``), the embedding
     all-to-all;
  5. re-expands and scatters into ``[*ids.shape, D]`` with the original padding row at padding.
The lookup's autograd graph is kept until ``backward(feature, ids, grad)`` runs it (at most
``max_in_flight`` per feature); dynamic tables apply their fused update when that backward pass ends.

Backends (``Tables``): ``LocalTables`` (one process, plain parameters), ``NativeTables``
(row-wise ``ShardedEmbedding`` / ``HSPEmbedding`` on torch.distributed; dense-gradient shards, any
torch optimizer), ``TorchRecTables`` (``torchrec_tables.py``: DistributedModelParallel
EmbeddingCollection, planner sharding, fused optimizer).
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import math
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .dedup import DEDUP_MODES, LookupStats, ShardedEmbedding
from .features import FeatureConfig, TablePlan, find_sparse_features, plan_tables
from .ids import require_int_ids
from .lookup_op import register_runtime

MAX_IN_FLIGHT = 256  # lookup graphs kept per feature for a backward that has not come (a backstop)


class Tables(nn.Module):
    """A backend: ``lookup(table, rows [n]) -> [n, D]`` differentiable into the table's storage."""

    stage2: bool = False

    def __init__(self, plan: TablePlan) -> None:
        super().__init__()
        self.plan = plan
        self.stats = LookupStats()

    def lookup(self, table: str, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def open_gradient_channel(self) -> None:
        """Send the lookups' gradients over a process group of their own (collective: every rank
        calls it), so they can travel on another thread than the next lookups. No-op in one process."""

    def start_lookup(self, table: str, rows: torch.Tensor) -> "_Ready":
        """``lookup`` split in two: started here, its values taken by ``wait()`` (backends whose
        embedding exchange is asynchronous return it still in flight)."""
        return _Ready(self.lookup(table, rows))

    def route_lookup(self, table: str, rows: torch.Tensor, *, buffered: bool = True,
                     routing_channel: bool = False) -> "_Deferred":
        """``start_lookup`` split once more: the keys routed now, ``exchange()`` later starts the
        rest (backends without a routing stage look up at ``exchange()``: always fresh).
        ``routing_channel``: route on the channel ``open_routing_channel`` made (called from the
        routing thread)."""
        return _Deferred(lambda: self.start_lookup(table, rows))

    def open_routing_channel(self) -> None:
        """Route keys on a process group of their own (collective: every rank calls it), so the
        id all-to-alls can run on a thread of their own while the main thread exchanges
        embeddings. No-op where there is no routing collective."""

    def track_updates(self, enabled: bool = True) -> None:
        """Remember which rows each step reads (``route_lookup`` buffers refresh those)."""

    def new_step(self) -> None:
        """A step begins (the previous one's optimizer has stepped)."""

    def load_full(self, table: str, weight: torch.Tensor) -> None:
        """Set the whole table (the same tensor on every rank)."""
        raise NotImplementedError

    def full(self, table: str) -> torch.Tensor:
        """The whole table, gathered (collective on sharded backends)."""
        raise NotImplementedError

    def after_backward(self) -> None:
        """Called after ``loss.backward()``, before the optimizer step (HSP's gradient sync)."""

    def sparse_parameters(self) -> list[nn.Parameter]:
        """Parameters a torch optimizer must step (empty when the backend's optimizer is fused)."""
        return list(self.parameters())

    def _counted(self, module: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        """``module(rows)``, adding what its own ``stats`` counted for this call to ours."""
        before = module.stats.as_dict()
        out = module(rows)
        self._add_since(module, before)
        return out

    def _add_since(self, module: nn.Module, before: dict[str, int]) -> None:
        self.stats.add(LookupStats(**{k: v - before[k] for k, v in module.stats.as_dict().items()}))


class _Ready:
    """A lookup that completed when it was started."""

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values

    def wait(self) -> torch.Tensor:
        return self.values


class _Deferred:
    """A lookup started only at ``exchange()``."""

    def __init__(self, start) -> None:
        self.start = start

    def exchange(self, *, refresh: bool = True):
        return self.start()


class _CountedRoute:
    """A shard's routed lookup whose rows' stats (counted at ``exchange``) go to its tables'."""

    def __init__(self, tables: "Tables", shard: ShardedEmbedding, routed) -> None:
        self.tables, self.shard, self.routed = tables, shard, routed

    def exchange(self, *, refresh: bool = True):
        pending = self.routed.exchange(refresh=refresh)
        self.tables.stats.add(pending.stats)  # this call's counts (the routing thread may count meanwhile)
        return pending


@dataclass(eq=False)  # identity: a lookup is found in queues by what it is, not by its tensors
class _StartedLookup:
    kept: torch.Tensor  # the valid ids, flat, in order: what a prefetched lookup is matched on
    valid: Optional[torch.Tensor]  # mask of the valid positions of the flat ids (None: no padding id)
    pending: object  # .wait() -> rows' values
    inverse: Optional[torch.Tensor]  # stage-1 dedup: unique rows -> kept positions


class LocalTables(Tables):
    """One process: a parameter per merged table."""

    def __init__(self, plan: TablePlan) -> None:
        super().__init__(plan)
        self.weights = nn.ParameterDict({name: nn.Parameter(torch.zeros(t.num_rows, t.dim, dtype=t.dtype))
                                         for name, t in plan.tables.items()})

    def lookup(self, table: str, rows: torch.Tensor) -> torch.Tensor:
        self.stats.add(LookupStats(rows_read=rows.numel(), lookups=1))
        return self.weights[table][rows]

    @torch.no_grad()
    def load_full(self, table: str, weight: torch.Tensor) -> None:
        self.weights[table].copy_(weight)

    def full(self, table: str) -> torch.Tensor:
        return self.weights[table].detach().clone()


class NativeTables(Tables):
    """Row-wise sharded tables on torch.distributed (``dedup.py``), optionally hierarchical (``hsp.py``)."""

    def __init__(self, plan: TablePlan, *, stage2: bool, group_size: Optional[int] = None) -> None:
        super().__init__(plan)
        self.stage2 = stage2
        mode = "lookup" if stage2 else "none"  # stage 1 is done by the runtime
        tables = {}
        for name, t in plan.tables.items():
            if group_size:
                from .hsp import HSPEmbedding

                tables[name] = HSPEmbedding(t.num_rows, t.dim, group_size=group_size, name=name, dedup=mode,
                                            full_weight=torch.zeros(t.num_rows, t.dim, dtype=t.dtype))
            else:
                tables[name] = ShardedEmbedding(t.num_rows, t.dim, name=name, dedup=mode,
                                                full_weight=torch.zeros(t.num_rows, t.dim, dtype=t.dtype))
        self.tables = nn.ModuleDict(tables)
        self.hsp, self.group_size = bool(group_size), group_size
        self.sync_bytes = 0  # HSP: gradient rows sent across groups
        self.grad_group = None  # open_gradient_channel
        self.route_group = None  # open_routing_channel

    def lookup(self, table: str, rows: torch.Tensor) -> torch.Tensor:
        return self._counted(self.tables[table], rows)

    def open_gradient_channel(self) -> None:
        if self.grad_group is not None:
            return
        if self.hsp:  # the lookups' all-to-alls run inside this rank's group: so do their gradients
            world, rank, size = dist.get_world_size(), dist.get_rank(), self.group_size
            for g in range(world // size):
                group = dist.new_group(list(range(g * size, (g + 1) * size)), backend="gloo")
                if rank // size == g:
                    self.grad_group = group
        else:
            self.grad_group = dist.new_group(backend="gloo")
        for name in self.tables:
            self._shard(name).grad_group = self.grad_group

    def open_routing_channel(self) -> None:
        if self.route_group is not None:
            return
        if self.hsp:
            raise NotImplementedError("a routing channel for HSP groups (no schedule routes on a thread under HSP)")
        self.route_group = dist.new_group(backend="gloo")

    def start_lookup(self, table: str, rows: torch.Tensor):
        return self.route_lookup(table, rows, buffered=False).exchange()

    def route_lookup(self, table: str, rows: torch.Tensor, *, buffered: bool = True, routing_channel: bool = False):
        shard = self._shard(table)
        if routing_channel and self.route_group is None:
            raise RuntimeError("route_lookup(routing_channel=True) before open_routing_channel()")
        routed = shard.route(rows, buffered=buffered, group=self.route_group if routing_channel else None)
        self.stats.add(routed.stats)  # this call's counts (another thread may count on the shard meanwhile)
        return _CountedRoute(self, shard, routed)

    def track_updates(self, enabled: bool = True) -> None:
        for name in self.tables:
            self._shard(name).track_updates(enabled)

    def new_step(self) -> None:
        for name in self.tables:
            self._shard(name).begin_step()

    def _shard(self, table: str) -> ShardedEmbedding:
        module = self.tables[table]
        return module.table if self.hsp else module

    @torch.no_grad()
    def load_full(self, table: str, weight: torch.Tensor) -> None:
        shard = self._shard(table)
        shard.weight.copy_(weight[shard.rank::shard.world])

    @torch.no_grad()
    def full(self, table: str) -> torch.Tensor:
        shard = self._shard(table)
        t = self.plan.tables[table]
        per_rank = math.ceil(t.num_rows / shard.world)
        padded = torch.zeros(per_rank, t.dim, dtype=shard.weight.dtype)
        padded[:shard.weight.shape[0]] = shard.weight
        gathered = [torch.empty_like(padded) for _ in range(shard.world)]
        dist.all_gather(gathered, padded, group=shard.group)
        out = torch.empty(t.num_rows, t.dim, dtype=padded.dtype)
        for r, part in enumerate(gathered):
            out[r::shard.world] = part[:len(range(r, t.num_rows, shard.world))]
        return out

    def after_backward(self) -> None:
        if self.hsp:
            for module in self.tables.values():
                before = module.sync_stats.embedding_bytes
                module.sync_gradients()
                self.sync_bytes += module.sync_stats.embedding_bytes - before


class DynamicTables(Tables):
    """The dynamic (hash) tables: ``DynamicEmbedding`` in one process, ``ShardedDynamicEmbedding``
    over a process group; updated by their fused row-wise optimizer in ``after_backward``."""

    def __init__(self, plan: TablePlan, *, distributed: bool, stage2: bool, optimizer: str = "sgd",
                 lr: float = 0.01, seed: int = 0) -> None:
        super().__init__(plan)
        from .hash_embedding import DynamicEmbedding, ShardedDynamicEmbedding

        self.optimizer, self.lr = optimizer, lr
        tables = {}
        for name, t in plan.tables.items():
            if not t.dynamic:
                continue
            if distributed:
                tables[name] = ShardedDynamicEmbedding(t.dim, name=name, dedup="lookup" if stage2 else "none",
                                                       seed=seed, dtype=t.dtype)
            else:
                tables[name] = DynamicEmbedding(t.dim, name=name, seed=seed, dtype=t.dtype)
        self.tables = nn.ModuleDict(tables)

    def _hash_table(self, name: str):
        module = self.tables[name]
        return getattr(module, "table", module)

    def lookup(self, table: str, rows: torch.Tensor) -> torch.Tensor:
        module = self.tables[table]
        if hasattr(module, "stats"):  # sharded: it counts its own all-to-alls
            return self._counted(module, rows)
        self.stats.add(LookupStats(rows_read=rows.numel(), lookups=1))
        return module(rows)

    def load_full(self, table: str, weight: torch.Tensor) -> None:
        pass  # a dynamic table starts empty: rows appear with their ids

    def full(self, table: str) -> torch.Tensor:
        raise NotImplementedError(f"dynamic table {table!r} has no fixed set of rows to gather")

    def sparse_parameters(self) -> list[nn.Parameter]:
        return []  # fused update in after_backward

    def after_backward(self) -> None:
        for name in self.tables:
            table = self._hash_table(name)
            table.apply_gradients(self.lr, self.optimizer)
            table.tick()


class SparseRuntime:
    """Owns the tables and the in-flight lookups of one rewritten model (see module docstring)."""

    def __init__(self, plan: TablePlan, tables: Tables, *, dedup: str = "two_stage",
                 pad_rows: Optional[dict[str, torch.Tensor]] = None, dynamic: Optional[Tables] = None,
                 max_in_flight: int = MAX_IN_FLIGHT) -> None:
        if dedup not in DEDUP_MODES:
            raise ValueError(f"dedup must be one of {DEDUP_MODES}, got {dedup!r}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.plan, self.tables, self.dedup, self.dynamic = plan, tables, dedup, dynamic
        self.max_in_flight = max_in_flight
        self._dynamic_grads_pending = False  # a dynamic lookup's backward ran; its fused update has not
        self._queued_for_task: Optional[int] = None  # the backward pass whose end-of-pass callback is queued
        self._lookup_seq = itertools.count()  # in-flight lookups in the order they were made
        self._oldest_consumed: Optional[int] = None  # by the running backward pass
        self.dropped_lookups = 0  # lookup graphs released because their backward never came
        self._prefetched: dict[str, collections.deque] = {}
        self._unexchanged: collections.deque = collections.deque()  # routed-only prefetches, in order
        self.refresh_prefetched = True  # False only to show what stale prefetch buffers do (tests)
        self._grad_worker: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._grad_futures: list[concurrent.futures.Future] = []
        self._route_worker: Optional[concurrent.futures.ThreadPoolExecutor] = None  # six-stage's routing stage
        self._routings: list[concurrent.futures.Future] = []  # routings started, not taken yet (in order)
        self.recorded: Optional[list[tuple[str, torch.Tensor]]] = None  # (feature, valid ids) per lookup, when a list
        self.timeline: Optional[list[tuple[str, str, float, float]]] = None  # span()s, when a list
        self.pad_rows = pad_rows or {}
        self.handle = register_runtime(self)
        self.seconds = {"forward": 0.0, "backward": 0.0}  # wall time inside the lookups and their backward
        self._in_flight: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    # -- checks ---------------------------------------------------------------------------------
    def check(self, feature: str, ids: torch.Tensor) -> None:
        f = self.plan.features[feature]
        if f.dynamic:
            self.plan.tables[f.table].tags.check(feature, ids)
            return
        require_int_ids(f"feature {feature!r}", ids)
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= f.num_embeddings:
                raise ValueError(f"feature {feature!r}: ids must lie in [0, {f.num_embeddings}), "
                                 f"got values in [{lo}, {hi}]")

    # -- lookup ---------------------------------------------------------------------------------
    def forward(self, feature: str, ids: torch.Tensor, *, keep_graph: bool) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return self._forward(feature, ids, keep_graph)
        finally:
            self.seconds["forward"] += time.perf_counter() - start

    def _forward(self, feature: str, ids: torch.Tensor, keep_graph: bool) -> torch.Tensor:
        started = self._take_prefetched(feature, ids)
        if started is None:
            with self.span(f"route+read {feature}"):
                started = self._start(feature, ids)
        f = self.plan.features[feature]
        with self.span(f"exchange wait {feature}"):
            values = started.pending.wait()
        if started.inverse is not None:
            values = values[started.inverse]
        if self.recorded is not None:
            self.recorded.append((feature, started.kept))
        if keep_graph and values.requires_grad:
            self._keep_in_flight(feature, ids, values)
        values = values.detach()
        if started.valid is None:
            return values.view(*ids.shape, f.dim)
        out = self.pad_rows.get(feature, values.new_zeros(f.dim)).to(values.dtype).expand(ids.numel(), f.dim).clone()
        out[started.valid] = values
        return out.view(*ids.shape, f.dim)

    def _start(self, feature: str, ids: torch.Tensor, routed_only: bool = False,
               buffered: bool = True, routing_channel: bool = False) -> "_StartedLookup":
        """Checks, padding dropped, stage-1 dedup, and the backend lookup started (its embedding
        exchange may still be in flight; ``routed_only``: not started yet, ``pending.exchange()``;
        ``routing_channel``: routed on the routing thread's process group)."""
        self.check(feature, ids)
        f = self.plan.features[feature]
        valid, kept = self.valid_ids(feature, ids)
        rows = self.plan.tables[f.table].tags.tag(feature, kept) if f.dynamic else kept + f.offset
        backend = self.dynamic if f.dynamic else self.tables
        inverse = None
        if self.dedup in ("comm", "two_stage"):
            rows, inverse = torch.unique(rows, return_inverse=True)
        pending = backend.route_lookup(f.table, rows, buffered=buffered, routing_channel=routing_channel) \
            if routed_only else backend.start_lookup(f.table, rows)
        return _StartedLookup(kept, valid, pending, inverse)

    def valid_ids(self, feature: str, ids: torch.Tensor) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """``(mask of the non-padding positions of the flat ids or None, those ids)``."""
        flat = ids.reshape(-1).long()
        pad = self.plan.features[feature].pad
        if pad is None:
            return None, flat
        valid = flat != pad
        return valid, flat[valid]

    # -- pipelining (train/pipeline.py schedules these) -----------------------------------------
    def prefetch(self, lookups: Sequence[tuple[str, torch.Tensor]], *, exchange: bool = True,
                 buffered: bool = True) -> None:
        """Start the lookups a coming forward will make: ids routed and rows read now, embeddings
        exchanged in the background — or, ``exchange=False`` (DBP), routed and read into a
        prefetch buffer only, exchanged by ``exchange_routed`` once the step before has updated
        the tables (the buffer's rows that step updated are read again then). The forward's k-th
        lookup of a feature takes the k-th prefetched one of that feature, which must be of the
        same ids (else it raises: a lookup made afresh there would be a collective the other ranks
        do not make). ``buffered=False`` with ``exchange=False``: routed only, the rows read at the
        exchange (no update can come between inside one step)."""
        for feature, ids in lookups:
            with self.span(f"route+read {feature}"):
                started = self._start(feature, ids, routed_only=not exchange, buffered=buffered)
            self._prefetched.setdefault(feature, collections.deque()).append(started)
            if not exchange:
                self._unexchanged.append(started)

    def exchange_routed(self, count: Optional[int] = None) -> None:
        """Start the embedding exchange of the next ``count`` (default: all) routed-only lookups,
        in the order they were prefetched (the same on every rank)."""
        count = len(self._unexchanged) if count is None else count
        for _ in range(count):
            started = self._unexchanged.popleft()
            with self.span("exchange start"):  # DBP: after the buffer sync
                started.pending = started.pending.exchange(refresh=self.refresh_prefetched)

    # -- the six-stage schedule's routing stage: a thread and a process group of its own ----------
    def start_routing(self, extract: Callable[[], Sequence[tuple[str, torch.Tensor]]]) -> concurrent.futures.Future:
        """Route a coming batch's lookups on the routing thread: ``extract()`` (its key
        extraction), then per lookup the checks, stage-1 dedup, the id all-to-all (on the routing
        process group: its collectives never interleave with the main thread's or the gradient
        thread's) and stage-2 dedup on the owners. Nothing is read from the tables (the rows are
        read by ``take_routed``), so this may run while the main thread computes and the optimizer
        steps. Routings run one at a time in the order they are started, the same on every rank;
        ``take_routed(future)`` waits for one."""
        if self._route_worker is None:
            self.tables.open_routing_channel()
            self._route_worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grcompile-sparse-route")

        def route() -> list[tuple[str, _StartedLookup]]:
            with self.span("key extraction"):
                lookups = list(extract())
            routed = []
            for feature, ids in lookups:
                with self.span(f"route {feature}"):
                    routed.append((feature, self._start(feature, ids, routed_only=True, buffered=False,
                                                        routing_channel=True)))
            return routed

        future = self._route_worker.submit(route)
        self._routings.append(future)
        return future

    def take_routed(self, routing: concurrent.futures.Future, *, exchange: bool = True) -> int:
        """Wait for a routing (``start_routing``; "wait for unique"), queue its lookups as
        prefetched, in order, and — ``exchange`` — start their embedding exchange: the rows read
        now, sent in the background (``exchange=False``: left to ``exchange_routed``). Returns the
        number of lookups."""
        with self.span("routing wait"):
            try:
                routed = routing.result()
            finally:
                self._routings.remove(routing)
        for feature, started in routed:
            self._prefetched.setdefault(feature, collections.deque()).append(started)
            self._unexchanged.append(started)
        if exchange:
            self.exchange_routed(len(routed))
        return len(routed)

    def discard_routing(self, routing: concurrent.futures.Future) -> None:
        """Wait for a routing (its collectives must finish on every rank) and drop it."""
        try:
            routing.result()
        finally:
            self._routings.remove(routing)

    def discard_prefetched(self) -> None:
        """Drop every prefetched lookup (before an evaluation, at the end): routings and exchanges
        in flight are waited for, so no collective is left half done."""
        routings, self._routings = self._routings, []
        for routing in routings:
            routing.result()
        for queue in self._prefetched.values():
            for started in queue:
                if hasattr(started.pending, "wait"):  # exchanged (routed-only ones have no collective open)
                    started.pending.wait()
        self._prefetched.clear()
        self._unexchanged.clear()

    def track_updates(self, enabled: bool = True) -> None:
        """Remember the rows each step reads, to refresh prefetch buffers (DBP); ``False`` stops it
        (an evaluation between steps would otherwise be remembered too)."""
        self.tables.track_updates(enabled)

    def _take_prefetched(self, feature: str, ids: torch.Tensor) -> Optional["_StartedLookup"]:
        queue = self._prefetched.get(feature)
        if not queue:
            return None
        started = queue.popleft()
        valid, kept = self.valid_ids(feature, ids)
        if not torch.equal(started.kept, kept):
            raise RuntimeError(
                f"sparse pipeline: the forward looked up feature {feature!r} with other ids than the ones "
                f"extracted ahead of it ({kept.numel()} vs {started.kept.numel()} valid ids); the model's lookup "
                f"keys cannot be computed before its forward here: train with --pipeline sync")
        # the same valid ids, maybe laid out otherwise (padded when extracted, packed by the jagged rewrite)
        started.valid = valid
        while started in self._unexchanged:  # the forward came first: exchange in prefetch order up to it
            self.exchange_routed(1)
        return started

    def prefetched(self) -> int:
        return sum(len(q) for q in self._prefetched.values())

    def defer_sparse_backward(self, enabled: bool) -> None:
        """Deferred: a lookup's backward (the gradient exchange and the shard's gradient) runs on a
        worker thread, in call order, while the caller goes on; ``drain()`` waits for all of it."""
        if enabled and self._grad_worker is None:
            self.tables.open_gradient_channel()
            self._grad_worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grcompile-sparse-grad")
        elif not enabled and self._grad_worker is not None:
            self.drain()
            self._grad_worker.shutdown()
            self._grad_worker = None

    def _lookup_backward(self, feature: str, values: torch.Tensor, grad: torch.Tensor) -> None:
        """The lookup's own backward: gradient exchange and the shard's gradient (deferred or not)."""
        with self.span(f"gradient exchange {feature}"):
            values.backward(grad)

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """A timed region for ``timeline`` (a list, when set: ``(name, thread, start, end)``)."""
        timeline = self.timeline  # the list of when it began (the routing thread may end a span after the step)
        if timeline is None:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            timeline.append((name, threading.current_thread().name, start, time.perf_counter()))

    def drain(self) -> None:
        """Wait for every deferred sparse backward (re-raising its error)."""
        futures, self._grad_futures = self._grad_futures, []
        with self.span("gradient exchange wait"):
            for future in futures:
                future.result()

    def backward(self, feature: str, ids: torch.Tensor, grad: torch.Tensor) -> None:
        start = time.perf_counter()
        try:
            self._backward(feature, ids, grad)
        finally:
            self.seconds["backward"] += time.perf_counter() - start

    def _backward(self, feature: str, ids: torch.Tensor, grad: torch.Tensor) -> None:
        pending = self._in_flight.get(feature, [])
        for i, (seq, saved_ids, values) in enumerate(pending):
            if saved_ids.shape == ids.shape and torch.equal(saved_ids, ids):
                del pending[i]
                self._oldest_consumed = seq if self._oldest_consumed is None else min(self._oldest_consumed, seq)
                break
        else:
            raise RuntimeError(f"feature {feature!r}: backward of a lookup that is not in flight "
                               f"(was the forward run under torch.no_grad(), or backward called twice?)")
        f = self.plan.features[feature]
        flat_grad = grad.reshape(-1, f.dim)
        if f.pad is not None:
            flat_grad = flat_grad[ids.reshape(-1) != f.pad]
        flat_grad = flat_grad.to(values.dtype)
        if self._grad_worker is not None:
            # a copy: the compiled backward may reuse the gradient's buffer once this op returns
            self._grad_futures.append(self._grad_worker.submit(self._lookup_backward, feature, values,
                                                               flat_grad.clone()))
        else:
            self._lookup_backward(feature, values, flat_grad)
        if f.dynamic:
            self._dynamic_grads_pending = True
        self._queue_end_of_backward()

    def _keep_in_flight(self, feature: str, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Keep the lookup's graph for its backward, at most ``max_in_flight`` per feature: forwards
        in training mode whose backward never comes (metrics computed without ``torch.no_grad()``)
        would otherwise hold every graph they made."""
        pending = self._in_flight.setdefault(feature, [])
        pending.append((next(self._lookup_seq), ids.detach().clone(), values))
        if len(pending) > self.max_in_flight:
            del pending[0]
            self.dropped_lookups += 1
            if self.dropped_lookups == 1:
                warnings.warn(
                    f"grcompile sparse runtime: feature {feature!r} has more than {self.max_in_flight} lookups "
                    f"waiting for a backward; the oldest is released (its backward, if it ever comes, will raise). "
                    f"Run forwards that need no gradient under torch.no_grad() or model.eval(), or pass a larger "
                    f"max_in_flight to shard_embeddings.", stacklevel=3)

    def _queue_end_of_backward(self) -> None:
        """Once per backward pass that reached a lookup, at its end: the dynamic tables' fused
        update (so ``loss.backward(); opt.step()`` trains them with nothing else to call), and the
        release of lookups made before the oldest one this pass consumed whose backward never came
        (forwards whose loss was dropped) — a pass over several forwards' summed losses consumes
        them all."""
        task = torch._C._current_graph_task_id()
        if task == self._queued_for_task:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        except RuntimeError:
            return  # not inside a backward pass (a direct runtime.backward call): after_backward() applies it
        self._queued_for_task = task  # keyed by pass: a pass that failed before its end leaves nothing stuck

    def _end_of_backward(self) -> None:
        self._queued_for_task = None
        oldest, self._oldest_consumed = self._oldest_consumed, None
        if oldest is not None:
            for feature, pending in self._in_flight.items():
                self._in_flight[feature] = [entry for entry in pending if entry[0] > oldest]
        self._apply_dynamic_update()

    def _apply_dynamic_update(self) -> None:
        if self.dynamic is not None and self._dynamic_grads_pending:
            self._dynamic_grads_pending = False
            self.dynamic.after_backward()

    def after_backward(self) -> None:
        """After ``loss.backward()``, before the optimizer step: HSP's gradient sync (which the
        training loop calls; a loop of your own with HSP must call it too). The dynamic tables'
        update has normally run already, at the end of the backward pass; this applies it if not."""
        self.tables.after_backward()
        self._apply_dynamic_update()

    def new_step(self) -> None:
        """Drop lookups whose backward never came (a forward under grad whose loss was not used)."""
        self._in_flight.clear()
        self._queued_for_task, self._oldest_consumed = None, None
        self.tables.new_step()

    def in_flight(self) -> int:
        return sum(len(v) for v in self._in_flight.values())

    def full_weight(self, feature: str) -> torch.Tensor:
        f = self.plan.features[feature]
        if f.dynamic:
            raise NotImplementedError(f"feature {feature!r} is dynamic: no fixed table to gather")
        return self.tables.full(f.table)[f.offset:f.offset + f.num_embeddings]


class SparseFeature(nn.Module):
    """Stands where the user's ``nn.Embedding`` stood: ``forward(ids) -> [*ids.shape, D]``."""

    def __init__(self, runtime: SparseRuntime, feature: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.feature, self.handle = feature, runtime.handle
        spec = runtime.plan.features[feature]
        self.num_embeddings, self.embedding_dim, self.padding_idx = spec.num_embeddings, spec.dim, spec.pad
        # Makes the op's output require grad (ids are integers); its gradient is always zero.
        self.anchor = nn.Parameter(torch.zeros((), dtype=dtype))
        object.__setattr__(self, "runtime", runtime)  # not a submodule: the tables hang off the root

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        keep_graph = self.training and torch.is_grad_enabled()
        return torch.ops.grcompile.sparse_lookup(ids, self.anchor, self.handle, self.feature, keep_graph)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table as a lookup of every id, so code reading ``.weight`` (full-catalogue
        scoring) still trains the rows it touches. Costs a lookup of the whole table."""
        return self(torch.arange(self.num_embeddings, device=self.anchor.device))

    def extra_repr(self) -> str:
        return f"{self.feature!r}, {self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}"


TABLES_ATTR = "grcompile_sparse_tables"
DYNAMIC_ATTR = "grcompile_dynamic_tables"


def shard_embeddings(model: nn.Module, *, backend: str = "local", features: Sequence[FeatureConfig] = (),
                     dedup: str = "two_stage", sharding: str = "auto", group_size: Optional[int] = None,
                     fused_optimizer: Optional[dict] = None, seed: int = 0, max_in_flight: int = MAX_IN_FLIGHT,
                     log=None) -> SparseRuntime:
    """Rewrite ``model`` in place (see module docstring) and return its runtime.

    ``backend``: ``local`` | ``native`` (row-wise, HSP with ``group_size``) | ``torchrec``
    (``sharding`` row | table | column | auto, ``fused_optimizer`` e.g. ``{"type": "sgd", "lr": 0.1}``).
    Features configured ``dynamic`` go to hash tables (``DynamicTables``; sharded by id on the
    distributed backends, updated by ``fused_optimizer``'s sgd/adagrad rule at the end of every
    backward pass that reached them). ``max_in_flight``: lookup graphs kept per feature for a
    backward that has not come yet. Every rank must call it with the same model (same initial weights)."""
    found = find_sparse_features(model, features)
    if not found:
        raise ValueError("no sparse feature found: no nn.Embedding has a padding_idx (name modules with "
                         "FeatureConfig to shard others)")
    plan = plan_tables(found)
    static_plan = TablePlan({n: f for n, f in plan.features.items() if not f.dynamic},
                            {n: t for n, t in plan.tables.items() if not t.dynamic})
    modules = dict(model.named_modules())
    weights = {f.name: modules[f.module].weight.detach() for f in found}
    fused = dict(fused_optimizer or {"type": "sgd", "lr": 0.01})
    dynamic = None
    if len(static_plan.tables) < len(plan.tables):
        if fused["type"] not in ("sgd", "adagrad"):
            raise ValueError(f"dynamic tables update with sgd or adagrad, got {fused['type']!r}")
        dynamic = DynamicTables(plan, distributed=backend != "local", stage2=dedup in ("lookup", "two_stage"),
                                optimizer=fused["type"], lr=fused["lr"], seed=seed)
    if backend == "local" or not static_plan.tables:
        tables: Tables = LocalTables(static_plan)
    elif backend == "native":
        if sharding not in ("row", "auto"):
            raise ValueError(f"backend 'native' shards row-wise only, got sharding {sharding!r}")
        tables = NativeTables(static_plan, stage2=dedup in ("lookup", "two_stage"), group_size=group_size)
    elif backend == "torchrec":
        if group_size:
            raise ValueError("hierarchical sparse parallelism (group_size) runs on backend 'native' on CPU "
                             "(TorchRec's DMPCollection is CUDA-only)")
        from .torchrec_tables import TorchRecTables

        tables = TorchRecTables(static_plan, sharding=sharding, stage2=dedup in ("lookup", "two_stage"),
                                fused_optimizer=fused)
    else:
        raise ValueError(f"backend must be 'local', 'native' or 'torchrec', got {backend!r}")
    for name, spec in static_plan.tables.items():
        tables.load_full(name, torch.cat([weights[f] for f in spec.features]))
    pad_rows = {f.name: weights[f.name][f.pad].clone() for f in found if f.pad is not None}
    runtime = SparseRuntime(plan, tables, dedup=dedup, pad_rows=pad_rows, dynamic=dynamic,
                            max_in_flight=max_in_flight)
    for f in found:
        parent_name, _, attr = f.module.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        setattr(parent, attr, SparseFeature(runtime, f.name, f.dtype))
    setattr(model, TABLES_ATTR, tables)
    if dynamic is not None:
        setattr(model, DYNAMIC_ATTR, dynamic)
    if log is not None:
        log(f"[grcompile.runtime] {backend} sparse tables (dedup {dedup}):\n{plan.describe()}")
    return runtime


def sparse_runtime(model: nn.Module) -> SparseRuntime:
    """The runtime behind a model rewritten by ``shard_embeddings`` (or ``optimize(sparse=...)``)."""
    model = getattr(model, "_orig_mod", model)  # a torch.compile'd module
    for module in model.modules():
        if isinstance(module, SparseFeature):
            return module.runtime
    raise ValueError(f"{type(model).__name__} has no sparse features: it was not rewritten by shard_embeddings")


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters a data-parallel all-reduce syncs: everything but the sparse tables."""
    skip = {id(p) for attr in (TABLES_ATTR, DYNAMIC_ATTR) if getattr(model, attr, None) is not None
            for p in getattr(model, attr).parameters()}
    return [p for p in model.parameters() if id(p) not in skip]


__all__ = ["LocalTables", "NativeTables", "SparseFeature", "SparseRuntime", "Tables", "dense_parameters",
           "shard_embeddings", "sparse_runtime"]
