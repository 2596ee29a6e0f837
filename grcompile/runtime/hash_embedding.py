"""Dynamic hash-table embedding (MTGRBoost §4.1): any int64 id, inserted on first sight.

Keys and values are stored apart. Keys live in an open-addressing table (linear probing,
power-of-two capacity, ``EMPTY = -1``) that maps an id to a *row*; rows live in fixed-size value
blocks that are appended as the table grows and never move. When an insertion would push the load
factor over ``max_load`` (0.75) the key table doubles and only the keys are rehashed — the
embedding vectors stay where they are (the cheap migration the paper designs for).

Ids are never reduced modulo a size, so two ids never share a row (no silent aliasing); a new id
during training gets a fresh row (initialised ``N(0, init_std²)``). ``insert=False`` (evaluation)
looks ids up without inserting and returns zeros for unknown ones. ``evict(mask_fn)`` drops ids
(e.g. not seen for K steps, or seen fewer than C times): their rows go to a free list that later
insertions reuse, and the key table is rebuilt without them.

Values are ``nn.Parameter`` blocks (``blocks``): train them with an optimizer that is told about
new blocks (``new_blocks()`` after each step), or with the fused row-wise SGD/Adagrad of
``apply_gradients`` — the TorchRec way (fused optimizer inside the embedding). Probing is
vectorised: each round resolves every pending id by one probe step.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .dedup import DEDUP_MODES, LookupStats, ShardedEmbedding
from .ids import require_int_ids

EMPTY = -1
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # golden-ratio multiplier as a signed int64


def _u64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_SM_ADD, _SM_M1, _SM_M2 = _u64(0x9E3779B97F4A7C15), _u64(0xBF58476D1CE4E5B9), _u64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    z = x + _SM_ADD
    z = (z ^ _shr(z, 30)) * _SM_M1
    z = (z ^ _shr(z, 27)) * _SM_M2
    return z ^ _shr(z, 31)


def hash_normal(keys: torch.Tensor, dim: int, seed: int) -> torch.Tensor:
    """``[len(keys), dim]`` standard normals that depend on (seed, key) only — a new id's initial row
    is the same whichever rank owns it and whenever it is first seen (Box–Muller on splitmix64)."""
    base = _splitmix(keys.long().reshape(-1, 1) ^ _splitmix(torch.tensor(seed, dtype=torch.int64)))
    j = torch.arange(dim, dtype=torch.int64)
    bits = [_shr(_splitmix(base + 2 * j + k), 11).double() / float(1 << 53) for k in (0, 1)]
    u1 = 1.0 - bits[0]  # (0, 1]
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * torch.pi * bits[1])).float()


def _hash(keys: torch.Tensor, mask: int) -> torch.Tensor:
    """Fibonacci hashing of int64 ids (wrapping multiply), top bits folded in, masked to the table."""
    h = keys * _MIX
    return (h ^ (h >> 29)) & mask


class DynamicEmbedding(nn.Module):
    def __init__(self, dim: int, *, name: str = "embedding", capacity: int = 1024, max_load: float = 0.75,
                 block_rows: int = 4096, init_std: float = 0.02, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if capacity < 2 or capacity & (capacity - 1):
            raise ValueError(f"{name}: capacity must be a power of two >= 2, got {capacity}")
        if not 0.0 < max_load < 1.0:
            raise ValueError(f"{name}: max_load must be in (0, 1), got {max_load}")
        self.dim, self.name, self.max_load, self.block_rows, self.init_std = dim, name, max_load, block_rows, init_std
        self.keys = torch.full((capacity,), EMPTY, dtype=torch.int64)
        self.rows = torch.full((capacity,), EMPTY, dtype=torch.int64)
        self.blocks = nn.ParameterList()
        self.free_rows: list[int] = []
        self.next_row = 0
        self.size = 0
        self.last_seen = torch.zeros(0, dtype=torch.int64)  # per row: step of the last lookup
        self.counts = torch.zeros(0, dtype=torch.int64)  # per row: lookups
        self.step = 0
        self.rehashes = 0
        self.seed, self.dtype = seed, dtype
        self._reported_blocks = 0

    # ------------------------------------------------------------------ key table
    @property
    def capacity(self) -> int:
        return self.keys.numel()

    def _probe(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slot, found)`` per id: the slot holding it, or the first empty slot on its probe path."""
        mask = self.capacity - 1
        slot = _hash(ids, mask)
        pending = torch.arange(ids.numel())
        out_slot = torch.empty_like(ids)
        found = torch.zeros(ids.numel(), dtype=torch.bool)
        for _ in range(self.capacity):
            if pending.numel() == 0:
                break
            at = self.keys[slot[pending]]
            hit, empty = at == ids[pending], at == EMPTY
            done = hit | empty
            out_slot[pending[done]] = slot[pending[done]]
            found[pending[hit]] = True
            pending = pending[~done]
            slot[pending] = (slot[pending] + 1) & mask
        return out_slot, found

    def _place(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Insert distinct, absent ``ids`` with their ``rows`` (room is guaranteed by the caller)."""
        while ids.numel():
            slot, _ = self._probe(ids)
            # ids racing for one empty slot: the first one takes it, the others probe again
            first = torch.ones_like(slot, dtype=torch.bool)
            order = torch.argsort(slot, stable=True)
            s = slot[order]
            first[order[1:]] = s[1:] != s[:-1]
            self.keys[slot[first]] = ids[first]
            self.rows[slot[first]] = rows[first]
            ids, rows = ids[~first], rows[~first]

    def _grow_to(self, needed: int) -> None:
        capacity = self.capacity
        while needed > self.max_load * capacity:
            capacity *= 2
        if capacity == self.capacity:
            return
        live = self.keys != EMPTY
        ids, rows = self.keys[live], self.rows[live]
        self.keys = torch.full((capacity,), EMPTY, dtype=torch.int64)
        self.rows = torch.full((capacity,), EMPTY, dtype=torch.int64)
        self._place(ids, rows)  # keys rehashed; values (rows) untouched
        self.rehashes += 1

    # ------------------------------------------------------------------ rows / values
    def _new_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows for new ``ids``, initialised ``init_std * hash_normal(id)`` (reused rows start fresh)."""
        count = ids.numel()
        reuse = self.free_rows[:count]
        del self.free_rows[:count]
        fresh = torch.arange(self.next_row, self.next_row + count - len(reuse), dtype=torch.int64)
        self.next_row += fresh.numel()
        while self.next_row > len(self.blocks) * self.block_rows:
            self.blocks.append(nn.Parameter(torch.zeros(self.block_rows, self.dim, dtype=self.dtype)))
        grow = self.next_row - self.last_seen.numel()
        if grow > 0:
            self.last_seen = torch.cat([self.last_seen, torch.zeros(grow, dtype=torch.int64)])
            self.counts = torch.cat([self.counts, torch.zeros(grow, dtype=torch.int64)])
        rows = torch.cat([torch.tensor(reuse, dtype=torch.int64), fresh])
        if reuse:
            self.counts[rows[:len(reuse)]] = 0
        values = hash_normal(ids, self.dim, self.seed) * self.init_std
        with torch.no_grad():
            for b in torch.unique(rows // self.block_rows).tolist():
                sel = rows // self.block_rows == b
                self.blocks[b][rows[sel] % self.block_rows] = values[sel].to(self.blocks[b].dtype)
        return rows

    def _gather(self, rows: torch.Tensor) -> torch.Tensor:
        if len(self.blocks) == 1:
            return self.blocks[0][rows]
        out = torch.zeros(rows.numel(), self.dim, dtype=self.blocks[0].dtype)
        block_of = rows // self.block_rows
        for b in torch.unique(block_of).tolist():
            sel = block_of == b
            out = out.index_put((sel.nonzero().squeeze(1),), self.blocks[b][rows[sel] % self.block_rows])
        return out

    # ------------------------------------------------------------------ public
    def check(self, ids: torch.Tensor) -> None:
        require_int_ids(self.name, ids)
        if ids.numel() and int(ids.min()) < 0:
            raise ValueError(f"{self.name}: ids must be >= 0 (negative ids are reserved), got {int(ids.min())}")

    def rows_of(self, ids: torch.Tensor, insert: bool = True) -> torch.Tensor:
        """Row per id (inserting unknown ids when ``insert``, else ``EMPTY`` for them)."""
        self.check(ids)
        flat = ids.reshape(-1).long()
        uniq, inverse = torch.unique(flat, return_inverse=True)
        slot, found = self._probe(uniq)
        rows = torch.where(found, self.rows[slot], EMPTY)
        if insert and not bool(found.all()):
            new = uniq[~found]
            self._grow_to(self.size + new.numel())
            new_rows = self._new_rows(new)
            self._place(new, new_rows)
            self.size += new.numel()
            rows[~found] = new_rows
        return rows[inverse].view(ids.shape)

    def forward(self, ids: torch.Tensor, insert: Optional[bool] = None) -> torch.Tensor:
        insert = self.training if insert is None else insert
        rows = self.rows_of(ids, insert=insert).reshape(-1)
        known = rows != EMPTY
        if self.next_row == 0:
            return torch.zeros(*ids.shape, self.dim, dtype=self.dtype)
        values = self._gather(torch.where(known, rows, 0))
        values = torch.where(known[:, None], values, 0.0)
        if bool(known.any()):
            seen = rows[known]
            self.last_seen[seen] = self.step
            self.counts.index_add_(0, seen, torch.ones_like(seen))
        return values.view(*ids.shape, self.dim)

    def tick(self) -> None:
        """Advance the step clock used by ``last_seen`` (call once per training step)."""
        self.step += 1

    def evict(self, drop: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> int:
        """Remove the ids whose rows satisfy ``drop(last_seen, counts) -> bool [rows]``; returns how many."""
        live = self.keys != EMPTY
        ids, rows = self.keys[live], self.rows[live]
        gone = drop(self.last_seen[rows], self.counts[rows])
        if not bool(gone.any()):
            return 0
        self.free_rows.extend(rows[gone].tolist())
        self.keys.fill_(EMPTY)
        self.rows.fill_(EMPTY)
        self._place(ids[~gone], rows[~gone])
        self.size -= int(gone.sum())
        return int(gone.sum())

    def new_blocks(self) -> list[nn.Parameter]:
        """Value blocks created since the last call (add them to an optimizer's param groups)."""
        fresh = list(self.blocks)[self._reported_blocks:]
        self._reported_blocks = len(self.blocks)
        return fresh

    # ------------------------------------------------------------------ checkpoints
    @torch.no_grad()
    def export_rows(self) -> dict:
        """What a checkpoint keeps of the table, per live id (sorted): ``ids``, ``values`` [n, D],
        ``adagrad`` [n] (the row-wise accumulator; None when no row has one yet), ``counts``,
        ``last_seen``, and the step clock ``step``. Independent of where the rows happen to lie
        (blocks, free list, key-table capacity): ``load_rows`` rebuilds a table from it, on any rank."""
        live = self.keys != EMPTY
        ids, rows = self.keys[live], self.rows[live]
        order = torch.argsort(ids)
        ids, rows = ids[order], rows[order]
        n = ids.numel()
        values = self._gather(rows).detach().clone() if n else torch.zeros(0, self.dim, dtype=self.dtype)
        adagrad = None
        if any(getattr(b, "_grcompile_adagrad", None) is not None for b in self.blocks):
            adagrad = torch.zeros(n, dtype=self.dtype)
            block_of = rows // self.block_rows
            for b in torch.unique(block_of).tolist():
                state = getattr(self.blocks[b], "_grcompile_adagrad", None)
                if state is not None:
                    sel = block_of == b
                    adagrad[sel] = state[rows[sel] % self.block_rows]
        return {"ids": ids, "values": values, "adagrad": adagrad, "counts": self.counts[rows].clone(),
                "last_seen": self.last_seen[rows].clone(), "step": self.step}

    @torch.no_grad()
    def load_rows(self, ids: torch.Tensor, values: torch.Tensor, *, adagrad: Optional[torch.Tensor] = None,
                  counts: Optional[torch.Tensor] = None, last_seen: Optional[torch.Tensor] = None,
                  step: int = 0) -> None:
        """Replace the whole table by these ids (distinct) and their rows (``export_rows``'s fields):
        rows ``0..n-1`` in the given order, no free rows, the key table as small as ``max_load`` allows
        (never below the current capacity). The value blocks are new parameters."""
        n = ids.numel()
        if values.shape != (n, self.dim):
            raise ValueError(f"{self.name}: {n} ids need values of shape [{n}, {self.dim}], got {tuple(values.shape)}")
        if n and torch.unique(ids).numel() != n:
            raise ValueError(f"{self.name}: the ids to load are not distinct")
        capacity = self.capacity
        while n > self.max_load * capacity:
            capacity *= 2
        self.keys = torch.full((capacity,), EMPTY, dtype=torch.int64)
        self.rows = torch.full((capacity,), EMPTY, dtype=torch.int64)
        n_blocks = -(-n // self.block_rows)
        self.blocks = nn.ParameterList()
        for b in range(n_blocks):
            block = torch.zeros(self.block_rows, self.dim, dtype=self.dtype)
            part = values[b * self.block_rows:(b + 1) * self.block_rows]
            block[:part.shape[0]] = part.to(self.dtype)
            param = nn.Parameter(block)
            if adagrad is not None:
                state = torch.zeros(self.block_rows, dtype=self.dtype)
                chunk = adagrad[b * self.block_rows:(b + 1) * self.block_rows]
                state[:chunk.numel()] = chunk.to(self.dtype)
                param._grcompile_adagrad = state
            self.blocks.append(param)
        self._reported_blocks = 0
        self.free_rows = []
        self.next_row = self.size = n
        self.counts = counts.clone().long() if counts is not None else torch.zeros(n, dtype=torch.int64)
        self.last_seen = last_seen.clone().long() if last_seen is not None else torch.zeros(n, dtype=torch.int64)
        self.step = int(step)
        self._place(ids.long().clone(), torch.arange(n, dtype=torch.int64))

    @torch.no_grad()
    def apply_gradients(self, lr: float, optimizer: str = "sgd", eps: float = 1e-8) -> None:
        """Fused row-wise update of the rows that got gradients (SGD or row-wise Adagrad)."""
        for block in self.blocks:
            if block.grad is None:
                continue
            g = block.grad
            if optimizer == "adagrad":
                state = getattr(block, "_grcompile_adagrad", None)
                if state is None:
                    state = block._grcompile_adagrad = torch.zeros(block.shape[0], dtype=block.dtype)
                state += g.pow(2).mean(dim=1)
                block -= lr * g / (state.sqrt()[:, None] + eps)
            elif optimizer == "sgd":
                block -= lr * g
            else:
                raise ValueError(f"{self.name}: optimizer must be 'sgd' or 'adagrad', got {optimizer!r}")
            block.grad = None


class ShardedDynamicEmbedding(ShardedEmbedding):
    """A ``DynamicEmbedding`` split over the ranks: id ``i`` lives in rank ``i % W``'s hash table
    (inserted there on first sight, so no two ranks ever hold one id), looked up with the same two
    all-to-alls and dedup stages as the static row-wise table."""

    def __init__(self, dim: int, *, name: str = "embedding", dedup: str = "two_stage",
                 group: Optional[dist.ProcessGroup] = None, seed: int = 0, **table_options) -> None:
        nn.Module.__init__(self)
        if dedup not in DEDUP_MODES:
            raise ValueError(f"dedup must be one of {DEDUP_MODES}, got {dedup!r}")
        self.dim, self.name, self.dedup, self.group = dim, name, dedup, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.table = DynamicEmbedding(dim, name=name, seed=seed, **table_options)
        self.stats = LookupStats()

    def check(self, ids: torch.Tensor) -> None:
        self.table.check(ids)

    def read_owned(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids)


__all__ = ["DynamicEmbedding", "EMPTY", "ShardedDynamicEmbedding", "hash_normal"]
