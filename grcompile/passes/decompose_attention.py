"""Library attention spelled out, so that ``fuse_attention`` can match it (a step of that pass).

Matches: ``F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale)`` whose
q, k, v are per-token tensors ``[.., N, d]``, and ``F.multi_head_attention_forward`` — what Dynamo
records for ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` (their Python path; the
native fast paths are switched off around grcompile's calls, see ``python_attention_paths``).
Also functionalises ``zeros_like(m).masked_fill_(m, -inf)`` (how torch turns a bool mask into an
additive one) when nothing else reads the filled tensor.
Emits: SDPA's math as torch ops — ``q @ kᵀ · scale``, the causal / bool / additive mask,
``softmax(-1)``, ``dropout``, ``@ v`` — and for MHA the in- and out-projections around it on
``[B, H, N, d]`` views of the ``[N, B, E]`` inputs, so that layouts follow the batch and
sequence axes (torch's own code folds heads into the batch axis, which no layout can follow).
Invariant: the library call stays in the graph, its users moved to the expansion; ``restore``
moves them back when ``fuse_attention`` did not fuse the expansion, so a slower spelling is never
left behind. Values equal SDPA's (and MHA's) up to float rounding; a query row whose keys are all
masked gives 0 in SDPA, which the fused op also gives (``Expansion.empty_rows_zero``).
Counters (in ``fuse_attention``): ``sdpa_expanded``, ``mha_expanded``, ``masked_fill_functionalised``.
"""
from __future__ import annotations

import math
import operator
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn.functional as F

from .effects import fresh
from .layout import Token
from .op_semantics import arg, canonical, example, shape_of

SDPA = F.scaled_dot_product_attention
MHA = F.multi_head_attention_forward
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
_MHA_ARGS = ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias",
             "bias_k", "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias", "training",
             "key_padding_mask", "need_weights", "attn_mask", "use_separate_proj_weight", "q_proj_weight",
             "k_proj_weight", "v_proj_weight", "static_k", "static_v", "average_attn_weights", "is_causal")
_MHA_DEFAULTS = {"training": True, "key_padding_mask": None, "need_weights": True, "attn_mask": None,
                 "use_separate_proj_weight": False, "q_proj_weight": None, "k_proj_weight": None,
                 "v_proj_weight": None, "static_k": None, "static_v": None, "average_attn_weights": True,
                 "is_causal": False}
LABELS = {"sdpa": "F.scaled_dot_product_attention", "mha": "nn.MultiheadAttention"}


@dataclass
class Expansion:
    kind: str  # "sdpa" | "mha"
    original: fx.Node  # the library call; kept in the graph until fuse_attention decides
    output: fx.Node  # the node the user's code reads (the call itself, or getitem(call, 0))
    result: fx.Node  # the expansion's last node, which now stands for ``output``
    contraction: fx.Node  # its ``weights @ v``: what fuse_attention must fuse
    empty_rows_zero: bool  # eager gives 0 on a query row whose keys are all masked with -inf
    reason: str = ""  # why fuse_attention did not fuse it (set by the pass)

    @property
    def label(self) -> str:
        return LABELS[self.kind]


class _Refused(Exception):
    pass


def _bind(node: fx.Node, names: tuple[str, ...], defaults: dict[str, Any]) -> dict[str, Any]:
    bound = dict(defaults)
    bound.update(zip(names, node.args))
    bound.update(node.kwargs)
    missing = [n for n in names if n not in bound]
    if missing:
        raise _Refused(f"missing argument(s) {missing}")
    return bound


FUNCTIONALISED = "grcompile_functionalised_fill"  # meta key: a scores fill made out-of-place


def functionalise_masked_fill(gm: fx.GraphModule) -> int:
    """``t.masked_fill_(m, v)`` → ``t.masked_fill(m, v)`` where ``t`` is a fresh tensor from a
    factory (``zeros_like``, ``full``, ...) read by nothing else — torch's bool→additive mask
    conversion: the same value, and no other tensor shares its storage (a view would).

    Also the scores of a spelled-out attention filled in place (nanoGPT's
    ``att.masked_fill_(mask, -inf)``; Dynamo keeps the write, and the softmax reads ``att``'s
    original node): where ``t`` is a fresh tensor (``q @ kᵀ``, a product, an earlier fill: no
    other value shares its storage), a softmax reads it after the fill, and nothing that reads it
    before the fill may alias it, the fill becomes ``f = t.masked_fill(m, v)`` and every reader of ``t`` after it reads ``f`` — the
    values each reader sees are unchanged. Such a fill is marked (``FUNCTIONALISED``):
    ``refill_in_place`` writes it back in place if it is still in the graph after fusion (one
    ``[B, H, N, N]`` copy less).
    """
    count = 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if node.op != "call_method" or node.target != "masked_fill_" or not node.args:
            continue
        t = node.args[0]
        if not isinstance(t, fx.Node):
            continue
        if canonical(t) == "factory" and set(t.users) == {node}:
            node.target = "masked_fill"
            count += 1
            continue
        if not fresh(t) or not isinstance(example(t), torch.Tensor):
            continue
        before = [u for u in t.users if u is not node and order[u] < order[node]]
        if any(not fresh(u) for u in before):  # a view taken before the fill sees it
            continue
        later = [u for u in t.users if u is not node and order[u] > order[node]]
        if not any(canonical(u) == "softmax" for u in later):  # attention scores only
            continue
        node.target = "masked_fill"
        node.meta[FUNCTIONALISED] = True
        for u in later:
            u.replace_input_with(t, node)
        count += 1
    return count


def functionalise_whole_setitem(gm: fx.GraphModule) -> int:
    """``x[index] = v`` where ``index`` keeps every axis of ``x`` whole (``None`` / ``...`` / ``:`` /
    ``:n`` with ``n`` at least the axis' size: HF's ``causal_mask[..., :mask_length] = ...``) →
    ``x2 = v.to(x.dtype).expand_as(x).clone()``, every reader of ``x`` after the write reading
    ``x2`` — the value the write leaves in ``x``. Only where ``x`` is a fresh tensor that nothing
    else writes, and every view of it taken before the write is read only before it (so no
    reader sees ``x``'s storage other than through ``x`` after the write). Returns how many."""
    from .attention_capture import whole_view_index
    from .effects import WriteOrder, _may_alias_input

    count = 0
    nodes = list(gm.graph.nodes)
    for node in nodes:
        if node.op != "call_function" or node.target is not operator.setitem or len(node.args) != 3 or node.users:
            continue
        x, index, v = node.args
        ex = example(x)
        if not isinstance(x, fx.Node) or not isinstance(ex, torch.Tensor) or not fresh(x):
            continue
        items = index if isinstance(index, tuple) else (index,)
        if any(i is None for i in items) or not whole_view_index(x, index):
            continue  # (x[None] = v: v may carry the new axis, expand_as(x) would not fit it)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        if WriteOrder(gm.graph).writes_to.get(x) != [node]:
            continue  # another write into x's storage: keep the program as written
        ok = True
        stack = [u for u in x.users if u is not node and order[u] < order[node]]
        while stack and ok:  # what reads x before the write: fresh results, or views read only before it
            u = stack.pop()
            if not _may_alias_input(u):
                continue
            if any(order[w] >= order[node] for w in u.users):
                ok = False
            stack.extend(u.users)
        if not ok:
            continue
        if isinstance(v, fx.Node) and not isinstance(example(v), torch.Tensor):
            continue
        later = [u for u in x.users if order[u] > order[node]]
        with gm.graph.inserting_before(node):
            if isinstance(v, fx.Node):
                value = gm.graph.call_method("to", (v, ex.dtype))
                value = gm.graph.call_method("expand_as", (value, x))
                new = gm.graph.call_method("clone", (value,), {"memory_format": torch.contiguous_format})
            elif isinstance(v, (bool, int, float)):
                new = gm.graph.call_function(torch.full_like, (x, v))
            else:
                continue
        for n in (new, *new.all_input_nodes):
            if n is not x and n is not v and node.meta.get("stack_trace"):
                n.meta["stack_trace"] = node.meta["stack_trace"]
        for u in later:
            u.replace_input_with(x, new)
        gm.graph.erase_node(node)
        count += 1
    return count


def refill_in_place(gm: fx.GraphModule) -> int:
    """Undo ``functionalise_masked_fill``'s scores rewrite where the fill survived fusion (the
    attention was not fused, or the filled scores are read elsewhere): ``t.masked_fill_(m, v)``
    again, its readers reading ``t`` after it. Returns how many."""
    count = 0
    for node in list(gm.graph.nodes):
        if not node.meta.pop(FUNCTIONALISED, False) or node.op != "call_method" or node.target != "masked_fill":
            continue
        node.replace_all_uses_with(node.args[0])  # the filled tensor (an earlier fill's already restored)
        node.target = "masked_fill_"
        count += 1
    return count


def unbind_as_chunks(gm: fx.GraphModule) -> int:
    """``x.unbind(d)[i]`` → ``x.chunk(n, d)[i].squeeze(d)`` (``q, k, v = qkv.unbind(2)``): the same
    values through ops whose axis semantics the layouts know."""
    count = 0
    for node in list(gm.graph.nodes):
        if canonical(node) != "unbind" or not isinstance(node.args[0], fx.Node) or shape_of(node.args[0]) is None:
            continue
        users = list(node.users)
        if not users or any(u.op != "call_function" or u.target is not operator.getitem or
                            not isinstance(u.args[1], int) for u in users):
            continue
        shape = shape_of(node.args[0])
        d = arg(node, 1, "dim", 0) % len(shape)
        with gm.graph.inserting_before(node):
            chunks = gm.graph.call_method("chunk", (node.args[0], shape[d], d))
            for u in users:
                with gm.graph.inserting_before(u):
                    piece = gm.graph.call_function(operator.getitem, (chunks, u.args[1]))
                    new = gm.graph.call_method("squeeze", (piece, d))
                for n in (chunks, piece, new):
                    n.meta.setdefault("stack_trace", node.meta.get("stack_trace"))
                u.replace_all_uses_with(new)
                gm.graph.erase_node(u)
        gm.graph.erase_node(node)
        count += 1
    return count


def _size(g: fx.Graph, x: fx.Node, dim: int) -> Any:
    """``x.size(dim)`` as an int when static, else as a graph node (symbolic sizes)."""
    shape = example(x).shape
    s = shape[dim]
    return int(s) if isinstance(s, int) else g.call_method("size", (x, dim))


def _tensor(x: Any) -> bool:
    return isinstance(x, fx.Node) and isinstance(example(x), torch.Tensor)


def attention_math(g: fx.Graph, q: fx.Node, k: fx.Node, v: fx.Node, mask: Any, mask_is_bool: bool,
                   dropout_p: float, is_causal: bool, scale: float) -> tuple[fx.Node, fx.Node]:
    """SDPA's math (``torch.nn.functional.scaled_dot_product_attention`` docs) as graph nodes:
    returns ``(out, contraction)``. Masks: bool → ``masked_fill(~m, -inf)``, float → added."""
    s = g.call_function(torch.matmul, (q, g.call_method("transpose", (k, -2, -1))))
    s = g.call_function(operator.mul, (s, scale))
    if is_causal:  # top-left aligned lower triangle, like SDPA's
        ones = g.call_function(torch.ones, (_size(g, q, -2), _size(g, k, -2)),
                               {"dtype": torch.bool, "device": example(q).device})
        allowed = g.call_method("tril", (ones,))
        s = g.call_method("masked_fill", (s, g.call_function(operator.invert, (allowed,)), -math.inf))
    if mask is not None:
        if mask_is_bool:
            s = g.call_method("masked_fill", (s, g.call_function(operator.invert, (mask,)), -math.inf))
        else:
            s = g.call_function(operator.add, (s, mask))
    a = g.call_function(torch.softmax, (s, -1))
    if dropout_p > 0:
        a = g.call_function(F.dropout, (a, dropout_p, True))
    out = g.call_function(torch.matmul, (a, v))
    return out, out


def _is_token_seq(layouts: dict, x: Any, seq: int) -> bool:
    layout = layouts.get(x) if isinstance(x, fx.Node) else None
    return isinstance(layout, Token) and layout.seq is not None and layout.seq == seq % layout.ndim


def _expand_sdpa(g: fx.Graph, node: fx.Node, layouts: dict) -> tuple[fx.Node, fx.Node]:
    a = _bind(node, _SDPA_ARGS, _SDPA_DEFAULTS)
    q, k, v = a["query"], a["key"], a["value"]
    if not all(_tensor(x) for x in (q, k, v)):
        raise _Refused("its q, k, v are not tensors of the graph")
    if not all(_is_token_seq(layouts, x, -2) for x in (q, k, v)):
        raise _Refused("its q, k, v are not per-token tensors [.., N, d] of the padded batch")
    if a["enable_gqa"] and shape_of(q)[-3:-2] != shape_of(k)[-3:-2]:
        raise _Refused("grouped-query attention (enable_gqa with fewer key heads) is not expanded")
    for name in ("dropout_p", "is_causal", "scale"):
        if isinstance(a[name], fx.Node):
            raise _Refused(f"{name} is computed in the graph")
    mask = a["attn_mask"]
    if mask is not None and not _tensor(mask):
        raise _Refused("attn_mask is not a tensor")
    if mask is not None and a["is_causal"]:
        raise _Refused("attn_mask together with is_causal")
    scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(example(q).shape[-1])
    mask_is_bool = mask is not None and example(mask).dtype == torch.bool
    return attention_math(g, q, k, v, mask, mask_is_bool, float(a["dropout_p"]), bool(a["is_causal"]), float(scale))


def _per_head(g: fx.Graph, mask: fx.Node, B: Any, H: int, depth: int = 6) -> fx.Node | None:
    """A ``[B·H, L, S]`` mask as ``[B, H|1, L, S]``: through ``repeat_interleave(m, H, 0)`` of a
    ``[B, L, S]`` mask (and the pointwise ops torch applies on top, e.g. the bool→float fill), so
    that the result still has a batch axis layouts can follow. None when it is not of that form."""
    op = canonical(mask)
    if op == "repeat_interleave" and arg(mask, 1, "repeats") == H and arg(mask, 2, "dim") in (0, -3):
        inner = mask.args[0]
        if isinstance(inner, fx.Node) and len(shape_of(inner) or ()) == 3:
            return g.call_method("unsqueeze", (inner, 1))
        return None
    if depth == 0 or op not in ("not", "unary", "masked_fill", "add", "mul", "where", "factory"):
        return None
    if op == "factory" and getattr(mask.target, "__name__", "") not in ("zeros_like", "ones_like", "full_like"):
        return None
    changed = False

    def sub(x: Any) -> Any:
        nonlocal changed
        if isinstance(x, fx.Node) and len(shape_of(x) or ()) == 3:
            y = _per_head(g, x, B, H, depth - 1)
            if y is None:
                raise _Refused("mask")
            changed = True
            return y
        if isinstance(x, fx.Node) and len(shape_of(x) or ()) > 0:
            raise _Refused("mask")  # a broadcast operand: keep it simple, give up
        return x

    try:
        args = fx.node.map_arg(mask.args, sub)
        kwargs = fx.node.map_arg(mask.kwargs, sub)
    except _Refused:
        return None
    if not changed:
        return None
    if mask.op == "call_method":
        return g.call_method(mask.target, args, kwargs)
    return g.call_function(mask.target, args, kwargs)


def _expand_mha(g: fx.Graph, node: fx.Node, layouts: dict) -> tuple[fx.Node, fx.Node]:
    a = _bind(node, _MHA_ARGS, _MHA_DEFAULTS)
    query, key, value = a["query"], a["key"], a["value"]
    if not all(_tensor(x) and len(example(x).shape) == 3 for x in (query, key, value)):
        raise _Refused("unbatched inputs")
    if not all(_is_token_seq(layouts, x, 0) and layouts[x].batch == 1 for x in (query, key, value)):
        raise _Refused("its query, key and value are not [N, B, E] per-token tensors of the padded batch")
    for name in ("bias_k", "bias_v", "static_k", "static_v"):
        if a[name] is not None:
            raise _Refused(f"{name} is set (extra key/value rows)")
    if a["add_zero_attn"]:
        raise _Refused("add_zero_attn adds a key row")
    for name in ("num_heads", "dropout_p", "training", "need_weights", "is_causal", "use_separate_proj_weight"):
        if isinstance(a[name], fx.Node):
            raise _Refused(f"{name} is computed in the graph")
    H, E = int(a["num_heads"]), int(example(query).shape[-1])
    hd = E // H
    L, B = _size(g, query, 0), _size(g, query, 1)
    S = _size(g, key, 0)
    w, b = a["in_proj_weight"], a["in_proj_bias"]
    chunk = lambda x, n: [g.call_function(operator.getitem, (g.call_method("chunk", (x, n, -1)), i))  # noqa: E731
                          for i in range(n)]
    if not a["use_separate_proj_weight"] and query is key and key is value:
        q, k, v = chunk(g.call_function(F.linear, (query, w, b)), 3)  # one GEMM, torch's [q | k | v] order
    else:
        if a["use_separate_proj_weight"]:
            wq, wk, wv = a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"]
        else:
            wq, wk, wv = (g.call_function(operator.getitem, (g.call_method("chunk", (w, 3)), i)) for i in range(3))
        bq = bk = bv = None
        if b is not None:
            bq, bk, bv = (g.call_function(operator.getitem, (g.call_method("chunk", (b, 3)), i)) for i in range(3))
        q = g.call_function(F.linear, (query, wq, bq))
        k = g.call_function(F.linear, (key, wk, bk))
        v = g.call_function(F.linear, (value, wv, bv))

    def heads(x: fx.Node, n: Any) -> fx.Node:  # [n, B, E] -> [B, H, n, hd]
        return g.call_method("permute", (g.call_method("view", (x, n, B, H, hd)), 1, 2, 0, 3))

    q, k, v = heads(q, L), heads(k, S), heads(v, S)
    dtype = example(query).dtype

    def canonical_mask(m: Any, is_bool: bool) -> Any:  # F._canonical_mask: bool -> 0 / -inf in the query's dtype
        if m is None or not is_bool:
            return m
        zeros = g.call_function(torch.zeros_like, (m,), {"dtype": dtype})
        return g.call_method("masked_fill", (zeros, m, -math.inf))

    kpm, attn_mask = a["key_padding_mask"], a["attn_mask"]
    need_weights, is_causal = bool(a["need_weights"]), bool(a["is_causal"])
    if is_causal and kpm is None and not need_weights:
        attn_mask = None  # SDPA's own causal mask
    else:
        attn_mask = canonical_mask(attn_mask, example(attn_mask).dtype == torch.bool if attn_mask is not None else False)
        is_causal = False  # a hint only: attn_mask is applied (and it is required with is_causal)
    kpm = canonical_mask(kpm, kpm is not None and example(kpm).dtype == torch.bool)
    if attn_mask is not None:
        nd = len(shape_of(a["attn_mask"]) or ())
        if nd == 2:
            attn_mask = g.call_method("view", (attn_mask, 1, 1, L, S))
        elif nd == 3:
            per_head = _per_head(g, a["attn_mask"], B, H)
            if per_head is not None and attn_mask is not a["attn_mask"]:
                per_head = canonical_mask(per_head, True)
            attn_mask = per_head if per_head is not None else g.call_method("view", (attn_mask, B, H, L, S))
        else:
            raise _Refused(f"a {nd}-D attn_mask")
    if kpm is not None:
        kpm = g.call_method("view", (kpm, B, 1, 1, S))
        attn_mask = kpm if attn_mask is None else g.call_function(operator.add, (attn_mask, kpm))
    dropout_p = float(a["dropout_p"]) if a["training"] else 0.0
    out, contraction = attention_math(g, q, k, v, attn_mask, False, dropout_p, is_causal, 1.0 / math.sqrt(hd))
    out = g.call_method("reshape", (g.call_method("permute", (out, 2, 0, 1, 3)), L, B, E))
    out = g.call_function(F.linear, (out, a["out_proj_weight"], a["out_proj_bias"]))
    return out, contraction


def _mha_output(node: fx.Node) -> fx.Node:
    """The ``getitem(call, 0)`` the user's code reads; refuses when the weights are read."""
    getters = {}
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem or user.args[1] not in (0, 1):
            raise _Refused("its result tuple is used as a whole")
        getters.setdefault(user.args[1], []).append(user)
    if any(u.users for u in getters.get(1, [])):
        raise _Refused("the attention weights are returned (need_weights=True) and read: they are a "
                       "[B, N, N] output the fused op does not produce")
    if len(getters.get(0, [])) != 1:
        raise _Refused("its output is not read")
    return getters[0][0]


def expand_library_attention(gm: fx.GraphModule, layouts: dict) -> tuple[list[Expansion], list[tuple[fx.Node, str]]]:
    """Expand every SDPA / MHA call whose inputs are per-token tensors (see the module docstring).
    Returns the expansions and, for the calls left as written, ``(node, reason)``."""
    g = gm.graph
    expansions: list[Expansion] = []
    refused: list[tuple[fx.Node, str]] = []
    for node in list(g.nodes):
        if node.op != "call_function" or node.target not in (SDPA, MHA):
            continue
        kind = "sdpa" if node.target is SDPA else "mha"
        before = set(g.nodes)
        try:
            output = node if kind == "sdpa" else _mha_output(node)
            with g.inserting_before(node):
                result, contraction = (_expand_sdpa if kind == "sdpa" else _expand_mha)(g, node, layouts)
        except _Refused as e:
            for n in reversed([n for n in g.nodes if n not in before]):  # drop a partial expansion
                if not n.users:
                    g.erase_node(n)
            refused.append((node, f"{LABELS[kind]} kept as written: {e}"))
            continue
        for n in g.nodes:
            if n not in before and node.meta.get("stack_trace"):
                n.meta["stack_trace"] = node.meta["stack_trace"]  # reports name the user's line
        output.replace_all_uses_with(result)
        empty_rows_zero = kind == "sdpa" or not bool(_bind(node, _MHA_ARGS, _MHA_DEFAULTS)["need_weights"])
        expansions.append(Expansion(kind, node, output, result, contraction, empty_rows_zero))
    return expansions, refused


def restore(gm: fx.GraphModule, expansion: Expansion) -> None:
    """Give the library call its users back; the expansion becomes dead code."""
    expansion.result.replace_all_uses_with(expansion.output)


_DEFERRED_WARNINGS: list[str] = []
_TORCH_CANONICAL_MASK = F._canonical_mask


def _canonical_mask_deferred(mask, mask_name, other_type, other_name, target_type, check_other=True):
    """``F._canonical_mask`` (torch 2.13), except that its deprecation warning about mismatched mask
    types is recorded instead of issued: Dynamo cannot trace ``warnings.warn`` inside torch's
    modules and breaks the graph there. ``python_attention_paths`` issues it after the call."""
    if mask is not None:
        mask_is_float = torch.is_floating_point(mask)
        if mask.dtype != torch.bool and not mask_is_float:
            raise AssertionError(f"only bool and floating types of {mask_name} are supported")
        if check_other and other_type is not None and mask.dtype != other_type:
            _DEFERRED_WARNINGS.append(f"Support for mismatched {mask_name} and {other_name} is deprecated. "
                                      "Use same type for both instead.")
        if not mask_is_float:
            mask = torch.zeros_like(mask, dtype=target_type).masked_fill_(mask, float("-inf"))
    return mask


def _same_signature(a, b) -> bool:
    return a.__code__.co_varnames[:a.__code__.co_argcount] == b.__code__.co_varnames[:b.__code__.co_argcount]


@contextmanager
def python_attention_paths() -> Iterator[None]:
    """For the scope of one call of an optimized model:

    * switch off the native fast paths of ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer``
      (``torch._native_multi_head_attention``, ``torch._transformer_encoder_layer_fwd``: opaque ops
      taken in eval mode under ``no_grad``), so that Dynamo records their Python path, which
      computes the same values and which the passes can fuse. Dynamo guards on the flag, so it
      must hold on every call, not only while compiling;
    * defer torch's warning about a float mask beside a bool key padding mask (the usual pair:
      ``generate_square_subsequent_mask`` with ``src_key_padding_mask=ids == pad``): issued inside
      ``nn.TransformerEncoder`` / ``nn.MultiheadAttention``, it is a graph break at which the whole
      encoder ran eagerly. The same warning is issued after the call."""
    flag = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    patch = F._canonical_mask is _TORCH_CANONICAL_MASK and _same_signature(F._canonical_mask, _canonical_mask_deferred)
    if patch:
        F._canonical_mask = _canonical_mask_deferred
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(flag)
        if patch:
            F._canonical_mask = _TORCH_CANONICAL_MASK
        pending = list(dict.fromkeys(_DEFERRED_WARNINGS))
        _DEFERRED_WARNINGS.clear()
        for message in pending:
            warnings.warn(message, UserWarning, stacklevel=3)
