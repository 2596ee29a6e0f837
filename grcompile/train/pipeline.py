"""Sparse pipeline schedules of a training step (``--pipeline``): ``sync`` (every stage in turn) and
``fwp``, NestPipe's frozen-window pipelining (§V): the step's batch is cut into micro-batches; the
embedding all-to-all of micro-batch i+1 runs while micro-batch i computes, and the gradient
all-to-all of i runs (on a worker thread, on a process group of its own) while i+1 computes.
Gradients accumulate over the micro-batches and the optimizers step once at the end, so every
micro-batch sees the step's parameters — the frozen window — and the update is the full batch's
(Proposition 2): each micro-batch's mean loss is weighted by its share of the global batch's
targets, as the ranks' slices already are.

What makes it possible without touching the model: grcompile extracts the lookups' ids from the
traced forward (``passes/lookup_keys.py``), so the pipeline can start micro-batch i+1's lookups
before its forward runs. The first step runs synchronously and checks that the extracted keys are
the ones the forward really looks up, on every rank; if not, the run stays ``sync`` and says why.

Key-centric sample clustering (§V-C) puts rows that share items into the same micro-batch, so the
per-micro-batch dedup keeps most of its effect: ``cluster_rows``.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.func import functional_call, functionalize
from torch.fx.experimental.proxy_tensor import make_fx

from ..passes.lookup_keys import extract_lookup_keys
from ..runtime.sparse import SparseRuntime

PIPELINES = ("sync", "fwp", "dbp", "dbp+fwp", "semi-async", "six-stage")
STALE = {"semi-async", "six-stage"}  # schedules whose embeddings are not the synchronous ones
Batch = dict[str, torch.Tensor]


class PipelineUnsupported(Exception):
    """The model or the runtime does not allow this schedule; the message says why, for the log."""


class KeyExtractor:
    """``extractor(*inputs) -> [(feature, ids), ...]``: the ids the forward's lookups will receive,
    in order, computed without running the model (traced on fake tensors once per input shape)."""

    def __init__(self, model: nn.Module, *, step_ahead: bool = False) -> None:
        self.model, self.step_ahead = model, step_ahead  # step_ahead: keys of the next step, before this update
        self._graphs: dict[tuple, object] = {}

    def _state(self) -> dict[str, torch.Tensor]:
        return {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}

    def __call__(self, *inputs: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return self.bind(*inputs)()

    def bind(self, *inputs: torch.Tensor) -> Callable[[], list[tuple[str, torch.Tensor]]]:
        """The extraction for ``inputs`` as a call that may run on another thread: the trace (which
        swaps the model's parameters for fakes while it runs) is made here, on the calling thread,
        and the state is taken here; the returned call only runs the traced key graph."""
        signature = (self.model.training, tuple((tuple(t.shape), t.dtype) for t in inputs))
        keys = self._graphs.get(signature)
        if keys is None:
            def forward(state, *args):
                return functional_call(self.model, state, args)

            try:
                traced = make_fx(functionalize(forward, remove="mutations_and_views"), tracing_mode="fake")(
                    self._state(), *inputs)
            except Exception as e:  # noqa: BLE001 - any trace failure means: no extraction, run sync
                raise PipelineUnsupported(f"the forward could not be traced to extract its lookup keys "
                                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
            keys = self._graphs[signature] = extract_lookup_keys(traced)
            parameters = len(dict(self.model.named_parameters()))  # the state's leaves come first
            if not isinstance(keys, str) and self.step_ahead and any(i < parameters for i in keys.reads):
                keys = self._graphs[signature] = ("the ids of a lookup are computed from parameters: a step ahead "
                                                  "they would come from the weights before the update")
        if isinstance(keys, str):
            raise PipelineUnsupported(keys)
        state = self._state()

        def extract() -> list[tuple[str, torch.Tensor]]:
            with torch.no_grad():  # grad mode is per thread
                return list(zip(keys.features, keys.graph(state, *inputs)))
        return extract


def cluster_rows(ids: torch.Tensor, parts: int, pad: int = 0) -> list[torch.Tensor]:
    """Key-centric sample clustering: ``parts`` micro-batches of near-equal row counts (sizes as
    ``torch.tensor_split``), each row greedily placed — rows with the most distinct ids first —
    where most of its ids already are (ties: the emptier micro-batch, then the lower index).
    Deterministic; every row exactly once; rows ascending inside each micro-batch."""
    rows = ids.shape[0]
    sizes = [len(c) for c in torch.tensor_split(torch.arange(rows), parts)]
    keys = [set(r[r != pad].tolist()) for r in ids]
    order = sorted(range(rows), key=lambda r: -len(keys[r]))
    members: list[list[int]] = [[] for _ in range(parts)]
    seen: list[set[int]] = [set() for _ in range(parts)]
    for r in order:
        open_parts = [j for j in range(parts) if len(members[j]) < sizes[j]]
        best = max(open_parts, key=lambda j: (len(keys[r] & seen[j]), -len(members[j]), -j))
        members[best].append(r)
        seen[best] |= keys[r]
    return [torch.tensor(sorted(m), dtype=torch.long) for m in members]


def unique_ids_sent(ids: torch.Tensor, parts: list[torch.Tensor], pad: int = 0) -> int:
    """Σᵢ |unique(Mᵢ)|: ids a per-micro-batch dedup still sends (the quantity clustering lowers)."""
    return sum(int(ids[p][ids[p] != pad].unique().numel()) for p in parts)


def moves_only_rows_with_gradient(opt: torch.optim.Optimizer, group: dict) -> bool:
    """True where ``opt`` leaves a row whose gradient is zero exactly where it is: SGD without
    momentum or weight decay, Adagrad without weight decay, or an optimizer that declares it."""
    if getattr(opt, "moves_only_rows_with_gradient", False):
        return True
    if isinstance(opt, torch.optim.SGD):
        return not group.get("momentum") and not group.get("weight_decay")
    return isinstance(opt, torch.optim.Adagrad) and not group.get("weight_decay")


class SparsePipeline:
    """One training step's forward/backward under ``schedule`` (module docstring): ``fwp``,
    ``dbp``, ``dbp+fwp``. ``step`` returns the sum of the micro-batches' weighted losses (this
    rank's share of the global mean loss), detached; the caller all-reduces the dense gradients
    and steps the optimizers, as in a synchronous step."""

    def __init__(self, task: nn.Module, runtime: Optional[SparseRuntime], micro_batches: int = 1, *,
                 schedule: str = "fwp", cluster: bool = True, world: int = 1) -> None:
        if schedule not in PIPELINES or schedule == "sync":
            raise ValueError(f"schedule must be one of {PIPELINES[1:]}, got {schedule!r}")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.fwp, self.dbp, self.semi_async = "fwp" in schedule, "dbp" in schedule, schedule == "semi-async"
        self.six_stage = schedule == "six-stage"
        self.micro_batches = micro_batches if self.fwp else 1
        self.task, self.runtime, self.schedule, self.cluster, self.world = task, runtime, schedule, cluster, world
        self.extract = KeyExtractor(task, step_ahead=self.dbp or self.semi_async or self.six_stage)
        self.lookahead = 2 if self.six_stage else 1  # coming steps ``step`` wants: upcoming (, following)
        # six-stage: t+1's rows are read during step t, before its update (one step stale, as semi-async);
        # False only for the negative control (the stage order broken: read after the update, fresh)
        self.read_ahead = True
        self._routing: Optional[tuple[Batch, list[Batch], object, int]] = None  # six-stage: t+2, being routed
        self.seconds = {"key_extraction": 0.0, "clustering": 0.0}
        self.unique_ids = {"clustered": 0, "unclustered": 0}
        self._upcoming: Optional[tuple[Batch, list[Batch], list, int]] = None  # DBP: the next step, routed
        # the fewest rows a rank gets of a global batch (equal slices unless the trainer balances)
        self.fewest_rows: Callable[[Batch], int] = lambda batch: batch["ids"].shape[0] // world
        # called as (i, n) before micro-batch i of n runs its backward: the trainer arms the overlapped
        # dense all-reduce before the last one (``grad_sync.py``; i == n - 1)
        self.before_backward: Optional[Callable[[int, int], None]] = None

    def check_runtime(self, runtime: Optional[SparseRuntime]) -> None:
        """Raise ``PipelineUnsupported`` where the schedule cannot hold."""
        if runtime is None:
            raise PipelineUnsupported("there are no sharded tables to overlap (one process, no sparse runtime)")
        if runtime.dynamic is not None:
            raise PipelineUnsupported("dynamic hash tables apply their update at the end of every backward, "
                                      "inside the window that FWP needs frozen, and their rows cannot be prefetched")
        if not hasattr(runtime.tables, "_shard"):
            raise PipelineUnsupported("the frozen window needs the update after the last micro-batch; TorchRec's "
                                      "fused optimizer updates in every backward (use --sparse-backend native)")
        if getattr(runtime.tables, "hsp", False) and (self.dbp or self.semi_async or self.six_stage):
            raise PipelineUnsupported("with hierarchical sparse parallelism (--hsp-group-size) other groups' gradients "
                                      "update a shard's rows too, so a prefetched row's freshness is not known "
                                      "locally: use --pipeline fwp")

    def check_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """DBP refreshes the prefetched rows the last step read: the optimizer must move no other
        rows (SGD without momentum or weight decay, Adagrad without weight decay, row-wise Adagrad)."""
        if not self.dbp:
            return
        shard_params = {id(p) for p in self.runtime.tables.parameters()}
        for opt in optimizers:
            for group in opt.param_groups:
                if not any(id(p) in shard_params for p in group["params"]):
                    continue
                if not moves_only_rows_with_gradient(opt, group):
                    raise PipelineUnsupported(
                        f"DBP: {type(opt).__name__} moves table rows that got no gradient (momentum or weight decay), "
                        f"so rows prefetched before an update could be stale: use --sparse-optimizer sgd, adagrad "
                        f"or rowwise_adagrad")

    def verify(self, inputs: tuple[torch.Tensor, ...], run_forward_backward: Callable[[], None]) -> Optional[str]:
        """Run one ordinary (sync) step's forward/backward while recording the lookups it makes and
        compare them with the extracted keys; every rank must agree. ``None`` when they match."""
        reason = None
        try:
            expected = self.extract(*inputs)
        except PipelineUnsupported as e:
            reason, expected = str(e), []
        except Exception as e:  # noqa: BLE001 - any failure here must reach the all-reduce below, not one rank only
            reason, expected = f"extracting the lookup keys failed ({type(e).__name__}: {e})", []
        self.runtime.recorded = []
        try:
            run_forward_backward()
            recorded = self.runtime.recorded
        finally:
            self.runtime.recorded = None
        if reason is None:
            reason = _compare(expected, recorded, self.runtime)
        ok = torch.tensor([0 if reason else 1])
        if dist.is_initialized():
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if reason is None and not int(ok):
            reason = "another rank's lookups did not match their extracted keys"
        return reason

    def parts(self, local: Batch, fewest_rows: int) -> list[torch.Tensor]:
        """Micro-batches of this rank's rows: as many on every rank (each one is collectives), so
        bounded by ``fewest_rows``, the fewest rows any rank has in this step."""
        rows = local["ids"].shape[0]
        n = max(1, min(self.micro_batches, fewest_rows, rows)) if self.micro_batches > 1 else 1
        start = time.perf_counter()
        plain = list(torch.tensor_split(torch.arange(rows), n))
        clustered = cluster_rows(local["ids"], n)  # also without clustering: unique_ids compares both
        self.seconds["clustering"] += time.perf_counter() - start
        self.unique_ids["clustered"] += unique_ids_sent(local["ids"], clustered)
        self.unique_ids["unclustered"] += unique_ids_sent(local["ids"], plain)
        return clustered if self.cluster else plain

    def _micro(self, batch: Batch, local: Batch) -> list[Batch]:
        # one micro-batch: the fewest rows do not matter (and are not asked: a balanced batch's
        # assignment may be computed on another thread, six-stage's data stage)
        fewest = self.fewest_rows(batch) if self.micro_batches > 1 else 1
        return [{k: v[rows] for k, v in local.items()} for rows in self.parts(local, fewest)]

    def _plan(self, batch: Batch, local: Batch) -> tuple[list[Batch], list[list], int]:
        """Micro-batches, their lookup keys, the global batch's target count."""
        micro = self._micro(batch, local)
        start = time.perf_counter()
        keys = [self.extract(mb["ids"], mb["timestamps"], mb["negatives"]) for mb in micro]
        self.seconds["key_extraction"] += time.perf_counter() - start
        return micro, keys, max(self.task.count_targets(batch["ids"]), 1)

    def step(self, step_fn: Callable[..., torch.Tensor], batch: Batch, local: Batch,
             upcoming: Optional[tuple[Batch, Batch]] = None,
             following: Optional[tuple[Batch, Batch]] = None) -> torch.Tensor:
        """``upcoming``: the next step's ``(batch, local)`` — DBP routes its keys and reads its rows
        during this step; its buffers are brought up to date when that step begins.

        Every micro-batch's keys are routed at the start, before any embedding is on the wire (a
        small id all-to-all queued behind megabytes of embeddings would wait for them); then the
        exchanges go one micro-batch ahead of the compute.

        ``following``: the step after the next one's ``(batch, local)`` (six-stage routes its keys
        during this step; the other schedules ignore it)."""
        if self.six_stage:
            return self._six_stage_step(step_fn, batch, local, upcoming, following)
        runtime = self.runtime
        ahead = self.dbp or self.semi_async
        if ahead and self._upcoming is not None and self._upcoming[0] is batch:
            _, micro, keys, global_targets = self._upcoming  # routed (semi-async: and sent) last step
        else:
            runtime.discard_prefetched()
            if self.dbp:
                runtime.track_updates()
            micro, keys, global_targets = self._plan(batch, local)
            runtime.prefetch([k for mb in keys for k in mb], exchange=self.semi_async, buffered=self.dbp)
        self._upcoming = None
        if ahead and upcoming is not None:  # the next batch's key routing and retrieval
            next_micro, next_keys, next_targets = self._plan(*upcoming)
            # semi-async: sent now, read before this step's update: one step stale (TurboGR §4.2.2)
            runtime.prefetch([k for mb in next_keys for k in mb], exchange=self.semi_async, buffered=True)
            self._upcoming = (upcoming[0], next_micro, next_keys, next_targets)
        runtime.defer_sparse_backward(self.fwp)
        total = torch.zeros(())
        try:
            if not self.semi_async:
                runtime.exchange_routed(len(keys[0]))  # DBP: buffers synced with the last update first
            for i, mb in enumerate(micro):
                if i + 1 < len(micro) and not self.semi_async:
                    runtime.exchange_routed(len(keys[i + 1]))  # its embeddings travel while this one computes
                loss = step_fn(mb["ids"], mb["timestamps"], mb["negatives"]) \
                    * (self.task.count_targets(mb["ids"]) / global_targets)
                if self.before_backward is not None:
                    self.before_backward(i, len(micro))
                loss.backward()  # with FWP the sparse part of it goes on on the gradient thread
                total = total + loss.detach()
            self._drain(sum(len(mb) for mb in self._upcoming[2]) if self._upcoming else 0)  # the next step's
        finally:
            runtime.defer_sparse_backward(False)
        return total

    # -- TurboGR's six-stage schedule (§4.2.3, App. D) ---------------------------------------------
    def _route(self, batch: Batch, local: Batch) -> tuple[Batch, list[Batch], object, int]:
        """Stage 2 started: the micro-batch and the key graph bound here (a new input shape is
        traced on this thread), extraction and routing on the runtime's routing thread."""
        micro = self._micro(batch, local)
        start = time.perf_counter()
        extracts = [self.extract.bind(mb["ids"], mb["timestamps"], mb["negatives"]) for mb in micro]
        self.seconds["key_extraction"] += time.perf_counter() - start
        routing = self.runtime.start_routing(lambda: [k for extract in extracts for k in extract()])
        return batch, micro, routing, max(self.task.count_targets(batch["ids"]), 1)

    def _six_stage_step(self, step_fn: Callable[..., torch.Tensor], batch: Batch, local: Batch,
                        upcoming: Optional[tuple[Batch, Batch]],
                        following: Optional[tuple[Batch, Batch]]) -> torch.Tensor:
        """Step t, one batch per stage: (1, the dataloader, is the caller's: t+3 on its thread) —
        2. t+2's key routing started on the routing thread — 3. t+1's routing waited — 4. t+1's
        rows read (before t's update: one step stale, as semi-async) and sent in the background —
        5. t's forward and backward (its embeddings sent during step t−1) — 6. t's gradient
        exchange on the gradient thread, waited here, before the caller's update."""
        runtime = self.runtime
        if self._upcoming is not None and self._upcoming[0] is batch:
            _, micro, _, global_targets = self._upcoming  # stages 2–4 ran during the last two steps
            if not self.read_ahead:
                runtime.exchange_routed()  # negative control: t's rows read only now, after t−1's update
        else:  # a cold start: this step's keys routed and its rows read now (as semi-async's first step)
            self._routing = None
            runtime.discard_prefetched()
            _, micro, routing, global_targets = self._route(batch, local)
            runtime.take_routed(routing)
        self._upcoming = None
        routing_next = self._routing if (self._routing is not None and upcoming is not None
                                         and self._routing[0] is upcoming[0]) else None
        if routing_next is None and self._routing is not None:
            runtime.discard_routing(self._routing[2])  # routed for a batch that is not coming
        if routing_next is None and upcoming is not None:
            routing_next = self._route(*upcoming)
        self._routing = self._route(*following) if upcoming is not None and following is not None else None
        if routing_next is not None:
            count = runtime.take_routed(routing_next[2], exchange=self.read_ahead)
            self._upcoming = (routing_next[0], routing_next[1], count, routing_next[3])
        runtime.defer_sparse_backward(True)
        total = torch.zeros(())
        try:
            for i, mb in enumerate(micro):
                loss = step_fn(mb["ids"], mb["timestamps"], mb["negatives"]) \
                    * (self.task.count_targets(mb["ids"]) / global_targets)
                if self.before_backward is not None:
                    self.before_backward(i, len(micro))
                loss.backward()  # the sparse part of it goes on on the gradient thread
                total = total + loss.detach()
            self._drain(self._upcoming[2] if self._upcoming else 0)
        finally:
            runtime.defer_sparse_backward(False)
        return total

    def _drain(self, ahead: int) -> None:
        """After the last micro-batch: the gradient exchanges finished, and only the next step's
        ``ahead`` lookups still prefetched (fewer used than extracted is a bug, said so)."""
        self.runtime.drain()
        if self.runtime.prefetched() != ahead:
            raise RuntimeError(f"sparse pipeline: {self.runtime.prefetched() - ahead} prefetched lookups were never "
                               f"used (the forward made fewer lookups than were extracted ahead of it)")

    def discard(self) -> None:
        """Before an evaluation or at the end: nothing of a next step stays prefetched (or routed)."""
        self._upcoming, self._routing = None, None
        if self.runtime is not None:
            self.runtime.discard_prefetched()
            self.runtime.track_updates(False)  # a cold start routes afresh; no evaluation read is kept


class DataStage:
    """Six-stage's first stage, the dataloader: ``iterable`` drawn on a thread of its own, one item
    ahead of the consumer (a bounded queue of one: while the trainer runs step t with t+1 and t+2
    in hand, the thread prepares t+3 — the batch and its rank slice — and waits). Items come in
    order; an error on the thread is raised here, at the item it replaced. ``close()`` (or the end
    of the iteration) stops the thread."""

    _END = object()

    def __init__(self, iterable: Iterable[Any], name: str = "grcompile-data-stage") -> None:
        self._source = iter(iterable)
        self._slot = threading.Semaphore(1)  # the thread may prepare one item before it is taken
        self._ready = threading.Semaphore(0)
        self._item: Any = None
        self._error: Optional[BaseException] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._slot.acquire()
            if self._stop.is_set():
                return
            try:
                item = next(self._source)
            except StopIteration:
                item = self._END
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                self._error, item = e, self._END
            self._item = item
            self._ready.release()
            if item is self._END:
                return

    def __iter__(self) -> Iterator[Any]:
        try:
            while True:
                self._ready.acquire()
                item, self._item = self._item, None
                if item is self._END:
                    if self._error is not None:
                        raise self._error
                    return
                self._slot.release()  # the thread prepares the next one while this one is used
                yield item
        finally:
            self.close()

    def close(self) -> None:
        self._stop.set()
        self._slot.release()  # wake the thread if it waits for a slot
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=60)


def setup_pipeline(task: nn.Module, config, parallel, optimizers: list, log) -> tuple[Optional[SparsePipeline], dict]:
    """The trainer's pipeline for ``config.pipeline`` (``None``: sync), and what to record about
    it: asked for, running, and why not when it declined (the training is the same either way)."""
    info = {"requested": config.pipeline, "running": "sync", "reason": None, "verified": False}
    if config.pipeline == "sync":
        return None, info
    pipeline = SparsePipeline(task, parallel.runtime, config.micro_batches, schedule=config.pipeline,
                              world=parallel.world)
    try:
        pipeline.check_runtime(parallel.runtime)
        pipeline.check_optimizers(optimizers)
    except PipelineUnsupported as e:
        info["reason"] = str(e)
        log(f"[grcompile.train] --pipeline {config.pipeline} declined, running sync: {e}")
        return None, info
    pipeline.fewest_rows = lambda batch: min(len(rows) for rows in parallel.assignment(batch))
    info["running"] = config.pipeline + " (from the second step: the first one checks the extracted keys)"
    if config.pipeline in STALE:
        info["running"] += "; STALE: embeddings one step behind the synchronous training"
        log(f"[grcompile.train] --pipeline {config.pipeline}: embeddings are one step STALE (TurboGR's semi-async"
            f"{'; six stages, the same training as semi-async' if config.pipeline == 'six-stage' else ''}); "
            f"the training is not the synchronous one")
    return pipeline, info


def _compare(expected: list[tuple[str, torch.Tensor]], recorded: list[tuple[str, torch.Tensor]],
             runtime: SparseRuntime) -> Optional[str]:
    """Same valid ids per feature, in the same order per feature (features may interleave)."""
    def per_feature(pairs):
        out: dict[str, list[torch.Tensor]] = {}
        for feature, ids in pairs:
            out.setdefault(feature, []).append(ids)
        return out

    # the recorded ids are the lookups' valid ids already; the extracted ones still hold padding
    want = per_feature((f, runtime.valid_ids(f, ids)[1]) for f, ids in expected)
    got = per_feature(recorded)
    for feature in sorted(set(want) | set(got)):
        a, b = want.get(feature, []), got.get(feature, [])
        if len(a) != len(b):
            return (f"feature {feature!r}: the forward made {len(b)} lookups, {len(a)} were found in its trace")
        for k, (x, y) in enumerate(zip(a, b)):
            if not torch.equal(x, y):
                return f"feature {feature!r}: lookup {k} asked for other ids than its extracted keys"
    return None


__all__ = ["DataStage", "SparsePipeline", "setup_pipeline", "KeyExtractor", "PIPELINES", "PipelineUnsupported",
           "cluster_rows", "unique_ids_sent"]
