"""Run-time checks for jagged row-selection exits that the compile-time proof cannot decide.

Matches a row selection ``u`` of a region value ``x`` (``h.gather(1, (lengths - 1)...)``,
``h[:, -1]``, ``h[arange(B), idx]``, see ``jagged_exits``) whose reads ``prove_reads_valid`` cannot
bound: validity from a ``[B, N]`` ids input (left padding, holes), an index from a second input
(RecBole's ``item_seq_len``), or any selection in a graph compiled for symbolic B and N.

Emits a small graph over the captured graph's inputs that computes, before the optimized graph
runs, whether this call's reads satisfy the exit's contract: every element ``u`` reads lies at a
valid position, or in an empty row whose own output it is (the empty-row rule of
``jagged_exits``). It holds only the validity, the index and the selection on a ``[B, N]`` map
— O(B·N) integer work, no activation. The backend runs the optimized graph where the check holds
and the graph as captured where it does not, and reports that call (``capture/backend.py``).

Invariant: the jagged exit reads exactly the (row, position) elements the user's op reads, so
where every read is valid its values are the dense values; where one is not, nothing of the
optimized graph runs.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .effects import writes
from .layout import Token, propagate
from .op_semantics import canonical, is_random, shape_of
from .symbolic import static_int

__all__ = ["build_read_check", "reads_satisfy_exit", "recompute_before", "spread_over"]

_MAX_NODES = 256
# ops the check may recompute: cheap, deterministic, row-local or size arithmetic
_ALLOWED = {"ne", "eq", "gt", "ge", "lt", "le", "and", "or", "not", "add", "sub", "mul", "div", "neg", "unary",
            "where", "masked_fill", "unsqueeze", "squeeze", "reshape", "expand", "transpose", "permute", "arange",
            "factory", "reduce", "getitem", "repeat", "tril", "triu", "cat"}
# integer shifts and fills of a [B, N] tensor (next-item targets: ``torch.roll(ids, -1, 1)``,
# ``F.pad(ids[:, 1:], (0, 1))``, ``ids.new_full((B, 1), pad)``), matched here by name: they have no
# canonical name, the layout rules know no shift, and a shape-changing factory must not tie axes
_SHIFTS = (torch.roll, torch.nn.functional.pad, torch._C._nn.pad)
_SHIFT_METHODS = ("roll", "new_full", "new_zeros", "new_ones")
# integer index arithmetic without a canonical name, matched by target and recomputed only on
# integer / bool tensors (exact, whatever computes it): HF's last-token index
# ``(ids.eq(pad).int().argmax(-1) - 1) % N``, ``x // k``, position ids ``valid.cumsum(-1) - 1``
_INDEX_FUNCTIONS = (operator.mod, operator.floordiv, torch.remainder, torch.floor_divide, torch.argmax, torch.argmin,
                    torch.cumsum)
_INDEX_METHODS = ("remainder", "__mod__", "floor_divide", "__floordiv__", "argmax", "argmin", "cumsum")


def spread_over(t: torch.Tensor, ndim: int, batch: int, seq: int, features: dict[int, int]) -> torch.Tensor:
    """A ``[B, N]`` map laid out on the axes of a ``[.., B, .., N, ..]`` value (features expanded)."""
    B, N = t.shape
    sizes = [1] * ndim
    sizes[batch], sizes[seq] = B, N
    t = t.transpose(0, 1) if batch > seq else t
    full = list(sizes)
    for axis, size in features.items():
        full[axis] = size
    return t.reshape(sizes).expand(full)


def row_map(valid: torch.Tensor) -> torch.Tensor:
    """``[B, N]``: the row of each (row, position)."""
    B, N = valid.shape
    return torch.arange(B, device=valid.device).reshape(B, 1).expand(B, N)


def reads_satisfy_exit(valid: torch.Tensor, read_valid: torch.Tensor, read_rows: torch.Tensor,
                       row_axes: tuple[int, ...]) -> bool:
    """Every read lands on a valid position, or in an empty row that is the output's own row (the
    read row equals the output coordinate along one of its axes of size B among ``row_axes``: the
    axes whose values stay in their row downstream, ``jagged_exits.confined_row_axes``)."""
    if read_valid.numel() == 0:
        return True
    nonempty = valid.bool().any(dim=1)
    if not bool((read_valid.bool() | ~nonempty[read_rows]).all()):
        return False
    if bool(nonempty[read_rows].all()):
        return True  # every read is valid: which row it came from is the user's own choice
    B = valid.shape[0]
    for axis in range(read_rows.dim()):
        if read_rows.shape[axis] != B or axis not in row_axes:
            continue
        coord = torch.arange(B, device=read_rows.device).reshape([B if a == axis else 1 for a in range(read_rows.dim())])
        if torch.equal(read_rows, coord.expand_as(read_rows)):
            return True
    return False


def build_read_check(gm: fx.GraphModule, u: fx.Node, x: fx.Node, layout: Token, valid: fx.Node,
                     written: dict[fx.Node, list[fx.Node]], row_axes: set[int]) -> fx.GraphModule | str:
    """A graph over ``gm``'s inputs returning True when this call's reads of ``u`` satisfy the
    jagged exit (module docstring), or why no such check can be built (a sentence). ``written``:
    ``effects.written_aliases`` of the graph."""
    shape = shape_of(x)
    if shape is None:
        return f"the shape of {x.name} is unknown"
    kept = propagate(u, {x: layout})
    if isinstance(kept, Token) and kept.seq is not None:
        # a view of every position (x[:, :, None], x[..., :k]): it reads the padded positions of
        # every partly padded row, so the check would fail on every call that has one
        return f"{u.name} keeps every position of {x.name} (it selects no positions), padded ones included"
    features: dict[int, int] = {}
    for axis, size in enumerate(shape):
        if axis in (layout.batch, layout.seq):
            continue
        s = static_int(size)
        if s is None:
            return f"{x.name} has a feature axis of symbolic size {size}"
        features[axis] = s
    copied = recompute_before(gm, [valid, *[a for a in u.all_input_nodes if a is not x]], x, written)
    if isinstance(copied, str):
        return copied
    g, env = copied
    nd = len(shape)
    spread = (nd, layout.batch, layout.seq, features)
    valid_x = g.call_function(spread_over, (g.call_function(torch.Tensor.bool, (env[valid],)), *spread))
    rows_x = g.call_function(spread_over, (g.call_function(row_map, (env[valid],)), *spread))
    read_valid = g.node_copy(u, lambda a: valid_x if a is x else env[a])
    read_rows = g.node_copy(u, lambda a: rows_x if a is x else env[a])
    g.output(g.call_function(reads_satisfy_exit, (env[valid], read_valid, read_rows, tuple(sorted(row_axes)))))
    return fx.GraphModule(gm, g, class_name="ExitReadCheck")


def recompute_before(gm: fx.GraphModule, starts: list[fx.Node], avoid: fx.Node | None,
                     written: dict, read_at: fx.Node | None = None) -> tuple[fx.Graph, dict[fx.Node, fx.Node]] | str:
    """A new graph over ``gm``'s inputs recomputing ``starts`` (cheap, deterministic ops only,
    never ``avoid``), and the map from ``gm``'s nodes to their copies; or why it cannot be built.
    It runs before the graph, so nothing it reads may be written in place (``written``) — except,
    with ``read_at`` (where the graph reads ``starts``), a tensor the graph creates and then writes
    before ``read_at`` (``labels = ids.clone(); labels[ids == 0] = -100``): those writes are
    replayed, in program order, on the check's own copy; one that may write into an input is not."""
    needed = _ancestors(starts, avoid)
    if isinstance(needed, str):
        return needed
    replayed: set[fx.Node] = set()
    if read_at is not None:
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        writes_into: dict[fx.Node, list[fx.Node]] = {}
        for value, ws in written.items():
            for w in ws:
                writes_into.setdefault(w, []).append(value)
        while True:
            new = {w for n in needed for w in written.get(n, ()) if order[w] < order[read_at]} - replayed
            if not new:
                break
            for w in sorted(new, key=order.__getitem__):
                if any(v.op in ("placeholder", "get_attr") for v in writes_into.get(w, ())):
                    return f"{w.name} may write into an input of the graph, so it cannot be replayed before the graph runs"
                if w.op not in ("call_function", "call_method") or is_random(w):
                    return f"{w.name} cannot be replayed before the graph runs (random or not a plain op)"
            more = _ancestors([a for w in new for a in w.all_input_nodes], avoid)
            if isinstance(more, str):
                return more
            needed |= more
            replayed |= new
        # a write after ``read_at`` is not copied: the graph reads the values before it, and so does the check
    elif (hit := next((n for n in needed if n in written), None)) is not None:
        return f"{hit.name} is written in place ({written[hit][0].name}), so it cannot be checked before the graph runs"
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = g.placeholder(n.name, type_expr=n.type)
            env[n].meta.update(n.meta)
        elif n in needed or n in replayed:
            env[n] = g.node_copy(n, lambda a: env[a])
    return g, env


def _ancestors(starts: list[fx.Node], x: fx.Node | None) -> set[fx.Node] | str:
    """The nodes computing ``starts`` from the graph's inputs with cheap, deterministic ops (no
    embedding, linear, matmul or softmax: so none of them is an activation); else why not."""
    seen: set[fx.Node] = set()
    stack = list(starts)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if n.op == "placeholder":
            seen.add(n)  # copied as a placeholder; kept here for the in-place-write test
            continue
        if n is x:
            return f"the index is computed from the selected value {x.name} itself"
        seen.add(n)
        if len(seen) > _MAX_NODES:
            return "the checked values take too many operations to recompute"
        if n.op == "get_attr":
            continue
        if n.op not in ("call_function", "call_method") or writes(n) or is_random(n):
            return f"{n.name} cannot be recomputed before the graph runs (random, in place or not a plain op)"
        op = canonical(n)
        if op not in _ALLOWED and not _size_arithmetic(n) and not _shift(n) and not _integer_index_op(n):
            return f"the checked values are computed with {n.name}, which a run-time check does not recompute"
        stack.extend(n.all_input_nodes)
    return seen


def _integer_index_op(n: fx.Node) -> bool:
    """An op of ``_INDEX_FUNCTIONS`` / ``_INDEX_METHODS`` whose result and tensor inputs are all
    integer or bool (no float rounding that another lowering could do differently)."""
    if n.op == "call_method":
        if n.target not in _INDEX_METHODS:
            return False
    else:
        try:
            if n.target not in _INDEX_FUNCTIONS:
                return False
        except TypeError:  # unhashable target
            return False
    for t in (n, *n.all_input_nodes):
        value = t.meta.get("example_value")
        if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
            return False
        if isinstance(value, float):
            return False
    return True


def _shift(n: fx.Node) -> bool:
    if n.op == "call_method":
        return n.target in _SHIFT_METHODS
    try:
        return n.target in _SHIFTS
    except TypeError:  # unhashable target
        return False


def _size_arithmetic(n: fx.Node) -> bool:
    """``x.size(1)``, ``sym_size``, int arithmetic on sizes: no tensor comes out."""
    if n.op == "call_method" and n.target in ("size", "dim"):
        return True
    value = n.meta.get("example_value")
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)
