"""Row-wise sharded embedding lookup with MTGRBoost's two-stage ID deduplication (§4.3).

A table of ``num_embeddings`` rows lives split over the ranks of a process group (row ``r`` on
rank ``r % W`` as its local row ``r // W``). A lookup is two all-to-alls: ids to their owners,
embedding rows back. ``dedup`` picks what is made unique:

* ``"none"``      every id is sent, looked up and sent back;
* ``"comm"``      stage 1: ``unique`` before the id all-to-all, re-expanded after the embeddings
  come back (fewer ids *and* fewer embedding rows on the wire — the expensive part);
* ``"lookup"``    stage 2: ``unique`` of what an owner received (duplicates across senders), so
  each row is read once, re-expanded before sending back;
* ``"two_stage"`` both (the default).

Values and gradients are the same in every mode (tested against an unsharded table); the
embedding all-to-all is asynchronous (``start`` issues it, ``PendingLookup.wait`` takes it) and
differentiable (``_EmbeddingExchange``), so the shard's gradient arrives through autograd.
``stats`` counts ids and bytes that cross ranks (sends to oneself excluded) and rows read from
the shard.

TorchRec's own dedup (``use_index_dedup``) needs CUDA-only fbgemm ops; this is the CPU path
(gloo), written on torch.distributed's collectives.
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .ids import require_int_ids

DEDUP_MODES = ("none", "comm", "lookup", "two_stage")
_STATS_LOCK = threading.Lock()  # counters are added from the routing and the main thread (six-stage)


@dataclass
class LookupStats:
    ids_sent: int = 0  # ids this rank sent to other ranks
    id_bytes: int = 0
    rows_sent: int = 0  # embedding rows this rank sent back to other ranks
    embedding_bytes: int = 0
    rows_read: int = 0  # rows read from the local shard
    lookups: int = 0  # lookup calls

    def add(self, other: "LookupStats") -> None:
        with _STATS_LOCK:
            for k, v in asdict(other).items():
                setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class ShardedEmbedding(nn.Module):
    """``forward(ids [...]) -> [..., dim]`` over a row-wise sharded table (see module docstring).

    ``weight`` (this rank's rows) is an ``nn.Parameter``; ``full_weight`` (optional, the same on
    every rank) initialises the shards, e.g. to compare with an unsharded table."""

    def __init__(self, num_embeddings: int, dim: int, *, name: str = "embedding", dedup: str = "two_stage",
                 group: Optional[dist.ProcessGroup] = None, full_weight: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        if dedup not in DEDUP_MODES:
            raise ValueError(f"dedup must be one of {DEDUP_MODES}, got {dedup!r}")
        self.num_embeddings, self.dim, self.name, self.dedup, self.group = num_embeddings, dim, name, dedup, group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if full_weight is None:
            full_weight = torch.randn(num_embeddings, dim) * 0.02
        if tuple(full_weight.shape) != (num_embeddings, dim):
            raise ValueError(f"{name}: full_weight must be [{num_embeddings}, {dim}], got {tuple(full_weight.shape)}")
        self.weight = nn.Parameter(full_weight[self.rank::self.world].clone())
        self.stats = LookupStats()

    def check(self, ids: torch.Tensor) -> None:
        """Raised on this rank before any collective, so the other ranks are not left waiting
        (they fail at their own check or time out on the collective, never read garbage)."""
        require_int_ids(self.name, ids)
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.num_embeddings:
                raise ValueError(f"{self.name}: ids must lie in [0, {self.num_embeddings}), got values in [{lo}, {hi}]")

    def read_owned(self, ids: torch.Tensor, values: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows of ids this rank owns (``id % W == rank``), differentiable into the shard; their
        values read now, or ``values`` read earlier (a prefetch buffer)."""
        local = ids // self.world
        return _ReadRows.apply(self.weight, local, self.weight.detach()[local] if values is None else values)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.start(ids).wait()

    def start(self, ids: torch.Tensor) -> "PendingLookup":
        """Route the ids to their owners and read the rows (synchronous: the id all-to-all is small);
        send the rows back asynchronously. ``wait()`` on the result gives ``forward(ids)``."""
        return self.route(ids).exchange()

    def route(self, ids: torch.Tensor, *, buffered: bool = False,
              group: Optional[dist.ProcessGroup] = None) -> "RoutedLookup":
        """Key routing (dedup, the id all-to-all, dedup on the owner). ``buffered``: the rows are
        also read now, into a prefetch buffer (DBP's retrieval stage), and refreshed at
        ``exchange`` where this rank's last step updated them. ``group``: the id all-to-alls on
        another process group of the same ranks as the table's (the six-stage schedule routes on
        a thread of its own, whose collectives must not interleave with the main thread's); the
        embedding exchange stays on the table's group. The returned lookup's ``stats`` are what this
        call counted (also added to ``self.stats``), for callers on several threads."""
        self.check(ids)
        W = self.world
        flat = ids.reshape(-1).long()
        stage1 = self.dedup in ("comm", "two_stage")
        stage2 = self.dedup in ("lookup", "two_stage")
        send, inverse = torch.unique(flat, return_inverse=True) if stage1 else (flat, None)
        owner = send % W
        order = torch.argsort(owner, stable=True)
        send = send[order]
        send_counts = torch.bincount(owner, minlength=W)
        recv_counts = torch.empty_like(send_counts)
        route_group = self.group if group is None else group
        dist.all_to_all_single(recv_counts, send_counts, group=route_group)
        recv = send.new_empty(int(recv_counts.sum()))
        send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
        dist.all_to_all_single(recv, send, recv_split, send_split, group=route_group)
        needed, back = torch.unique(recv, return_inverse=True) if stage2 else (recv, None)
        buffer = None
        if buffered:
            if type(self).read_owned is not ShardedEmbedding.read_owned:
                raise NotImplementedError(f"{self.name}: prefetch buffers hold rows of a static table only")
            buffer = self.read_owned(needed).detach().clone()
        mine_out = send_split[self.rank]
        counted = LookupStats(ids_sent=len(send) - mine_out, id_bytes=(len(send) - mine_out) * send.element_size(),
                              lookups=1)
        self.stats.add(counted)
        routed = RoutedLookup(self, tuple(ids.shape), needed, back, buffer, order, inverse, send_split, recv_split)
        routed.stats = counted
        return routed

    # -- which rows a step may have updated (DBP's buffer synchronisation) --------------------------
    def track_updates(self, enabled: bool = True) -> None:
        """From now on remember the rows each step reads: an optimizer that moves only rows with a
        gradient (SGD, Adagrad) updates no others. ``enabled=False``: stop (and forget)."""
        if not enabled:
            self._reads, self.updated = None, None
            return
        self._reads: Optional[list[torch.Tensor]] = getattr(self, "_reads", None) or []

    def begin_step(self) -> None:
        """The previous step's reads become ``updated`` (its optimizer has stepped by now)."""
        reads = getattr(self, "_reads", None)
        if reads is None:
            return
        self.updated = torch.cat(reads).unique() if reads else torch.zeros(0, dtype=torch.long)
        self._reads = []


class RoutedLookup:
    """A lookup routed to the owners; ``exchange()`` reads (or refreshes) the rows and sends them."""

    def __init__(self, module: ShardedEmbedding, shape: tuple[int, ...], needed: torch.Tensor,
                 back: Optional[torch.Tensor], buffer: Optional[torch.Tensor], order: torch.Tensor,
                 inverse: Optional[torch.Tensor], send_split: list[int], recv_split: list[int]) -> None:
        self.module, self.shape, self.needed, self.back, self.buffer = module, shape, needed, back, buffer
        self.order, self.inverse, self.send_split, self.recv_split = order, inverse, send_split, recv_split

    def exchange(self, *, refresh: bool = True) -> "PendingLookup":
        """Send the rows back (async). A buffered lookup first re-reads the rows its owner's last
        step updated (``refresh=False`` skips that: stale rows, for the negative control only)."""
        m = self.module
        if self.buffer is None:
            read = m.read_owned(self.needed)
        else:
            updated = getattr(m, "updated", None)
            if refresh and updated is not None and updated.numel():
                stale = torch.isin(self.needed, updated)
                if bool(stale.any()):
                    self.buffer[stale] = m.read_owned(self.needed[stale]).detach()
            read = m.read_owned(self.needed, self.buffer)
        if getattr(m, "_reads", None) is not None:
            m._reads.append(self.needed)
        rows = read[self.back] if self.back is not None else read
        received = rows.new_empty(sum(self.send_split), m.dim)
        work = dist.all_to_all_single(received, rows.detach().contiguous(), self.send_split, self.recv_split,
                                      group=m.group, async_op=True)
        mine_back = self.recv_split[m.rank]
        counted = LookupStats(rows_sent=rows.shape[0] - mine_back,
                              embedding_bytes=(rows.shape[0] - mine_back) * m.dim * rows.element_size(),
                              rows_read=int(self.needed.numel()))
        m.stats.add(counted)
        pending = PendingLookup(m, self.shape, rows, received, work, self.order, self.inverse, self.send_split,
                                self.recv_split)
        pending.stats = counted  # what this exchange counted (``route``'s ``stats``: the same, for the rows)
        return pending


class _ReadRows(torch.autograd.Function):
    """``weight[rows]`` with its values given (read now, or earlier into a prefetch buffer); the
    gradient is added into ``weight.grad`` at the rows only. Indexing's own backward would build a
    zero gradient of the whole shard per lookup and add it: O(shard) per lookup, paid again by every
    micro-batch. Added here directly (``weight.grad`` stays dense, as the optimizers expect)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.weight = weight
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rows,) = ctx.saved_tensors
        weight = ctx.weight
        with torch.no_grad():
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            weight.grad.index_add_(0, rows, grad.to(weight.dtype))
        return None, None, None


class PendingLookup:
    """A lookup whose embedding all-to-all is in flight. ``wait()`` returns the embeddings, wired
    into autograd so that their backward sends the gradient back to the owners (on
    ``grad_group`` when set: a second channel, so a gradient exchange can run on another thread
    while the next lookup's collectives run on this one)."""

    def __init__(self, module: ShardedEmbedding, shape: tuple[int, ...], rows: torch.Tensor, received: torch.Tensor,
                 work, order: torch.Tensor, inverse: Optional[torch.Tensor], send_split: list[int],
                 recv_split: list[int]) -> None:
        self.module, self.shape, self.rows, self.received, self.work = module, shape, rows, received, work
        self.order, self.inverse, self.send_split, self.recv_split = order, inverse, send_split, recv_split

    def wait(self) -> torch.Tensor:
        self.work.wait()
        group = getattr(self.module, "grad_group", None) or self.module.group
        got = _EmbeddingExchange.apply(self.rows, self.received, self.send_split, self.recv_split, group)
        emb = got[torch.argsort(self.order)]  # back to the order of `send` before sorting by owner
        if self.inverse is not None:
            emb = emb[self.inverse]
        return emb.view(*self.shape, self.module.dim)


class _EmbeddingExchange(torch.autograd.Function):
    """Rows read on their owners → the rows this rank received (exchanged already, outside);
    backward: the received rows' gradient back to the owners, onto the rows they read."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, received: torch.Tensor, send_split: list[int], recv_split: list[int],
                group) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.rows_shape = (send_split, recv_split), group, rows.shape
        return received.view_as(received)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send_split, recv_split = ctx.splits
        grad_rows = grad.new_empty(ctx.rows_shape)
        dist.all_to_all_single(grad_rows, grad.contiguous(), recv_split, send_split, group=ctx.group)
        return grad_rows, None, None, None, None


__all__ = ["DEDUP_MODES", "LookupStats", "PendingLookup", "RoutedLookup", "ShardedEmbedding"]
