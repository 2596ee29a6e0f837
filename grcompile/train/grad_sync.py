"""The dense gradient all-reduce overlapped with the backward, DDP-style (``--overlap-allreduce``).

The dense parameters are cut into buckets of at most ``bucket_mb`` megabytes, in reverse
registration order (≈ the order the backward produces their gradients). A post-accumulate-grad hook
on every parameter counts the bucket's gradients in; when a bucket is complete it is flattened and
its ``all_reduce(async_op=True)`` starts on a process group of its own while the backward goes on.
``finish()`` (before the optimizer step) launches what is left, waits, and hands every parameter a
view of its reduced bucket, as the serial ``parallel.all_reduce_gradients`` does.

Same training as the serial all-reduce, on every rank:

* Only an *armed* backward launches anything: ``arm()`` goes before the last backward of the step
  (the only one in ``sync``; the last micro-batch's with FWP, whose gradients have accumulated over
  the micro-batches by then — a bucket sent earlier would miss the later micro-batches' parts).
* A gradient accumulated into a parameter whose bucket is already on the wire is an error at
  ``finish()`` (``check_late``), not a silently dropped contribution.
* Collectives on the group go in bucket order on every rank: bucket k starts only after buckets
  0..k-1 have, so a rank whose backward completes buckets in another order (or a parameter without
  a gradient on one rank) cannot mismatch them. A parameter without a gradient counts as zeros and
  its bucket goes out at ``finish()``; afterwards it has a zero gradient, as with the serial sum.
* The per-element sums are the serial all-reduce's: on 2 ranks bit-equal (a + b); on more ranks
  gloo's ring may group an element's sum differently when the buffer is cut differently
  (float rounding only).
"""
from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

DEFAULT_BUCKET_MB = 25.0


class OverlappedAllReduce:
    """Sum ``params``' gradients over ``group``'s ranks, bucket by bucket, during the backward.

    ``arm()`` before the step's last backward, ``finish()`` after it (before the optimizer step);
    ``close()`` removes the hooks. ``seconds`` accumulates the time ``finish()`` spends (the
    exposed part of the all-reduce: launches left over plus waits)."""

    def __init__(self, params: list[nn.Parameter], group: Optional[dist.ProcessGroup] = None,
                 bucket_mb: float = DEFAULT_BUCKET_MB, *, check_late: bool = True) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.params = [p for p in params if p.requires_grad]
        self.group, self.check_late = group, check_late
        self.buckets = _buckets(self.params, int(bucket_mb * 2 ** 20))
        self._bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in self.params]
        self._armed = False
        self._ready: list[set[int]] = []  # per bucket: ids of the parameters whose gradient is in
        self._launched: list[tuple[torch.Tensor, object]] = []  # (flat, work) of buckets 0..k-1
        self._late: list[int] = []  # gradients that arrived after their bucket was sent
        self.seconds = 0.0
        self.launched_in_backward = 0  # buckets started by the hooks (the rest: by finish)

    # -- the step --------------------------------------------------------------------------------
    def arm(self) -> None:
        """The next backward is the step's last: its completed buckets are sent as they complete.
        Arming again before ``finish()`` keeps the round (buckets already sent stay sent)."""
        if self._armed:
            return
        self._armed = True
        self._ready = [set() for _ in self.buckets]
        self._launched, self._late = [], []

    @property
    def armed(self) -> bool:
        return self._armed

    def finish(self) -> None:
        """Send the buckets the backward did not complete (gradients missing: zeros), wait for all,
        give every parameter its summed gradient (a view of its bucket)."""
        if not self._armed:
            raise RuntimeError("OverlappedAllReduce.finish() without arm() before the last backward")
        start = time.perf_counter()
        try:
            while len(self._launched) < len(self.buckets):
                self._launch(len(self._launched))
            for b, (flat, work) in enumerate(self._launched):
                work.wait()
                bucket = self.buckets[b]
                for p, chunk in zip(bucket, flat.split([p.numel() for p in bucket])):
                    p.grad = chunk.view_as(p)
        finally:
            self._armed = False
            self.seconds += time.perf_counter() - start
        if self._late and self.check_late:
            names = len(self._late)
            raise RuntimeError(f"OverlappedAllReduce: {names} gradient(s) accumulated after their bucket was sent "
                               f"(arm() must come before the step's last backward only)")

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- hooks -----------------------------------------------------------------------------------
    def _on_gradient(self, param: torch.Tensor) -> None:
        if not self._armed:
            return
        b = self._bucket_of[id(param)]
        if b < len(self._launched):
            self._late.append(id(param))
            return
        self._ready[b].add(id(param))
        # in bucket order only: every rank issues the group's collectives in the same sequence
        while len(self._launched) < len(self.buckets) and \
                len(self._ready[len(self._launched)]) == len(self.buckets[len(self._launched)]):
            self._launch(len(self._launched))
            self.launched_in_backward += 1

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        with torch.no_grad():
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket])
        self._launched.append((flat, dist.all_reduce(flat, group=self.group, async_op=True)))


def _buckets(params: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Reverse registration order cut into runs of at most ``cap_bytes`` (a larger parameter alone),
    one dtype per bucket (a flat buffer has one)."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > cap_bytes or buckets[-1][0].dtype != p.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


__all__ = ["DEFAULT_BUCKET_MB", "OverlappedAllReduce"]
