"""The training loop: sampled-softmax next-item retrieval, Adam, per-epoch validation with early
stopping on NDCG@10, test metrics of the best validation state."""
from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from tqdm import tqdm

from models import SampledSoftmaxRetrieval, build_encoder

from ..data import EvalLoader, TrainLoader, get_dataset
from ..data.stochastic_length import LoadBalancedStochasticLength, lbsl_cut
from ..data.token_batching import TokenBudgetLoader
from ..runtime.sparse import dense_parameters
from . import checkpoint
from .config import TrainConfig, resolve_sparse_optimizer
from .grad_sync import OverlappedAllReduce
from .metrics import evaluate
from .pipeline import PIPELINES, STALE, DataStage, setup_pipeline
from .parallel import Parallel, StepTiming, dense_state, load_distributed, make_optimizers, save_distributed


def build(config: TrainConfig):
    """Dataset split, encoder, loss module (uncompiled) — identical for every compile mode."""
    ds = get_dataset(config.data, max_len=config.max_len or 200, seed=config.seed, k_core=config.k_core,
                     **config.synthetic)
    split = ds.leave_one_out()
    torch.manual_seed(config.seed)
    encoder = build_encoder(config.model, config.preset, ds.num_items, max_len=config.max_len,
                            **config.model_overrides)
    task = SampledSoftmaxRetrieval(encoder, temperature=config.temperature)
    return ds, split, encoder, task


def train(config: TrainConfig, *, checkpoint_dir: str | None = None, resume: bool = False,
          progress: bool = True, log=print, fail_at_step: int | None = None,
          return_weights: bool = False) -> dict[str, Any]:
    """Train, validate every ``eval_every`` epochs, test the best state. Under torchrun with
    ``config.sharding`` the sparse tables are sharded (``parallel.py``); ``fail_at_step`` kills the
    last rank at that step (fault injection for the resume tests); ``return_weights`` adds the final
    sparse feature tables (``feature_weights``) and dense state (``dense_weights``) to the result."""
    config.validate()
    config = resolve_sparse_optimizer(config)
    if config.threads:
        torch.set_num_threads(config.threads)
    ds, split, encoder, task = build(config)
    parallel = Parallel.setup(task, config, log)
    leader = parallel.rank == 0
    log = log if leader else (lambda *a, **k: None)
    progress = progress and leader
    max_len = encoder.config.max_len
    loader = _train_loader(config, split, ds, max_len, parallel)
    valid_loader = EvalLoader(split.valid, config.eval_batch_size, max_len)
    test_loader = EvalLoader(split.test, config.eval_batch_size, max_len)
    optimizers = make_optimizers(task, config, parallel)
    if checkpoint_dir is not None:
        parallel.check_checkpointable()

    from ..modes import apply_compile_mode, describe_mode
    compiled = apply_compile_mode(task, config.compile, **({"precision": "fp8"} if config.precision == "fp8" else {}))
    step_fn = _with_precision(compiled, config.precision)
    where = f" on {parallel.world} ranks, sharding {config.sharding}" if parallel.distributed else ""
    log(f"[grcompile.train] {config.model}/{config.preset} on {ds.name}{where}: {len(split.train)} users, "
        f"{ds.num_items} items, max_len {max_len}, {len(loader)} steps/epoch; {describe_mode(compiled)}, {config.precision}")
    log(f"[grcompile.train] sparse optimizer {config.sparse_optimizer}: {config.sparse_optimizer_reason}")
    pipeline, pipeline_info = setup_pipeline(task, config, parallel, optimizers, log)
    overlap = _overlapped_all_reduce(task, config, parallel, log)
    if pipeline is not None and overlap is not None:  # armed before the last micro-batch's backward only
        pipeline.before_backward = lambda i, n: overlap.arm() if i == n - 1 else None

    lbsl = LoadBalancedStochasticLength(parallel.world, max_len, seed=config.seed) if config.lbsl else None
    state: dict[str, Any] = dict(epoch=0, step_in_epoch=0, global_step=0, losses=[], valid_history=[],
                                 best_metric=-math.inf, best_epoch=-1, best_state=None, bad_epochs=0,
                                 train_seconds=0.0, valid_tokens=0, world=parallel.world)
    torch.manual_seed(config.seed + 1_000_003 * parallel.rank)  # rank 0 keeps the one-process stream
    if resume:
        if checkpoint_dir is None:
            raise ValueError("--resume needs --checkpoint-dir")

        def check_config(saved: dict[str, Any], path) -> None:  # before any weight is loaded
            # fields newer than the checkpoint count as their defaults (what that run did)
            written = _resume_key({**_resume_key(TrainConfig()), **saved.get("config", {})})
            differences = checkpoint.config_differences(written, _resume_key(config))
            if differences:
                raise ValueError(f"--resume: the checkpoint {path} was written by a run with a different config: "
                                 + "; ".join(differences))

        if parallel.distributed:
            saved = load_distributed(checkpoint_dir, parallel, task, optimizers, check_config)
        else:
            saved = checkpoint.load(checkpoint_dir)
            check_config(saved, saved["resumed"].path)
            parallel.load_local_checkpoint(task, optimizers, saved)
        if saved["rng"] is not None:
            torch.set_rng_state(saved["rng"])
        state = saved["state"]
        written_by = state.get("world", parallel.world)
        if (config.lbsl or config.token_budget is not None) and written_by != parallel.world:
            raise ValueError(f"--resume: the checkpoint was written by {written_by} ranks and this run has "
                             f"{parallel.world}: with --lbsl / --token-budget the data of a step depends on the "
                             f"number of ranks; resume with {written_by}")
        if lbsl is not None:
            lbsl.load_state_dict(state["lbsl"])
        resumed = saved["resumed"]
        log(f"[grcompile.train] resumed at epoch {state['epoch']} step {state['step_in_epoch']} from {resumed.path}"
            + ("" if resumed.verified else " (unverified: no checksums)")
            + (f", after skipping damaged checkpoints: {'; '.join(resumed.skipped)}" if resumed.skipped else ""))

    def save_checkpoint() -> None:
        if checkpoint_dir is None:
            return
        extra = dict(config=_resume_key(config), state=state)
        if parallel.distributed:
            save_distributed(checkpoint_dir, parallel, task, optimizers, extra)
        else:
            checkpoint.save(checkpoint_dir, dict(**parallel.local_checkpoint(task, optimizers),
                                                 rng=torch.get_rng_state(), **extra))

    timing = StepTiming(parallel)
    started = time.perf_counter() - state["train_seconds"]
    stop_reason = "epochs"
    task.train()
    if config.steps is not None and state["global_step"] >= config.steps:
        stop_reason = "steps"  # a resumed run that is already there: evaluate only
    while state["epoch"] < config.epochs and stop_reason == "epochs":
        epoch = state["epoch"]
        epoch_steps = _steps(loader, parallel, task, epoch, state["step_in_epoch"], lbsl, state["global_step"])
        # six-stage: the dataloader is a stage of its own (a thread one batch ahead); the pipeline
        # routes two steps ahead, so it is handed the next two
        data_stage = DataStage(epoch_steps) if pipeline is not None and config.pipeline == "six-stage" else None
        bar = tqdm(_with_next(data_stage if data_stage is not None else epoch_steps,
                              pipeline.lookahead if pipeline is not None else 1), total=len(loader),
                   initial=state["step_in_epoch"], desc=f"epoch {epoch}", disable=not progress, mininterval=2.0,
                   leave=False)
        epoch_start, epoch_tokens, stopped = time.perf_counter(), 0, False
        for step, ahead in bar:
            next_step = ahead[0] if ahead else None
            if fail_at_step is not None and state["global_step"] == fail_at_step and parallel.rank == parallel.world - 1:
                os.kill(os.getpid(), signal.SIGKILL)  # a rank dies mid-run, no goodbye
            timing.begin()
            parallel.begin_step()
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            batch, local = step.batch, step.local
            if pipeline is not None and pipeline_info["verified"]:
                loss = pipeline.step(step_fn, batch, local, *[(s.batch, s.local) for s in ahead])
            else:
                def forward_backward() -> None:
                    nonlocal loss
                    loss = step_fn(local["ids"], local["timestamps"], local["negatives"]) * step.weight
                    if overlap is not None:
                        overlap.arm()  # the step's only backward
                    loss.backward()

                if pipeline is None:
                    forward_backward()
                else:  # the first step: synchronous, and checks the keys the pipeline would extract
                    reason = pipeline.verify((local["ids"], local["timestamps"], local["negatives"]), forward_backward)
                    pipeline_info.update(verified=reason is None, reason=reason)
                    if reason is not None:
                        log(f"[grcompile.train] --pipeline {config.pipeline} declined, running sync: {reason}")
                        pipeline_info["running"], pipeline = "sync", None
            _sync_gradients(parallel, task, overlap)
            for opt in optimizers:
                opt.step()
            timing.end()
            tokens = step.tokens
            epoch_tokens += tokens
            state["valid_tokens"] += tokens
            state["losses"].append(parallel.global_loss(loss))
            state["global_step"] += 1
            state["step_in_epoch"] += 1
            if lbsl is not None:  # what the next step starts from (the lookahead may have drawn it already)
                state["lbsl"] = next_step.lbsl_before if next_step is not None else lbsl.state_dict()
            bar.set_postfix(loss=f"{state['losses'][-1]:.4f}",
                            tok_s=f"{epoch_tokens / max(time.perf_counter() - epoch_start, 1e-9):.0f}", refresh=False)
            if config.steps is not None and state["global_step"] >= config.steps:
                stop_reason, stopped = "steps", True
                break
            if config.max_minutes is not None and parallel.agree(time.perf_counter() - started > 60 * config.max_minutes):
                stop_reason, stopped = "max_minutes", True
                break
            if config.checkpoint_every and state["global_step"] % config.checkpoint_every == 0:
                state["train_seconds"] = time.perf_counter() - started
                save_checkpoint()
        bar.close()
        if data_stage is not None:
            data_stage.close()
        if pipeline is not None:
            pipeline.discard()  # nothing of a next step stays prefetched into the evaluation
        state["train_seconds"] = time.perf_counter() - started
        if stopped:
            save_checkpoint()
            break
        state["epoch"], state["step_in_epoch"] = epoch + 1, 0
        if (epoch + 1) % config.eval_every == 0 or epoch + 1 == config.epochs:
            metrics = evaluate(encoder, valid_loader)
            metrics["epoch"] = epoch + 1
            state["valid_history"].append(metrics)
            improved = metrics["ndcg@10"] > state["best_metric"]
            if improved:
                state.update(best_metric=metrics["ndcg@10"], best_epoch=epoch + 1, bad_epochs=0,
                             best_state=parallel.snapshot(task))
            else:
                state["bad_epochs"] += config.eval_every
            recent = state["losses"][-len(loader):]
            log(f"epoch {epoch + 1}: loss {np.mean(recent):.4f}  valid hr@10 {metrics['hr@10']:.4f} "
                f"ndcg@10 {metrics['ndcg@10']:.4f}{' *' if improved else ''}  "
                f"{(time.perf_counter() - epoch_start) / 60:.2f} min")
        state["train_seconds"] = time.perf_counter() - started
        save_checkpoint()
        if state["bad_epochs"] >= config.patience:
            stop_reason = "early_stopping"
            break

    train_stats = parallel.sparse_stats()  # the training steps' lookups (evaluation's are not counted)
    if state["best_state"] is not None:
        parallel.restore(task, state["best_state"])
    test = evaluate(encoder, test_loader)
    epochs_done = state["epoch"] + state["step_in_epoch"] / len(loader)
    result = {
        "config": config.to_dict(),
        "dataset": ds.name,
        "num_items": ds.num_items,
        "world_size": parallel.world,
        "losses": state["losses"],
        "final_loss": state["losses"][-1] if state["losses"] else None,
        **{k: v for k, v in test.items() if k != "examples"},
        "test": test,
        "valid_history": state["valid_history"],
        "best_epoch": state["best_epoch"],
        "epochs_run": epochs_done,
        "steps_run": state["global_step"],
        "stop_reason": stop_reason,
        "train_minutes": state["train_seconds"] / 60,
        "minutes_per_epoch": state["train_seconds"] / 60 / max(epochs_done, 1e-9),
        "tokens_per_s": state["valid_tokens"] / max(state["train_seconds"], 1e-9),
        "train_tokens": state["valid_tokens"],  # valid tokens trained on (all ranks)
        "compile_mode": describe_mode(compiled),
        "precision": config.precision,
        "pipeline": {k: v for k, v in pipeline_info.items() if k != "verified"},
        "dense_all_reduce": ({"overlapped": True, "buckets": len(overlap.buckets), "bucket_mb": config.bucket_mb,
                              "buckets_sent_during_backward": overlap.launched_in_backward}
                             if overlap is not None else {"overlapped": False}),
        "step_time_ms": timing.summary(),
    }
    if return_weights:
        result["feature_weights"] = parallel.feature_weights(task)
        result["dense_weights"] = dense_state(task)
    if parallel.distributed:
        result["sparse_stats"] = train_stats
    return result


def _overlapped_all_reduce(task, config: TrainConfig, parallel: Parallel, log) -> Optional[OverlappedAllReduce]:
    """``--overlap-allreduce`` on ranks: the dense gradients' all-reduce in buckets launched by
    gradient hooks during the step's last backward, on a process group of its own (every rank makes
    it here, in the same order as the other groups); ``None`` in one process or when not asked."""
    if not (config.overlap_allreduce and parallel.distributed):
        return None
    import torch.distributed as dist

    dense = [p for p in dense_parameters(task) if p.requires_grad]
    overlap = OverlappedAllReduce(dense, dist.new_group(), config.bucket_mb)
    sizes = ", ".join(f"{sum(p.numel() * p.element_size() for p in b) / 2 ** 20:.2f}" for b in overlap.buckets)
    log(f"[grcompile.train] dense all-reduce overlapped with the last backward: {len(overlap.buckets)} bucket(s) "
        f"of {sizes} MB (cap {config.bucket_mb:g} MB) on a process group of its own")
    return overlap


def _sync_gradients(parallel: Parallel, task, overlap: Optional[OverlappedAllReduce]) -> None:
    """``parallel.sync_gradients``, with the dense all-reduce finished by ``overlap`` where it runs:
    what ``finish()`` still waits for is counted as the step's dense all-reduce time."""
    if overlap is None:
        parallel.sync_gradients(task)
        return
    start = time.perf_counter()
    if parallel.runtime is not None:
        parallel.runtime.after_backward()
    middle = time.perf_counter()
    parallel.seconds["hsp_sync"] += middle - start
    overlap.finish()
    parallel.seconds["dense_all_reduce"] += time.perf_counter() - middle


@dataclass
class _Step:
    batch: Optional[dict]  # the global batch (None with token budgets: every rank has its own)
    local: dict  # this rank's batch
    weight: float  # its mean loss times this is its share of the global mean
    tokens: int  # valid tokens of the step, all ranks
    lbsl_before: Optional[dict] = None  # LBSL's state before this step (checkpoints)


def _with_precision(step_fn, precision: str):
    """``step_fn`` under ``torch.autocast(bfloat16)`` for ``bf16`` / ``fp8`` (the training steps
    only: parameters, optimizer state and evaluation stay float32)."""
    if precision == "fp32":
        return step_fn
    device = next(step_fn.parameters()).device.type

    def step(*args, **kwargs):
        with torch.autocast(device, dtype=torch.bfloat16):
            return step_fn(*args, **kwargs)
    return step


def _train_loader(config: TrainConfig, split, ds, max_len: int, parallel):
    per_position = config.negatives == "per-position"
    if config.token_budget is None:
        return TrainLoader(split.train, config.batch_size, max_len, ds.num_items, config.num_negatives, config.seed,
                           per_position=per_position)
    return _TokenBudget(split.train, parallel.world, max_len, ds.num_items, token_budget=config.token_budget,
                        num_negatives=config.num_negatives, seed=config.seed, per_position=per_position)


class _TokenBudget(TokenBudgetLoader):
    def __len__(self) -> int:
        return self.steps(0)  # for progress and epoch fractions: steps vary a little per epoch


def _steps(loader, parallel, task, epoch: int, start: int, lbsl=None, global_step: int = 0):
    """The steps of ``epoch`` from ``start``: row-count batches sliced (or balanced) per rank, or
    token-budget batches cut per rank (MTGRBoost Alg. 1, ``data/token_batching.py``); with
    ``lbsl`` the global batch's sequences are cut first (ULTRA-HSTU's LBSL, every rank alike)."""
    if isinstance(loader, TokenBudgetLoader):
        for step in loader.iterate(epoch, start):
            yield _Step(None, step.batches[parallel.rank], float(step.weights[parallel.rank]),
                        sum(int((b["ids"] != 0).sum()) for b in step.batches))
        return
    for offset, batch in enumerate(loader.iterate(epoch, start)):
        before = None
        if lbsl is not None:
            before = lbsl.state_dict()
            parts = parallel.assignment(batch)
            batch = lbsl_cut(lbsl, global_step + offset, batch, parts)
            parallel.pin_assignment(batch, parts)
        local = parallel.local(batch)
        yield _Step(batch, local, parallel.loss_weight(task, batch, local), int((batch["ids"] != 0).sum()), before)


def _with_next(batches, depth: int = 1):
    """``(batch, [the next up to ``depth`` batches])``: DBP and semi-async route a step ahead,
    six-stage two."""
    iterator = iter(batches)
    window = [b for b in (next(iterator, None) for _ in range(depth + 1)) if b is not None]
    while window:
        yield window[0], window[1:]
        window = window[1:]
        following = next(iterator, None)
        if following is not None:
            window.append(following)


def _resume_key(config: TrainConfig | dict[str, Any]) -> dict[str, Any]:
    """The config minus the fields a resumed run may change (where to stop, how the same step is
    run); also of a key written by an older version (its extra fields dropped the same way)."""
    key = dict(config) if isinstance(config, dict) else config.to_dict()
    if key.get("pipeline") in PIPELINES:  # the exact schedules are one algorithm
        key["pipeline"] = "stale" if key["pipeline"] in STALE else "synchronous"
    if key.get("precision", "fp32") == "fp32":  # keys written before the field existed were fp32
        key.pop("precision", None)
    for field in ("epochs", "steps", "max_minutes", "threads", "sharding", "hsp_group_size", "dedup",
                  "checkpoint_every", "sparse_optimizer_reason", "micro_batches", "balance", "overlap_allreduce",
                  "bucket_mb"):
        key.pop(field, None)
    return key
