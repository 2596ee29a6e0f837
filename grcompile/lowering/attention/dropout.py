"""The attention-dropout mask: a counter-based hash of (seed, query token, head, key token), so the
forward, the recomputing backward and every kernel (the Triton one hashes bit-identically) draw
the same decisions without storing a mask."""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x · c mod 2³²`` for int64 ``x`` in ``[0, 2³²)`` without int64 overflow (c split in 16-bit halves)."""
    return (x * (c & 0xFFFF) + ((x * (c >> 16)) & 0xFFFF) * 65536) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (lowbias32): avalanche of every input bit, on int64 in ``[0, 2³²)``."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def dropout_rows(seed: torch.Tensor, q_tok: torch.Tensor, heads: int) -> torch.Tensor:
    """The per-(query token, head) half of the hash, int64 ``[n, H, Lq, 1]`` in ``[0, 2³²)``: computed
    once per query row, not once per score (inside a compiled score loop it would be scalar code
    repeated for every vector of keys)."""
    h = torch.arange(heads, dtype=torch.int64, device=q_tok.device)[None, :, None, None]
    return _hash32((seed.reshape(()) ^ (q_tok[:, None, :, None] * heads + h)) & _M32)


def _threshold(p: float | torch.Tensor, dtype: torch.dtype):
    return (p * (1 << 24)).round().to(dtype) if isinstance(p, torch.Tensor) else round(p * (1 << 24))


def dropout_keep(seed: torch.Tensor, q_tok: torch.Tensor, k_tok: torch.Tensor, heads: int,
                 p: float | torch.Tensor) -> torch.Tensor:
    """The attention-dropout mask: ``keep[.., h, i, j]`` for query tokens ``q_tok [n, Lq]`` and key
    tokens ``k_tok [n, Lk]`` (indices into the jagged values) -> bool ``[n, H, Lq, Lk]``.

    A counter-based hash of (seed, query token, head, key token): the same pair gets the same
    decision wherever it is computed (forward, recomputing backward, any bucketing or chunking),
    and nothing is stored. ``P(keep) = 1 − p`` up to 2⁻²⁴. This is the definition (int64
    arithmetic, no overflow anywhere); :func:`dropout_keep_rows` computes the same bits faster."""
    u = _hash32(dropout_rows(seed, q_tok, heads) ^ (k_tok[:, None, None, :] & _M32)) >> 8  # 24 bits
    return u >= _threshold(p, torch.int64)


def dropout_keep_rows(rows: torch.Tensor, k_tok: torch.Tensor, p: float | torch.Tensor) -> torch.Tensor:
    """:func:`dropout_keep` from :func:`dropout_rows` and the key tokens ``k_tok [n, Lk]``, bit for bit,
    in int32 arithmetic: the per-score half of the hash is the hot loop of the CPU attention, and
    AVX2 has 32-bit vector multiplies but no 64-bit ones (inductor emulates those lane by lane,
    ~1.5x the whole forward chunk). Multiplication wraps modulo 2³² (two's complement, as
    ``vpmulld`` and x86 ``imul`` do); arithmetic right shifts are masked to logical ones. Key tokens
    must be below 2³¹ (they index the jagged values)."""
    x = (rows - ((rows >> 31) << 32)).to(torch.int32) ^ k_tok.to(torch.int32)[:, None, None, :]  # same 32 bits
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * (0x846CA68B - (1 << 32))
    u = ((x ^ ((x >> 16) & 0xFFFF)) >> 8) & 0xFFFFFF  # 24 bits
    return u >= _threshold(p, torch.int32)
