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


def dropout_keep(seed: torch.Tensor, q_tok: torch.Tensor, k_tok: torch.Tensor, heads: int,
                 p: float | torch.Tensor) -> torch.Tensor:
    """The attention-dropout mask: ``keep[.., h, i, j]`` for query tokens ``q_tok [n, Lq]`` and key
    tokens ``k_tok [n, Lk]`` (indices into the jagged values) -> bool ``[n, H, Lq, Lk]``.

    A counter-based hash of (seed, query token, head, key token): the same pair gets the same
    decision wherever it is computed (forward, recomputing backward, any bucketing or chunking),
    and nothing is stored. ``P(keep) = 1 − p`` up to 2⁻²⁴."""
    h = torch.arange(heads, dtype=torch.int64, device=q_tok.device)[None, :, None, None]
    row = _hash32((seed.reshape(()) ^ (q_tok[:, None, :, None] * heads + h)) & _M32)
    u = _hash32(row ^ (k_tok[:, None, None, :] & _M32)) >> 8  # 24 bits
    return u >= (p * (1 << 24)).round().long() if isinstance(p, torch.Tensor) else u >= round(p * (1 << 24))
