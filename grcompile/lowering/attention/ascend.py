"""Ascend lowering of ``grcompile::jagged_attention`` (and its backward): a call maps to Ascend
RecSDK's ``torch.ops.mxrec.hstu_jagged`` when the semantics match, else the reference runs and
``OPS[...].fallbacks`` says why. **Nothing here has run on an NPU**: the tests check the calls
against CPU stubs of the mxrec schemas (tests/lowering/mxrec_stub.py).

Matches: ``activation="silu"`` with no score_mod, a built-in bias (:func:`.score_mod.hstu_rab_key`,
``relative_position_bias_key``, ``relative_time_bias_key``) or any score_mod that is provably
``a·score + b`` (``b`` independent of the score); or ``activation="identity"`` with a captured
``score``-kind score_mod of the form ``silu(a·score + b) · P`` (``P`` a product of score-independent
factors: what the attention-capture pass makes of ``F.silu(q @ kᵀ + rab) / N * mask``).
Emits::

    torch.ops.mxrec.hstu_jagged.equal(q, k, v, mask=M, attn_bias=β, mask_type=t, max_seq_len=S,
                                      silu_scale=c, seq_offset=offsets, alpha=α)

with ``α = a·scale``, ``β = b / α`` as a dense ``[B, H, S, S]`` tensor in q's dtype (``S`` = the
longest row of the call), ``t = 0`` (built-in lower triangle) when causal else ``2`` (none), or
``t = 3`` with ``M = P·tril`` dense when ``P`` is a tensor, ``c = out_scale·P`` when ``P`` is a
number. The backward calls ``torch.ops.mxrec.hstu_jagged_backward.equal`` (same arguments, plus
the output gradient) for dq, dk, dv and ``dβ``; the gradients of the tables and float side tensors
are ``dβ / α`` pulled back through ``b`` evaluated on the grid with autograd (plain torch ops). mxrec
returns no gradient for its mask: when ``P`` depends on a float input (a float validity, a learned
factor), ``dP = (g·vᵀ) ⊙ silu(α·(q·kᵀ + β)) · out_scale`` is computed on the grid in plain torch
(two dense ``[B, H, S, S]`` products) and pulled back the same way.
Built-in biases: the position table goes through ``mxrec.relative_attn_bias_pos`` (a Toeplitz
``[S', S']`` gathered from the table, ``S'`` = S rounded up to even — the op's matrix is
``(2s, 2s)`` and its kernel reads rows with stride ``2·(n // 2)`` — zero ``identity``,
``past_valid_lens = min(len, S' − 1)``, the result sliced to ``[S, S]``), the time table through
``mxrec.relative_attn_bias_time`` (timestamps rebased on their smallest, ``[1, B, 2S, 2S]`` →
``[0, :, ::2, ::2]``), each only within the ops' limits (at most 512 rows; ``s ≤ 4300``) and
when its conditions below hold; otherwise that part is evaluated like any score_mod.
Invariant: values at every valid position equal the reference's (up to the kernel's rounding);
anything mxrec cannot express runs the reference with a reason.

Evaluation on the padded grid follows the reference's conventions: slot ``i ≥ len`` of row ``b``
repeats the row's last real token (positions, side values), so a score_mod only sees real values
and never indexes out of range; those slots are outside the row and mxrec never reads them.

Memory: the dense bias costs ``B·H·S²·itemsize(q)`` bytes (the custom mask of ``t = 3`` as much
again, the position op's output ``B·S'²·itemsize``, the time op's interleaved output
``4·B·S²·itemsize`` while it lives, and the score_mod's own temporaries on the grid); past
``DENSE_BIAS_MAX_BYTES`` for any one of those tensors the call falls back. A bias that is finite
but overflows q's dtype once divided by ``α`` (fp16: ``−1e4 / 0.125``) falls back too.
:data:`NOTES` keeps, per score_mod key, how it was lowered and that cost (warned once).

Source of the mxrec facts (Ascend/RecSDK on GitHub/gitcode, read through the code index):

* ``cust_op/framework/torch_plugin/torch_library/hstu/hstu_jagged.cpp`` @ ee7d6b389e5a: schemas
  ``mxrec::hstu_jagged.equal(Tensor q, Tensor k, Tensor v, Tensor? mask=None, Tensor? attn_bias=None,
  int mask_type=0, int max_seq_len=0, float silu_scale=0.0, Tensor seq_offset=None,
  Tensor? num_context=None, Tensor? num_target=None, int? target_group_size=0, float? alpha=1.0)
  -> Tensor`` and ``mxrec::hstu_jagged_backward.equal(Tensor grad, <same>) -> (Tensor, Tensor,
  Tensor, Tensor)`` (dq, dk, dv, d_attn_bias); ``silu_scale == 0`` means ``1/max_seq_len``; the
  backward checks B ∈ [1, 2048], max_seq_len ∈ [1, 20480], heads ∈ [1, 16], head dim ∈ [16, 512],
  ``q.sizes() == k.sizes() == v.sizes() == grad.sizes()``, bias/mask ``[B, H, S, S]`` in q's dtype,
  dtypes float32/float16/bfloat16. ``hstu/hstu_common.h``: mask type 1 (upper triangle) rejected,
  3 needs a mask. ``hstu/README.md`` @ 3e906ceda15f: mask types 0 = built-in lower triangle, 2 = none,
  3 = custom mask ``[B, H, S, S]``; head dim a multiple of 16.
* ``cust_op/ascendc_op/ai_core_op/hstu_dense_forward/v220/op_kernel/vector_score_inter.h`` @ a48a93c:
  the kernel computes ``silu(alpha·(q·kᵀ + bias)) · silu_scale · mask`` (the bias is added *before*
  the ``alpha`` multiply), in float32. ``cust_op/test/.../test_hstu_jagged*.py`` golden: the same,
  without alpha. ``.../hstu_split_core_policy.h``: trailing empty rows are dropped
  (``GetBatchSizeFromJaggedOffset``), at least one token is required.
* ``cust_op/framework/torch_plugin/torch_library/2.6.0/relative_attn_bias/relative_attn_bias_pos.cpp``
  and ``relative_attn_bias_time.cpp`` @ 0a926f4: ``relative_attn_bias_pos(Tensor rel_pos_bias,
  Tensor identity, int[] past_valid_lens) -> Tensor`` (``[B, n, n]``, no autograd),
  ``relative_attn_bias_time(Tensor timestamps, Tensor timestamps_weights, float bucket_divisor)
  -> Tensor`` (``[layers, B, 2s, 2s]``, autograd to the weights); their golden functions in
  ``cust_op/test/.../test_relative_attn_bias*.py`` define the math (pos: rows ≥ past_valid_len copy
  row past_valid_len, ``identity`` positions get ``rel[0, 0]``; time: each timestamp twice,
  ``w[floor(ln(clamp(|t_i − t_j|, 1, e^(128·0.301))) / 0.301)]``); the pos kernel has float32 and
  float16 variants only.

Assumptions (not verifiable without an NPU): the ``.equal`` overload and keyword names above are
those of the installed RecSDK (the schema has changed between releases: later tests pass
``deterministic=``, older releases had ``hstu_jagged(..., enable_bias, ..., str layout, int[]?
seqOffset)``); mask type 0 with no ``num_context``/``num_target`` is the plain lower triangle
including the diagonal (per row, on row-local indices); the bias and mask are read at row-local
``[b, h, i, j]`` with row stride ``max_seq_len``; empty rows in the middle are fine; the time
kernel's upper clamp uses 128 buckets (so only ``num_buckets == 128`` maps); the time op takes float16 /
float32 weights like the pos op; ``hstu_jagged_backward``'s ``d_attn_bias`` is zero outside the
computed pairs (it is masked here anyway).

Known difference: the time kernel computes the bucket as ``trunc(log(d) · (1 / 0.301))`` in float32
(``relative_attn_bias_time.h``: ``Muls`` by the reciprocal), the reference as ``log(d) / 0.301``.
The two round differently at a few gaps ``d`` (a review found five, e.g. 309279 s: bucket 42 there,
41 in the reference), and the NPU's ``Log`` may itself round unlike torch's on CPU. At such a gap
the bias takes the neighbouring bucket's weight — the class of difference any compiler's
transcendental brings to a float-bucketed bias (the Triton kernel's ``log`` too), named here
because it is known.
"""
from __future__ import annotations

import math
import operator
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from .. import note_fallback
from .. import score_mod as _sm
from ..score_mod import ScoreMod, get_score_mod, live_state
from .side_ranges import value_bounds

_OP = "grcompile::jagged_attention"

# mxrec's limits (sources in the module docstring)
MAX_SEQ_LEN = 20480
MAX_BATCH = 2048
MAX_HEADS = 16
HEAD_DIM_MIN, HEAD_DIM_MAX, HEAD_DIM_MULTIPLE = 16, 512, 16
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BIAS_OP_DTYPES = (torch.float32, torch.float16)  # relative_attn_bias_pos kernel variants
MASK_TRIL, MASK_NONE, MASK_CUSTOM = 0, 2, 3
TIME_BUCKETS, BUCKET_DIVISOR = 128, 0.301
# relative_attn_bias_pos / _time: at most 512 rows; the time op's rows at most 4300 tokens, the
# position op's matrix (2s, 2s) with s <= 4300 (its kernel reads rows with stride 2·(n // 2))
BIAS_OP_MAX_BATCH, BIAS_OP_MAX_S = 512, 4300
DENSE_BIAS_MAX_BYTES = 1 << 32  # per dense [B, H, S, S] tensor; larger calls run the reference

NOTES: dict[str, str] = {}  # score_mod key -> how the Ascend lowering ran it (dense memory cost)

_HSTU = "mxrec::hstu_jagged"
_HSTU_BWD = "mxrec::hstu_jagged_backward"
_POS = "mxrec::relative_attn_bias_pos"
_TIME = "mxrec::relative_attn_bias_time"


class AscendFallback(Exception):
    """This call cannot run on mxrec; the message says why (the reference runs)."""


# --------------------------------------------------------------------------------------------
# which mxrec ops exist here


def _dispatch_key(device: torch.device) -> str:
    return {"npu": "PrivateUse1", "privateuseone": "PrivateUse1", "cpu": "CPU", "cuda": "CUDA"}.get(
        device.type, device.type)


def available(qualname: str, device: torch.device, overload: str = "") -> bool:
    """Whether ``torch.ops.<qualname>[.overload]`` is registered with a kernel for ``device``."""
    try:
        torch._C._dispatch_find_schema_or_throw(qualname, overload)
    except RuntimeError:
        return False
    name = f"{qualname}.{overload}" if overload else qualname
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, _dispatch_key(device))


# --------------------------------------------------------------------------------------------
# the form of a score_mod: value = post(silu(a·score + b)) or a·score + b


@dataclass(frozen=True)
class _Form:
    a: float = 1.0  # coefficient of the score before the activation
    silu: Optional[fx.Node] = None  # the score_mod's own SiLU node (activation="identity")
    post: bool = False  # score-independent factors after the SiLU
    graph: Optional[fx.GraphModule] = None  # None: a "bias" kind function (or no score_mod)


_ADD = {operator.add, operator.iadd, torch.add, torch.ops.aten.add.Tensor, "add", "add_"}
_SUB = {operator.sub, operator.isub, torch.sub, torch.ops.aten.sub.Tensor, "sub", "sub_"}
_MUL = {operator.mul, operator.imul, torch.mul, torch.ops.aten.mul.Tensor, "mul", "mul_"}
_DIV = {operator.truediv, operator.itruediv, torch.div, torch.true_divide, torch.ops.aten.div.Tensor, "div",
        "div_", "true_divide"}
_NEG = {operator.neg, torch.neg, torch.ops.aten.neg.default, "neg"}
_SILU = {torch.nn.functional.silu, torch.ops.aten.silu.default}


def _kind(node: fx.Node) -> Optional[str]:
    if node.op not in ("call_function", "call_method"):
        return None
    target = node.target
    for name, targets in (("add", _ADD), ("sub", _SUB), ("mul", _MUL), ("div", _DIV), ("neg", _NEG),
                          ("silu", _SILU)):
        try:
            if target in targets:
                return name
        except TypeError:  # unhashable target
            return None
    return None


_OPERAND_KWARGS = {"input", "self", "other"}


def _operands(node: fx.Node) -> Optional[list]:
    """The operands of an affine op in positional order (keyword ``input`` / ``other`` placed),
    or None when it has any other keyword (``alpha``, ``rounding_mode``, ``out``: not modelled)."""
    if set(node.kwargs) - _OPERAND_KWARGS - {"inplace"} or node.kwargs.get("inplace"):
        return None  # F.silu(x, inplace=False), as tracing records it, is kept
    operands = list(node.args)
    for name in ("input", "self", "other"):
        if name in node.kwargs:
            operands.append(node.kwargs[name])
    return operands


def _describe(node: fx.Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _number(x) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _analyse_graph(gm: fx.GraphModule) -> _Form:
    """Walk the score's chain of uses to the output; raises AscendFallback when it is not
    ``a·score + b`` (optionally followed by one SiLU and score-independent factors)."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if not placeholders:
        raise AscendFallback("the score_mod takes no score")
    score = placeholders[0]
    depends = {score}
    for n in nodes:
        if n.op != "placeholder" and any(a in depends for a in n.all_input_nodes):
            depends.add(n)
    a, silu, post, cur = 1.0, None, False, score
    while True:
        users = list(cur.users)
        if not users:
            raise AscendFallback("the score_mod does not use the score (mxrec always adds q·kᵀ)")
        if len(users) != 1:
            raise AscendFallback(f"the score_mod uses {cur.name} {len(users)} times (mxrec takes "
                                 "silu(α·(q·kᵀ + bias)) · scale · mask)")
        user = users[0]
        if user.op == "output":
            if user.args[0] is not cur:
                raise AscendFallback("the score_mod returns more than the modified score")
            break
        kind = _kind(user)
        operands = _operands(user)
        if operands is None:  # a keyword that changes the value: not affine as written
            kind, operands = None, list(user.args) + list(user.kwargs.values())
        others = [x for x in operands if x is not cur]
        if any(isinstance(x, fx.Node) and x in depends for x in others) or operands.count(cur) > 1:
            raise AscendFallback(f"the score_mod combines the score with itself ({_describe(user)})")
        if kind == "silu":
            if silu is not None:
                raise AscendFallback("the score_mod applies SiLU twice")
            silu = user
        elif silu is None:  # before the activation: affine in the score
            if kind == "add":
                pass
            elif kind == "sub":
                a = a if operands[0] is cur else -a
            elif kind == "neg":
                a = -a
            elif kind in ("mul", "div"):
                c = _number(others[0]) if len(others) == 1 else None
                if c is None or (kind == "div" and (operands[0] is not cur or c == 0.0)):
                    raise AscendFallback(f"the score_mod scales the score by a tensor or divides by it "
                                         f"({_describe(user)}); mxrec's alpha is a number")
                a = a * c if kind == "mul" else a / c
            else:
                raise AscendFallback(f"the score_mod applies {_describe(user)} to the score, which "
                                     "mxrec.hstu_jagged cannot express")
        else:  # after the activation: score-independent factors
            if kind == "mul" or (kind == "div" and operands[0] is cur):
                post = True
            else:
                raise AscendFallback(f"the score_mod applies {_describe(user)} after its SiLU; mxrec "
                                     "only multiplies by silu_scale and a mask there")
        cur = user
    return _Form(a=a, silu=silu, post=post, graph=gm)


_FORMS: dict[tuple, _Form] = {}  # (score_mod, its live state) -> its form


def _form(key: str) -> _Form:
    if not key:
        return _Form()
    cache_key = (key, live_state(key))
    form = _FORMS.get(cache_key)
    if form is None:
        sm = get_score_mod(key)
        if sm.kind == "bias":
            form = _Form()
        else:
            gm = sm.fn
            if not isinstance(gm, fx.GraphModule):
                try:
                    gm = fx.symbolic_trace(sm.fn)
                except Exception as error:  # noqa: BLE001 - any tracing failure: not provable
                    raise AscendFallback(f"the score_mod could not be traced to check its form "
                                         f"({type(error).__name__})") from None
            form = _analyse_graph(gm)
        _FORMS[cache_key] = form
    return form


class _Split(fx.Interpreter):
    """Runs the score_mod's graph with the score 0 and its SiLU replaced by 1: the SiLU's input is
    ``b``, the output is the product of the factors after it."""

    def __init__(self, gm: fx.GraphModule, silu: Optional[fx.Node]) -> None:
        super().__init__(gm)
        self.silu, self.pre = silu, None

    def run_node(self, n: fx.Node):
        if n is self.silu:
            self.pre = self.env[n.args[0]] if n.args else self.env[n.kwargs["input"]]
            return torch.ones((), dtype=self.pre.dtype, device=self.pre.device)
        return super().run_node(n)


# --------------------------------------------------------------------------------------------
# the padded grid of a call


@dataclass
class _Grid:
    B: int
    S: int
    H: int
    lengths: list[int]
    index: torch.Tensor  # [B, S] token of each slot (a padded slot repeats the row's last token)
    valid: torch.Tensor  # [B, S]
    positions: torch.Tensor  # [B, S]

    def q(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.index][:, None, :, None]

    def k(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.index][:, None, None, :]

    def pairs(self, causal: bool) -> torch.Tensor:
        """[B, 1, S, S] pairs inside each row (and j ≤ i when causal)."""
        inside = self.valid[:, None, :, None] & self.valid[:, None, None, :]
        if causal:
            inside = inside & torch.ones(self.S, self.S, dtype=torch.bool, device=inside.device).tril()
        return inside

    def contiguous_positions(self) -> bool:
        """Positions are ``start + i`` within every row (then ``k_pos − q_pos = j − i``)."""
        ar = torch.arange(self.S, device=self.positions.device)
        return bool(torch.where(self.valid, self.positions - self.positions[:, :1] == ar, True).all())


def _grid(offs: list[int], positions: torch.Tensor, H: int) -> _Grid:
    lengths = [b - a for a, b in zip(offs[:-1], offs[1:])]
    B, S, T = len(lengths), max(lengths), offs[-1]
    device = positions.device
    starts = torch.tensor(offs[:-1], dtype=torch.int64, device=device)
    lens = torch.tensor(lengths, dtype=torch.int64, device=device)
    ar = torch.arange(S, dtype=torch.int64, device=device)[None, :]
    index = (starts[:, None] + torch.minimum(ar, (lens[:, None] - 1).clamp(min=0))).clamp(max=T - 1)
    return _Grid(B, S, H, lengths, index, ar < lens[:, None], positions[index])


# --------------------------------------------------------------------------------------------
# building the mxrec arguments


@dataclass
class _Call:
    mask_type: int
    alpha: float
    silu_scale: float
    S: int
    bias: Optional[torch.Tensor] = None  # [B, H, S, S] in q's dtype
    mask: Optional[torch.Tensor] = None  # [B, H, S, S] in q's dtype (mask type 3)
    live_b: Optional[torch.Tensor] = None  # b on the grid with autograd (backward)
    live_post: Optional[torch.Tensor] = None  # P on the grid with autograd (backward)
    leaves: list = field(default_factory=list)  # (group, index, leaf) of the float inputs of b
    how: str = ""


def _mib(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _dense_cost(costs: list, what: str, dims: str, shape: tuple, dtype: torch.dtype) -> None:
    """Append ``(what, dims, bytes)`` of a dense tensor the lowering makes for mxrec; raise
    AscendFallback when it is over :data:`DENSE_BIAS_MAX_BYTES`."""
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if size > DENSE_BIAS_MAX_BYTES:
        raise AscendFallback(f"the {what} would be a dense {dims} = {list(shape)} tensor of {_mib(size)}, over "
                             f"DENSE_BIAS_MAX_BYTES = {_mib(DENSE_BIAS_MAX_BYTES)}")
    costs.append((what, dims, size))


def _check_limits(q, k, v, offs: list[int], *, use_qk, activation, dropout_p, device, backward: bool) -> None:
    if not available(_HSTU, device, "equal"):
        raise AscendFallback(f"torch.ops.mxrec.hstu_jagged.equal is not registered for {device.type} tensors "
                             "(Ascend RecSDK's custom ops are not loaded)")
    if backward and not available(_HSTU_BWD, device, "equal"):
        raise AscendFallback(f"torch.ops.mxrec.hstu_jagged_backward.equal is not registered for {device.type} "
                             "tensors")
    if activation == "softmax":
        raise AscendFallback("softmax attention (SASRec): mxrec.hstu_jagged computes SiLU attention only")
    if dropout_p > 0:
        raise AscendFallback(f"attention dropout (p = {dropout_p}): mxrec.hstu_jagged has no dropout")
    if not use_qk:
        raise AscendFallback("the op does not use q·kᵀ (FuXi's positional / temporal channels); "
                             "mxrec.hstu_jagged always does")
    if q.dtype not in DTYPES:
        raise AscendFallback(f"dtype {q.dtype}: mxrec.hstu_jagged takes float32, float16 or bfloat16")
    H, dqk, dv = q.shape[1], q.shape[2], v.shape[2]
    if not 1 <= H <= MAX_HEADS:
        raise AscendFallback(f"{H} heads: mxrec.hstu_jagged takes 1 to {MAX_HEADS}")
    if dqk != dv:
        raise AscendFallback(f"q/k head width {dqk} != v head width {dv}: mxrec.hstu_jagged_backward needs "
                             "q, k and v of one shape")
    if not (HEAD_DIM_MIN <= dqk <= HEAD_DIM_MAX and dqk % HEAD_DIM_MULTIPLE == 0):
        raise AscendFallback(f"head width {dqk}: mxrec.hstu_jagged takes a multiple of {HEAD_DIM_MULTIPLE} "
                             f"in [{HEAD_DIM_MIN}, {HEAD_DIM_MAX}]")
    B = len(offs) - 1
    if not 1 <= B <= MAX_BATCH:
        raise AscendFallback(f"{B} rows: mxrec.hstu_jagged takes 1 to {MAX_BATCH}")
    S = max(b - a for a, b in zip(offs[:-1], offs[1:]))
    if S > MAX_SEQ_LEN:
        raise AscendFallback(f"a row of {S} tokens: mxrec.hstu_jagged's max_seq_len is at most {MAX_SEQ_LEN}")


def _builtin(key: str) -> Optional[tuple]:
    """``(kind, *args)`` when ``key`` is one of score_mod.py's built-in biases."""
    for cache_key, known in _sm._FACTORY_KEYS.items():
        if known == key:
            return cache_key
    return None


def _position_part(grid: _Grid, tables, table_max_len: int, table_index: int, dtype, why: list,
                   costs: list) -> torch.Tensor:
    """β[k_pos − q_pos + table_max_len − 1] on the grid, [B, 1|H, S, S]."""
    table = tables[table_index]
    device = grid.index.device
    n = grid.S + grid.S % 2  # the op's matrix is (2s, 2s): an odd S gets one padding row and column
    reasons = []
    if not available(_POS, device):
        reasons.append("mxrec.relative_attn_bias_pos is not registered")
    if table.dim() != 1 or table.shape[0] != 2 * table_max_len - 1:
        reasons.append(f"the table has shape {tuple(table.shape)}, not [2·{table_max_len} − 1]")
    if grid.S > table_max_len:
        reasons.append(f"rows of {grid.S} tokens exceed the table's max_len {table_max_len}")
    if dtype not in BIAS_OP_DTYPES:
        reasons.append(f"its kernel takes float32 / float16, not {dtype}")
    if grid.B > BIAS_OP_MAX_BATCH or n > 2 * BIAS_OP_MAX_S:
        reasons.append(f"{grid.B} rows of up to {grid.S} tokens: it takes at most {BIAS_OP_MAX_BATCH} rows and a "
                       f"[2s, 2s] matrix with s <= {BIAS_OP_MAX_S}")
    if not reasons and not grid.contiguous_positions():
        reasons.append("positions are not consecutive within a row (it works on row-local indices)")
    if reasons:
        why.append("position bias evaluated on the grid: " + "; ".join(reasons))
        fn = _sm._relative_position(table_max_len, table_index)
        return fn(grid.positions[:, None, :, None], grid.positions[:, None, None, :], (), (), tuple(tables))
    _dense_cost(costs, "position-bias output", "[B, S', S']", (grid.B, n, n), dtype)
    ar = torch.arange(n, device=device)
    # [i, j] = β[j − i]; the padding row and column (never read) clamped into the table
    rel = table[(ar[None, :] - ar[:, None] + (table_max_len - 1)).clamp(0, 2 * table_max_len - 2)].to(dtype)
    identity = torch.zeros_like(rel)  # no diagonal override
    past = [min(length, n - 1) for length in grid.lengths]  # rows past it are padding: copying a row is harmless
    why.append("position bias by mxrec.relative_attn_bias_pos")
    return torch.ops.mxrec.relative_attn_bias_pos(rel, identity, past)[:, None, :grid.S, :grid.S]


def _time_part(grid: _Grid, q_side, k_side, tables, num_buckets: int, side_index: int, table_index: int, dtype,
               why: list, costs: list) -> torch.Tensor:
    """table[bucket(|q_side − k_side|)] on the grid, [B, 1, S, S]."""
    table, qs, ks = tables[table_index], q_side[side_index], k_side[side_index]
    device = grid.index.device
    reasons, first = [], 0
    if not available(_TIME, device):
        reasons.append("mxrec.relative_attn_bias_time is not registered")
    if num_buckets != TIME_BUCKETS or table.dim() != 1 or table.shape[0] != TIME_BUCKETS + 1:
        reasons.append(f"it has {TIME_BUCKETS} buckets (table [{TIME_BUCKETS + 1}]), here {num_buckets} "
                       f"(table {tuple(table.shape)})")
    if dtype not in BIAS_OP_DTYPES:
        reasons.append(f"assumed float32 / float16 weights, not {dtype}")
    if grid.B > BIAS_OP_MAX_BATCH or grid.S > BIAS_OP_MAX_S:
        reasons.append(f"{grid.B} rows of up to {grid.S} tokens: it takes at most {BIAS_OP_MAX_BATCH} rows of "
                       f"{BIAS_OP_MAX_S}")
    if qs.is_floating_point() or ks.is_floating_point():
        reasons.append("it takes integer timestamps")
    elif not reasons:
        if not (qs is ks or torch.equal(qs, ks)):
            reasons.append("its query side is the key side's timestamp (t_i − t_j); here the query side differs "
                           "(HSTU's next timestamp)")
        elif qs.numel():
            [[first, last]] = value_bounds([qs])
            if last - first >= 2**31:  # the kernel subtracts in int32: every difference must fit
                reasons.append("timestamps span 2**31 or more (its int32 differences would wrap)")
    if reasons:
        why.append("time bias evaluated on the grid: " + "; ".join(reasons))
        fn = _sm._relative_time(num_buckets, side_index, table_index)
        return fn(grid.positions[:, None, :, None], grid.positions[:, None, None, :],
                  tuple(grid.q(t) for t in q_side), tuple(grid.k(t) for t in k_side), tuple(tables))
    _dense_cost(costs, "time-bias output", "[1, B, 2S, 2S]", (1, grid.B, 2 * grid.S, 2 * grid.S), dtype)
    # rebased on the smallest: values in [0, 2**31) fit int32, differences unchanged
    timestamps = (qs[grid.index] - first).to(torch.int32)  # [B, S]
    out = torch.ops.mxrec.relative_attn_bias_time(timestamps, table.reshape(1, -1).to(dtype), BUCKET_DIVISOR)
    why.append("time bias by mxrec.relative_attn_bias_time")
    return out[0, :, ::2, ::2][:, None]  # each timestamp appears twice: keep one of each pair


def _evaluate(key: str, form: _Form, grid: _Grid, q_side, k_side, tables, cdtype):
    """``(b, P)`` of the score_mod on the grid: ``b`` the score-independent term before the
    activation, ``P`` the factor after it (None: none)."""
    if not key:
        return None, None
    sm: ScoreMod = get_score_mod(key)
    q_pos, k_pos = grid.positions[:, None, :, None], grid.positions[:, None, None, :]
    qs = tuple(grid.q(t) for t in q_side)
    ks = tuple(grid.k(t) for t in k_side)
    zero = torch.zeros((), dtype=cdtype, device=grid.index.device)
    if form.graph is None:
        return sm(zero, q_pos, k_pos, qs, ks, tuple(tables), heads=grid.H), None
    args = [zero, q_pos, k_pos]
    if sm.head:
        args.append(torch.arange(grid.H, device=zero.device).view(1, grid.H, 1, 1))
    args += [*qs, *ks, *tables]
    split = _Split(form.graph, form.silu)
    out = split.run(*args)
    return (split.pre, out) if form.silu is not None else (out, None)


def _lower(q, k, v, offs, positions, q_side, k_side, tables, *, score_mod, use_qk, activation, scale, out_scale,
           causal, dropout_p, backward: bool) -> _Call:
    """The mxrec arguments of this call (raises AscendFallback with the reason)."""
    _check_limits(q, k, v, offs, use_qk=use_qk, activation=activation, dropout_p=dropout_p, device=q.device,
                  backward=backward)
    form = _form(score_mod)
    if activation == "silu" and form.silu is not None:
        raise AscendFallback("the score_mod applies its own SiLU before the op's SiLU")
    if activation == "identity" and form.silu is None:
        raise AscendFallback("identity attention without a SiLU in the score_mod: mxrec.hstu_jagged "
                             "computes SiLU attention only")
    alpha = form.a * scale
    if alpha == 0.0 or not math.isfinite(alpha):
        raise AscendFallback(f"the score's coefficient is {alpha}: mxrec divides the bias by alpha")
    B, H, S = len(offs) - 1, q.shape[1], max(b - a for a, b in zip(offs[:-1], offs[1:]))
    grid = _grid(offs, positions, H)
    cdtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    builtin = _builtin(score_mod) if score_mod else None
    why: list[str] = []
    costs: list[tuple[str, str, int]] = []
    if score_mod:
        _dense_cost(costs, "bias mxrec takes", "[B, H, S, S]", (B, H, S, S), q.dtype)
    if form.post:
        _dense_cost(costs, "custom mask mxrec takes", "[B, H, S, S]", (B, H, S, S), q.dtype)

    # b: the bias before the activation (mxrec's values), and with autograd for the backward
    live_b, live_post, leaves = None, None, []
    if backward and score_mod:
        from . import _autograd_reenabled
        with _autograd_reenabled():
            leaves = [(g, i, t.detach().requires_grad_()) for g, ts in (("q_side", q_side), ("k_side", k_side),
                                                                      ("tables", tables))
                      for i, t in enumerate(ts) if t.is_floating_point()]
            live = {"q_side": list(q_side), "k_side": list(k_side), "tables": list(tables)}
            for g, i, leaf in leaves:
                live[g][i] = leaf
            live_b, live_post = _evaluate(score_mod, form, grid, live["q_side"], live["k_side"], live["tables"],
                                          cdtype)
    if builtin is not None:
        kind, *args = builtin
        dtype = q.dtype
        if kind == "position":
            b = _position_part(grid, tables, args[0], args[1], dtype, why, costs)
        elif kind == "time":
            b = _time_part(grid, q_side, k_side, tables, *args, dtype, why, costs)
        else:
            b = (_position_part(grid, tables, args[0], 0, dtype, why, costs).to(cdtype)
                 + _time_part(grid, q_side, k_side, tables, args[1], 0, 1, dtype, why, costs).to(cdtype))
        post = None
    else:
        if live_b is not None:  # the backward's evaluation gives the values too
            b, post = live_b, live_post
        else:
            with torch.no_grad():
                b, post = _evaluate(score_mod, form, grid, q_side, k_side, tables, cdtype)
        if score_mod:
            why.append(f"score_mod evaluated on the grid (form silu({form.a:g}·score + b)"
                       f"{' · P' if form.post else ''})" if form.silu is not None else
                       f"score_mod evaluated on the grid (form {form.a:g}·score + b)")

    call = _Call(MASK_TRIL if causal else MASK_NONE, alpha, out_scale, S, live_b=live_b, leaves=leaves,
                 live_post=live_post if live_b is not None and builtin is None else None)
    if b is not None:
        b = b.detach()
        if alpha != 1.0:
            b = b.to(cdtype) / alpha
        call.bias = b.to(q.dtype).expand(B, H, S, S).contiguous()
        if bool(torch.isfinite(b).all()) and not bool(torch.isfinite(call.bias).all()):
            raise AscendFallback(f"the bias divided by alpha = {alpha:g} overflows {q.dtype} (mxrec adds bias / alpha "
                                 "to q·kᵀ in q's dtype)")
    if post is not None:
        post = post.detach()
        if post.dim() == 0:
            call.silu_scale = out_scale * float(post)
        else:
            mask = post.to(cdtype).expand(B, H, S, S)
            if causal:
                mask = mask * torch.ones(S, S, dtype=cdtype, device=mask.device).tril()
            call.mask, call.mask_type = mask.to(q.dtype).contiguous(), MASK_CUSTOM
    if call.silu_scale == 0.0 or not math.isfinite(call.silu_scale):
        raise AscendFallback(f"silu_scale {call.silu_scale}: mxrec reads 0 as 1/max_seq_len")
    if score_mod:
        tensors = ", ".join(f"{what} {dims} {_mib(size)}" for what, dims, size in costs)
        call.how = (f"{'; '.join(why)}; dense tensors for mxrec (B = {B}, H = {H}, S = {S}): {tensors}; "
                    f"{_mib(sum(size for _, _, size in costs))} for this call")
    return call


# --------------------------------------------------------------------------------------------
# the kernels (registered as the ``ascend`` slots of jagged_attention / _backward)


def _fallback(op: str, score_mod: str, why: str) -> None:
    if note_fallback(op, score_mod, f"Ascend (mxrec.hstu_jagged) does not run it: {why}", kernel="ascend"):
        warnings.warn(f"{_OP}: mxrec.hstu_jagged does not run score_mod {score_mod or '(none)'!r}: {why}; "
                      "the reference implementation runs instead (same values, slower)", stacklevel=3)


def _note(score_mod: str, call: _Call) -> None:
    """Keep how the last call of this score_mod was lowered; warn the first time."""
    if score_mod and call.how:
        first = score_mod not in NOTES
        NOTES[score_mod] = call.how
        if first:
            warnings.warn(f"{_OP} on Ascend, score_mod {score_mod!r}: {call.how}", stacklevel=3)


def _mxrec_args(call: _Call, offsets: torch.Tensor) -> dict:
    return dict(mask=call.mask, attn_bias=call.bias, mask_type=call.mask_type, max_seq_len=call.S,
                silu_scale=call.silu_scale, seq_offset=offsets, alpha=call.alpha)


def attention_ascend(q, k, v, offsets, positions, q_side, k_side, tables, seed=None, *, score_mod, use_qk, activation,
                     scale, out_scale, causal, max_len, dropout_p=0.0, with_lse=False):
    """``jagged_attention`` on mxrec.hstu_jagged, or the reference with a reason. ``with_lse``:
    ``(out, lse)``; mxrec runs SiLU only, whose ``lse`` is empty (a softmax runs the reference)."""
    from . import _attention_reference, _check_dropout, _check_meta, _check_values
    _check_meta(q, k, v, offsets, positions, q_side, k_side, tables, score_mod, activation, max_len)
    _check_dropout(seed, dropout_p, q.device)
    offs = _check_values(offsets, positions, q.shape[0], max_len)
    kwargs = dict(score_mod=score_mod, use_qk=use_qk, activation=activation, scale=scale, out_scale=out_scale,
                  causal=causal, dropout_p=dropout_p)
    from .op import lse_like
    if q.shape[0] == 0:  # mxrec needs a token; nothing to compute
        out = q.new_zeros(0, q.shape[1], v.shape[2])
        return (out, lse_like(q, activation)) if with_lse else out
    try:
        call = _lower(q, k, v, offs, positions, q_side, k_side, tables, backward=False, **kwargs)
    except AscendFallback as why:
        _fallback("jagged_attention", score_mod, str(why))
        return _attention_reference(q, k, v, offsets, positions, q_side, k_side, tables, seed, max_len=max_len,
                                    with_lse=with_lse, **kwargs)
    _note(score_mod, call)
    out = torch.ops.mxrec.hstu_jagged.equal(q.contiguous(), k.contiguous(), v.contiguous(),
                                            **_mxrec_args(call, offsets))
    return (out, lse_like(q, activation)) if with_lse else out


def attention_backward_ascend(grad_out, q, k, v, offsets, positions, q_side, k_side, tables, seed=None, fwd_out=None,
                              fwd_lse=None, *, score_mod, use_qk, activation, scale, out_scale, causal, max_len,
                              dropout_p=0.0):
    """``jagged_attention_backward`` on mxrec.hstu_jagged_backward (dq, dk, dv, d bias), the
    tables' and side tensors' gradients pulled back through the bias; or the reference."""
    from . import _attention_backward_reference, _autograd_reenabled, _grad_placeholder
    kwargs = dict(score_mod=score_mod, use_qk=use_qk, activation=activation, scale=scale, out_scale=out_scale,
                  causal=causal, dropout_p=dropout_p)
    offs = offsets.tolist()
    d_qs = [torch.zeros_like(t) if t.is_floating_point() else _grad_placeholder(t) for t in q_side]
    d_ks = [torch.zeros_like(t) if t.is_floating_point() else _grad_placeholder(t) for t in k_side]
    d_tables = [torch.zeros_like(t) if t.is_floating_point() else _grad_placeholder(t) for t in tables]
    if q.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), d_qs, d_ks, d_tables
    try:
        call = _lower(q, k, v, offs, positions, q_side, k_side, tables, backward=True, **kwargs)
    except AscendFallback as why:
        _fallback("jagged_attention_backward", score_mod, str(why))
        return _attention_backward_reference(grad_out, q, k, v, offsets, positions, q_side, k_side, tables, seed,
                                             fwd_out, fwd_lse, max_len=max_len, **kwargs)
    dq, dk, dv, d_bias = torch.ops.mxrec.hstu_jagged_backward.equal(
        grad_out.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), **_mxrec_args(call, offsets))
    live, wanted = [], []
    grid = _grid(offs, positions, q.shape[1])
    B, H, S = grid.B, grid.H, grid.S
    pairs = grid.pairs(causal)
    if call.live_b is not None and call.live_b.requires_grad:
        # β = b / α: dL/db = dL/dβ / α, on the pairs the op computes
        live.append(call.live_b)
        wanted.append(torch.where(pairs, d_bias.float() / call.alpha, 0.0))
    if call.live_post is not None and call.live_post.requires_grad:
        # mxrec returns no mask gradient: dL/dP = (g·vᵀ) ⊙ silu(s) · out_scale, one dense grid matmul
        def pad(t):
            return torch.where(grid.valid[:, :, None, None], t[grid.index].float(), 0.0).transpose(1, 2)
        s = pad(q) @ pad(k).transpose(-1, -2)
        if call.bias is not None:
            s = s + call.bias.float()
        d_post = (pad(grad_out) @ pad(v).transpose(-1, -2)) * torch.nn.functional.silu(s * call.alpha) * out_scale
        live.append(call.live_post)
        wanted.append(torch.where(pairs, d_post, 0.0))
    if live:
        with _autograd_reenabled():
            full = [t.expand(B, H, S, S) for t in live]
            grads = torch.autograd.grad(full, [leaf for _, _, leaf in call.leaves],
                                        [g.to(t.dtype) for g, t in zip(wanted, full)], allow_unused=True)
        out = {"q_side": d_qs, "k_side": d_ks, "tables": d_tables}
        for (group, i, _), grad in zip(call.leaves, grads):
            if grad is not None:
                out[group][i] += grad.to(out[group][i].dtype)
    return dq, dk, dv, d_qs, d_ks, d_tables


__all__ = ["attention_ascend", "attention_backward_ascend", "AscendFallback", "available", "NOTES",
           "DENSE_BIAS_MAX_BYTES", "MAX_SEQ_LEN", "MAX_BATCH", "MAX_HEADS"]
