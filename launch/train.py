"""Single-process training loop: AdamW, warmup + cosine LR, clipping, accumulation, metrics, checkpoints."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from launch.checkpoint import load_checkpoint, save_checkpoint
from launch.config import RunConfig
from launch.data import ByteTokenizer, PackedBatches, load_token_stream
from launch.metrics import JsonlWriter, expert_load_summary
from moe.model import MoETransformer
from optim.lr_schedule import warmup_cosine


def build_optimizer(model: nn.Module, cfg: RunConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and expert stacks only (not norms or router bias)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.train.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2))


@torch.no_grad()
def evaluate(model: MoETransformer, batches: PackedBatches, num_batches: int) -> float:
    """Mean LM loss over the first num_batches held-out batches (always the same ones)."""
    model.eval()
    losses = [model(inputs, labels).lm_loss.item() for inputs, labels in batches.in_order(num_batches)]
    model.train()
    return sum(losses) / len(losses)


def _accumulate_step(model: MoETransformer, batches: PackedBatches, accum: int) -> dict:
    """Forward/backward over accum micro-batches; returns summed losses and expert loads."""
    totals = {"loss": 0.0, "lm_loss": 0.0, "aux_loss": 0.0, "dropped_tokens": 0, "tokens": 0}
    loads = [torch.zeros_like(layer.router.expert_bias, dtype=torch.long) for layer in model.moe_layers()]
    for _ in range(accum):
        inputs, labels = batches.next_batch()
        out = model(inputs, labels)
        (out.loss / accum).backward()
        totals["loss"] += out.loss.item() / accum
        totals["lm_loss"] += out.lm_loss.item() / accum
        totals["aux_loss"] += out.aux_loss.item() / accum
        totals["tokens"] += inputs.numel()
        for load, stats in zip(loads, out.moe_stats):
            load += stats.tokens_per_expert
            totals["dropped_tokens"] += int(stats.dropped)
    totals["loads"] = loads
    return totals


def train(cfg: RunConfig, metrics_out: str | Path | None = None, resume: bool = False,
          progress: bool = True) -> list[dict]:
    """Train cfg's model on cfg's corpus; returns the per-step metric records (also written as JSONL)."""
    run_dir = Path(cfg.train.run_dir)
    metrics_path = Path(metrics_out) if metrics_out else run_dir / "metrics.jsonl"
    checkpoint_path = run_dir / "checkpoint.pt"
    torch.manual_seed(cfg.train.seed)
    dtype = getattr(torch, cfg.train.dtype)
    model = MoETransformer(cfg.model).to(dtype)
    optimizer = build_optimizer(model, cfg)
    settings = cfg.train
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, settings.warmup_steps, settings.steps, settings.min_lr_ratio))
    stream = load_token_stream(cfg.data.corpus, cfg.data.max_bytes, ByteTokenizer())
    eval_tokens = int(stream.numel() * cfg.data.eval_fraction)
    batches = PackedBatches(stream[: stream.numel() - eval_tokens], settings.seq_len,
                            settings.micro_batch_size, settings.seed)
    eval_batches = (PackedBatches(stream[stream.numel() - eval_tokens:], settings.seq_len,
                                  settings.micro_batch_size, settings.seed)
                    if eval_tokens and settings.eval_batches else None)
    start = 0
    if resume and checkpoint_path.exists():
        state = load_checkpoint(checkpoint_path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        batches.load_state_dict(state["data"])
        start = state["step"]
    writer = JsonlWriter(metrics_path, append=start > 0)
    records = []

    def checkpoint(step: int) -> None:
        save_checkpoint(checkpoint_path, {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "data": batches.state_dict(), "step": step,
            "config": dataclasses.asdict(cfg)})

    bar = tqdm(range(start, settings.steps), disable=not progress, desc="train", unit="step")
    for step in bar:
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        totals = _accumulate_step(model, batches, settings.grad_accum_steps)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        if cfg.model.bias_update_rate:
            model.update_expert_bias(totals["loads"])
        elapsed = time.perf_counter() - began
        record = {"step": step, "loss": totals["loss"], "lm_loss": totals["lm_loss"],
                  "aux_loss": totals["aux_loss"], "grad_norm": grad_norm.item(), "lr": lr,
                  "tokens_per_s": totals["tokens"] / elapsed, "dropped_tokens": totals["dropped_tokens"],
                  **expert_load_summary(totals["loads"])}
        last = step + 1 == settings.steps
        if eval_batches is not None and (last or (settings.eval_every and step % settings.eval_every == 0)):
            record["eval_lm_loss"] = evaluate(model, eval_batches, settings.eval_batches)
        writer.write(record)
        records.append(record)
        bar.set_postfix(loss=f"{record['lm_loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        if settings.checkpoint_every and (step + 1) % settings.checkpoint_every == 0:
            checkpoint(step + 1)
    writer.close()
    checkpoint(settings.steps)
    return records
