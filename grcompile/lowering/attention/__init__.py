"""``grcompile::jagged_attention``: causal / bidirectional attention over jagged rows with a
pointwise activation (SiLU, identity) or a softmax and a registered score_mod bias.

    jagged_attention(q [T, H, dqk], k [T, H, dqk], v [T, H, dv], offsets [B+1] int64,
                     positions [T] int64, q_side: list[[T]], k_side: list[[T]], tables: list,
                     seed: int64 [1] | None, *, score_mod: str, use_qk: bool, activation: str,
                     scale: float, out_scale: float, causal: bool, max_len: int,
                     dropout_p: float = 0.0) -> [T, H, dv]

Per row ``b`` (tokens ``offsets[b]:offsets[b+1]``) and head, with ``mod`` the registered score_mod
(``""``: none):

    s(i, j)  = mod(score = scale·q_i·k_j if use_qk else 0, q_pos = positions[i], k_pos = positions[j], ...)
    allowed  = positions[j] <= positions[i] if causal else True
    silu / identity:  A(i, j) = act(s)·out_scale where allowed, else exactly 0
    softmax:          A(i, ·) = softmax over allowed j of s, times out_scale (no allowed key: 0)
    dropout:          A(i, j) ← A(i, j)·keep(i, j)/(1 − dropout_p)   (training only)
    out_i    = Σ_j A(i, j) v_j

``keep`` is ``dropout_keep(seed, ...)``: a counter-based hash of (seed, query token, head, key token),
so the forward and the recomputing backward draw the same mask without storing it, whatever the
bucketing; the graph draws a fresh ``seed`` per step from the default generator.

which equals, at valid positions, the padded models' ``act(q kᵀ + rab)/N * causal_padding_mask``
(HSTU, FuXi-α's three channels) and SASRec's masked softmax. ``positions`` are padded-row
coordinates and must increase strictly within a row (row-major packing gives that).

Reference implementation (CPU, and the fallback of devices without a kernel): padding-free up to
a bounded waste. Rows are sorted by length and grouped greedily into buckets whose padded *pair*
area wastes at most ``buckets.BUCKET_WASTE`` (12.5 %) of the bucket — or at most
``buckets.BUCKET_SLACK_PAIRS`` pairs in absolute terms, since a tiny bucket costs more in per-op overhead than its padding.
A bucket is padded to its longest row only, computed with batched matmuls, and split into chunks
of at most ``buckets.CHUNK_ELEMENTS`` score elements (rows first; for one long row, blocks of queries, and
a causal query block only reads the keys up to its end), so no ``B×N×N`` tensor ever exists.
Padded slots repeat the row's last real token, so a score_mod only ever sees real
(position, side) values and never indexes out of bounds; they are removed by ``torch.where``
(never multiplied), so nothing non-finite leaks.

Autograd is flash-like: ``jagged_attention`` is a composite of ``grcompile::jagged_attention_fwd``,
which returns the output and, for the softmax, the log-sum-exp per (token, head); the forward saves
its inputs (and, for the softmax, that output and log-sum-exp), and
``grcompile::jagged_attention_backward`` recomputes each chunk's scores and differentiates them
analytically (the score_mod by its VJP; the softmax weights as ``exp(s − lse)``), returning
gradients for q, k, v and every floating side tensor and table (integer ones get ``None``),
accumulated in float32 for half-precision inputs.

Kernels: ``triton`` (:mod:`grcompile.lowering.attention.triton`: CUDA, or CPU tensors under ``TRITON_INTERPRET=1``
with ``GRCOMPILE_BACKEND=triton``) generates the score_mod into the kernel; a call it cannot run
(a score_mod op it does not know, float64) runs this reference, with a warning. ``ascend``
(:mod:`grcompile.lowering.attention.ascend`) maps calls to Ascend RecSDK's ``mxrec.hstu_jagged`` where the math matches (tested
against stubs only: nothing has run on an NPU).


Modules, one concern each: :mod:`.op` (schemas, fake, autograd, kernel slots, the variants run),
:mod:`.validation` (argument checks), :mod:`.buckets` (the bucket planner), :mod:`.dropout` (the
dropout hash), :mod:`.chunks` (one chunk, and its inductor-compiled copies), :mod:`.reference`
(the reference forward / backward). The models' attentions written as calls of the op live with
the tests (tests/lowering/attention/wrappers.py). The knobs (``buckets.BUCKET_WASTE``,
``buckets.CHUNK_ELEMENTS``, ``chunks.COMPILE_CHUNKS``, ...) are globals of their module, read at
call time.
"""
from __future__ import annotations

from .buckets import plan_buckets
from .dropout import dropout_keep
from .op import (JAGGED_ATTENTION, SEEN_VARIANTS, jagged_attention, jagged_attention_backward, jagged_attention_fwd,
                 note_variant)
from .validation import ACTIVATIONS

# The kernel modules (triton.py, ascend.py) fall back to the reference through these
# names; they import them from here until they move into this package.
from .chunks import _autograd_reenabled  # noqa: F401
from .reference import _attention_backward_reference, _attention_reference, _grad_placeholder  # noqa: F401
from .validation import _check_dropout, _check_meta, _check_values  # noqa: F401

__all__ = ["jagged_attention", "jagged_attention_fwd", "jagged_attention_backward", "plan_buckets", "dropout_keep", "ACTIVATIONS",
           "note_variant", "SEEN_VARIANTS", "JAGGED_ATTENTION"]
