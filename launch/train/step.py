"""One training step's work on a rank: forward and backward over its micro-batches (through the pipeline
runtime, or a loop over micro-batches with pp = 1), the step's one statistics all-reduce and copy to the host,
the expert-bias update, the metrics record, and the held-out evaluation."""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from dispatch.traffic import FIELDS
from dispatch.upload import upload
from dispatch.progress import ACTION, mark
from launch.config.run import RunConfig
from launch.data.feed import DataFeed, MicroBatch
from launch.data.tokenizer import load_tokenizer
from launch.metrics.flops import expert_row_flops
from launch.metrics.records import (expert_load_summary, mfu_peak, model_flops_per_token, moe_layer_metrics,
                                    rank_metrics, step_record, straggler_metrics, throughput_metrics, traffic_metrics)
from launch.parallel.device import to_host
from launch.parallel.mesh import Mesh
from launch.parallel.stages import LOSS_KINDS, Stage
from launch.train.graphs import StepGraphs
from moe.documents import document_ids, document_labels
from optim import ZeroOptimizer
from pipeline import PipelineRuntime

TRAFFIC_KINDS = ("dispatch", "combine", "dispatch_backward", "combine_backward")



TRAFFIC_FIELDS = FIELDS  # ("intra_payload", "inter_payload", "intra_meta", "inter_meta"): TrafficMeter.tables' columns



def last_backward(optimizer: ZeroOptimizer | None, runtime: PipelineRuntime | None,
                  last: bool = True) -> contextlib.AbstractContextManager:
    """Around the step's last backward (the last micro-batch's, or the last pipeline step; ZeRO-2: around every
    one, `last` or not): ZeRO-1 starts reducing each bucket as soon as all its grads are final, while the backward
    goes on; with a pipeline the runtime says which grads are (runtime.last_grad: a deferred weight grad once its
    last W ran). The reductions still in flight are waited for in the clip (ZeroOptimizer.clip_grad_norm_)."""
    if optimizer is None or not (last or optimizer.stage >= 2):
        return contextlib.nullcontext()
    return optimizer.reduce_during_backward(runtime.last_grad if runtime is not None else None)



def document_eos(cfg: RunConfig) -> int | None:
    """The EOS id that ends documents when data.document_mask is on (data.tokenizer's), else None."""
    return load_tokenizer(cfg.data.tokenizer).eos_id if cfg.data.document_mask else None



def forward_backward(stages: list[Stage], runtime: PipelineRuntime | None, micro: list[MicroBatch],
                     chunks: int, loss_scale: float, optimizer: ZeroOptimizer | None = None,
                     eos: int | None = None, graphs: StepGraphs | None = None) -> tuple[Tensor, float]:
    """Forward and backward over this rank's micro-batches (grads accumulate), every LM, MTP and router loss
    scaled by loss_scale (the micro-batch's share of the step's loss); returns (sum of the scaled LM losses
    computed here (without MTP's), a float64 tensor on the stages' device; seconds the pipeline spent busy, or 0 without one).
    optimizer: the ZeRO-1 optimizer to overlap its gradient reduction with the last backward (last_backward).
    eos: document masking (moe.documents) at this EOS id: every stage of the rank gets each micro-batch's document
    ids, computed on the device from its tokens (which every pipeline rank of a DP rank reads), and the labels
    after an EOS are ignored. graphs (train.cuda_graphs): with pp = 1 each micro-batch's forward, loss and backward runs
    through its CUDA graph (launch.train.graphs.StepGraphs: captured after a warm-up, then replayed), with a pipeline
    each of the runtime's compute actions (pipeline.graphs, the runtime's graphs); the gradient reduction then does
    not overlap the backward (optimizer is not used)."""
    for stage in stages:
        stage.loss_scale = loss_scale
    device = next(stages[0].parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    last = next((stage for stage in stages if stage.lm_head is not None), None)

    def criterion(*outputs: Tensor) -> tuple[Tensor, Tensor]:
        """The last stage's loss (Stage.loss) and its LM part, detached, for total (the runtime keeps it per chunk)."""
        loss, lm_part = last.loss(*outputs)
        return loss, lm_part.detach()

    def labels_of(inputs: Tensor, labels: Tensor) -> Tensor:
        return labels if eos is None else document_labels(labels, inputs, eos)

    def documents_of(inputs: Tensor) -> list[Tensor]:
        return [] if eos is None else [document_ids(inputs, eos)]

    if runtime is None:
        for m, batch in enumerate(micro):
            def work(inputs: Tensor, labels: Tensor, m: int = m) -> Tensor:
                """The micro-batch's forward, loss and backward; its LM loss (what a graph captures)."""
                out = stages[0](inputs, *documents_of(inputs))
                loss, lm_part = criterion(*(out if isinstance(out, tuple) else (out,)), labels_of(inputs, labels))
                if torch.is_grad_enabled():
                    mark(f"backward of micro-batch {m}", ACTION)
                    with last_backward(optimizer if graphs is None else None, None, m == len(micro) - 1):
                        loss.backward()
                return lm_part

            mark(f"forward of micro-batch {m}", ACTION)
            total.add_(work(batch.inputs, batch.labels) if graphs is None
                       else graphs.micro_batch(work, batch.inputs, batch.labels, loss_scale))
        return total, 0.0
    busy = 0.0
    actions = runtime.graphs = graphs.pipeline if graphs is not None else None
    layout = runtime.schedule(chunks).layout
    entry, exit_ = layout.entry_chunks(runtime.rank), layout.exit_chunks(runtime.rank)
    for first in range(0, len(micro), chunks):
        step = micro[first:first + chunks]
        inputs = torch.cat([step[c].inputs for c in entry]) if entry else None
        labels = torch.cat([labels_of(step[c].inputs, step[c].labels) for c in exit_]) if exit_ else None
        context = [torch.cat(parts) for parts in zip(*(documents_of(batch.inputs) for batch in step))]
        runtime.timeline = []
        shapes = tuple((tuple(t.shape), t.dtype) for t in (inputs, labels, *context) if t is not None)
        with (actions.step((chunks, shapes), loss_scale) if actions is not None else contextlib.nullcontext(),
              last_backward(optimizer if actions is None else None, runtime, first + chunks >= len(micro))):
            runtime.step(*([inputs] if entry else []), num_chunks=chunks, criterion=criterion,
                         labels=(labels,) if exit_ else (), context=context)
        busy += sum(b for *_, b in runtime.timeline)
        runtime.timeline = None
        if runtime.kept:  # the LM losses of the step's chunks, in the order they were computed
            total.add_(torch.stack([lm_part for lm_part, in runtime.kept.values()]).sum())
    return total, busy



def gather_step_stats(stages: list[Stage], cfg: RunConfig, mesh: Mesh, lm_part: Tensor, grad_norm: Tensor,
                      idle: float, stop: bool, per_rank: bool) -> dict:
    """The step's one stats all-reduce and its one copy to the host: losses and per-layer routing statistics
    summed over every rank (each layer counted once per micro-batch, DualPipe's twin copies seeing disjoint
    chunks; router losses, the same on every TP and CP rank, divided by tp x cp; they route disjoint tokens), expert biases
    averaged over their holders, each MTP depth's loss, the EP-peer traffic matrix, and whether any rank was asked
    to stop (MTP blocks' MoE layers are rows after the model's: ModelConfig.num_routed_layers); none of
    it grows with the world. "loads_on_device" keeps the global loads on the device for the bias update.
    per_rank (every train.rank_metrics_every steps): also each rank's traffic, peak memory and idle share,
    gathered to rank 0 (launch.train.step.gather_rank_rows). "overflow": whether a padded exchange (parallel.dispatch_exchange)
    left rows out on any rank, its flags riding the same all-reduce and copy (the caller reruns the step exactly)."""
    device = lm_part.device
    by_kind, peers = traffic_table(stages, mesh, device)
    first_moe, layers, experts = cfg.model.first_k_dense, cfg.model.num_routed_layers, cfg.model.num_experts
    mtp = torch.zeros(cfg.model.mtp_depth, dtype=torch.float64, device=device)  # each MTP depth's loss
    loads = torch.zeros(layers, experts, dtype=torch.float64, device=device)
    biases = torch.zeros(layers, experts, dtype=torch.float64, device=device)
    extra = torch.zeros(layers, 3 + len(LOSS_KINDS), dtype=torch.float64, device=device)  # dropped, aux, holders, losses
    overflow = torch.zeros(1, dtype=torch.float64, device=device)  # padded exchanges that left rows out
    ep, position = mesh.layout.ep, dist.get_rank(mesh.ep)
    received = torch.zeros(2, layers, ep, dtype=torch.float64, device=device)  # rows, peak ratio by EP position
    mine = torch.zeros(layers, dtype=torch.float64, device=device)  # this rank's rows, for the per-rank table
    for stage in stages:
        for i, layer in stage.moe_layers().items():
            if hasattr(layer.dispatcher, "take_overflow"):
                overflow += layer.dispatcher.take_overflow(device)
            tally, row = stage.tallies[i], i - first_moe
            received[0, row, position] += tally.rows
            received[1, row, position] += tally.peak
            mine[row] += tally.rows
            loads[row] += tally.tokens_per_expert
            biases[row] += layer.router.expert_bias.detach()
            extra[row, 0] += tally.dropped
            extra[row, 1] += tally.aux_loss
            extra[row, 2] += 1
            extra[row, 3:] += tally.losses
        if stage.mtp_tally is not None:
            mtp += stage.mtp_tally
        stage.reset_tallies()  # and the EP traffic counters, read above
    parts = [lm_part.view(1), loads, biases, extra, mtp, overflow, received, peers,
             torch.full((1,), float(stop), dtype=torch.float64, device=device)]  # a fill: no upload
    flat = torch.cat([p.flatten() for p in parts])
    dist.all_reduce(flat)
    host = to_host(torch.cat([flat, grad_norm.detach().view(1).double()]))  # the step's one device-to-host copy
    _, loads_h, biases_h, extra_h, mtp_h, overflow_h, received_h, peers_h, stop_h, norm = (
        chunk.view_as(p) for chunk, p in zip(host.split([p.numel() for p in parts] + [1]), parts + [grad_norm.view(1)]))
    tp = cfg.parallel.tp
    shards = tp * cfg.parallel.cp  # the router losses are the same on every TP and CP rank of a sequence
    extra_h[:, 1], extra_h[:, 3:] = extra_h[:, 1] / shards, extra_h[:, 3:] / shards
    ranks = gather_rank_rows(by_kind.flatten(), rank_row(device, idle), mine) if per_rank else {}
    lm, aux, mtp_losses = float(host[0]) / tp, float(extra_h[:, 1].sum()), (mtp_h / tp).tolist()
    mtp_term = cfg.model.mtp_loss_coeff / cfg.model.mtp_depth * sum(mtp_losses) if mtp_losses else 0.0
    return {"loss": lm + aux + mtp_term, "lm_loss": lm, "mtp_losses": mtp_losses, "loads": [row.long() for row in loads_h], "dropped": extra_h[:, 0],
            "aux_loss": aux, "biases": biases_h / extra_h[:, 2:3].clamp(min=1),
            "losses": [dict(zip(LOSS_KINDS, row.tolist())) for row in extra_h[:, 3:]], "grad_norm": float(norm[0]),
            "stop": bool(stop_h[0] > 0), "overflow": bool(overflow_h[0] > 0),
            "loads_on_device": flat[1:1 + loads.numel()].view_as(loads),
            "received": position_rows(received_h, extra_h[:, 2], mesh.layout.stage_ranks // ep),
            **traffic_metrics(peers_h.long().tolist(), mesh.layout.ep_gpus_per_node() if ep > 1 else 0),
            **ranks}



@contextlib.contextmanager
def exact_exchanges(stages: list[Stage], grow: bool = True) -> Iterator[None]:
    """Inside: every padded EP dispatcher of stages runs the exact path (the rerun of a step whose padded exchange
    overflowed, or the held-out evaluation, which has no rerun); after: padded again, with grow the bounds doubled
    for the steps after it (EPDispatcher.grow)."""
    padded = [(layer.dispatcher, layer.dispatcher.exchange) for stage in stages
              for layer in stage.moe_layers().values() if getattr(layer.dispatcher, "exchange", "exact") != "exact"]
    for dispatcher, _ in padded:
        dispatcher.exchange = "exact"
    try:
        yield
    finally:
        for dispatcher, exchange in padded:
            dispatcher.exchange = exchange
            if grow:
                dispatcher.grow()


def position_rows(received: Tensor, holders: Tensor, copies: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows [layers, ep], peak [layers]) from the stats all-reduce's received table [2, layers, ep] (rows and
    peak ratio added at each rank's EP position) and each layer's holders (ranks holding it): rows each EP
    position's experts received over the step, averaged over the copies of the EP group (expert data parallel,
    TP/CP ranks: copies per position; DualPipe's twins see disjoint micro-batches and add up), and the busiest
    position's largest ratio of one exchange's rows to the balanced share (max over positions of each position's
    running max over the step's exchanges, those two maxima commute), averaged over every holder of the position."""
    ep = received.shape[-1]
    per_position = (holders / ep).clamp(min=1).view(-1, 1).numpy()
    rows = received[0].numpy() / copies
    peak = (received[1].numpy() / per_position).max(axis=1)
    return rows, peak



class ReplicaWindow:
    """The loads [moe layers, E] summed over the steps since the last placement of the redundant experts
    (parallel.redundant_experts; host numbers every rank holds alike, from the step's stats copy); at the end of
    every parallel.rebalance_every steps each layer places its spare slots from them (MoELayer.replace_replicas).
    Checkpoints keep the window (state_dict: window/loads, [routed layers, E] float64, the same on every rank), so a
    run resumed inside a window places at its end as the uninterrupted run does; a checkpoint without it (saved
    before the window was kept) resumes with an empty window."""

    def __init__(self, stages: list[Stage], cfg: RunConfig) -> None:
        self.every, self.first = cfg.parallel.rebalance_every, cfg.model.first_k_dense
        self.layers = {i: layer for stage in stages for i, layer in stage.moe_layers().items()
                       if layer.replicas is not None}
        self.shape = (cfg.model.num_routed_layers, cfg.model.num_experts)
        self.loads: np.ndarray | None = None

    def state_dict(self) -> dict[str, Tensor]:
        """The window's loads so far (zeros after a placement); nothing without redundant experts."""
        if not self.layers:
            return {}
        return {"loads": torch.from_numpy(self.loads.copy() if self.loads is not None else np.zeros(self.shape))}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Continue the window a checkpoint saved (state_dict's keys)."""
        if "loads" in state:
            self.loads = state["loads"].numpy().astype(np.float64)

    def add(self, step: int, loads: list[Tensor]) -> None:
        """Count step's loads; after every rebalance_every-th step, place and start a new window."""
        if not self.layers:
            return
        counts = torch.stack(loads).numpy().astype(np.float64)
        self.loads = counts if self.loads is None else self.loads + counts
        if (step + 1) % self.every == 0:
            for i, layer in sorted(self.layers.items()):
                layer.replace_replicas(self.loads[i - self.first])
            self.loads = None



def update_expert_bias(stages: list[Stage], cfg: RunConfig, loads: Tensor) -> None:
    """Aux-loss-free balancing of this rank's MoE layers from their global loads [moe layers, E] (on device)."""
    if cfg.model.bias_update_rate:
        for stage in stages:
            for i, layer in stage.moe_layers().items():
                layer.router.update_bias(loads[i - cfg.model.first_k_dense])



def rank_row(device: torch.device, idle: float) -> np.ndarray:
    """This rank's peak memory (bytes allocated on a GPU, the process's peak RSS on a CPU) and pipeline idle share."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return np.array([peak, idle], dtype=np.float64)



def traffic_table(stages: list[Stage], mesh: Mesh, device: torch.device) -> tuple[Tensor, Tensor]:
    """This rank's EP traffic counters of the step (Stage.reset_tallies restarts them), on device, nothing read (a
    device-split exchange counts its rows on the device: dispatch.traffic.TrafficMeter.tables): float64
    [call kind, (intra payload, inter payload, intra meta, inter meta)], and its row of the EP-peer byte matrix
    by position in the EP group ([ep, ep], summed over ranks in the stats all-reduce)."""
    ep = mesh.layout.ep
    by_kind = torch.zeros(len(TRAFFIC_KINDS), len(TRAFFIC_FIELDS), dtype=torch.float64, device=device)
    peers = torch.zeros(ep, ep, dtype=torch.float64, device=device)
    me = dist.get_rank(mesh.ep)
    for stage in stages:
        for layer in stage.moe_layers().values():
            meter = getattr(layer.dispatcher, "meter", None)
            if meter is None:
                continue
            kinds, sent = meter.tables(TRAFFIC_KINDS, ep, device)
            by_kind += kinds
            peers[me] += sent
    return by_kind, peers



def gather_rank_rows(traffic: Tensor, row: np.ndarray, expert_rows: Tensor) -> dict:
    """Every rank's row (traffic by kind, float64 on the device; peak memory and idle share, row; and the rows its
    experts received per MoE layer, expert_rows [layers] on the device) gathered to rank 0 (O(layers) bytes per other
    rank): there, the "traffic_bytes" and "ranks" metrics sections; elsewhere nothing."""
    mine = torch.cat([traffic, upload(row.tolist(), torch.float64, traffic.device), expert_rows])
    lead = dist.get_rank() == 0
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())] if lead else None
    dist.gather(mine, rows, dst=0)
    if not lead:
        return {}
    table = to_host(torch.stack(rows))  # rank 0's copy of the gathered rows, on the rank-metrics steps only
    table, received = table[:, :len(traffic) + len(row)], table[:, len(traffic) + len(row):]
    by_kind = table[:, :-2].view(len(table), len(TRAFFIC_KINDS), len(TRAFFIC_FIELDS))
    return {"traffic_bytes": {kind: by_kind[:, k].long().tolist() for k, kind in enumerate(TRAFFIC_KINDS)},
            **rank_metrics(table[:, -2].long().tolist(), table[:, -1].tolist(), received.numpy())}



def step_metrics(step: int, cfg: RunConfig, stats: dict, scalars: dict, tokens: int, seconds: float,
                 device: torch.device) -> dict:
    """The step's metrics record (launch/metrics/dashboard/SCHEMA.md): scalars, throughput and MFU (against the peaks of
    the precisions the GEMMs run in on this rank's GPU: launch.metrics.records.mfu_peak), the "moe" and "stragglers" sections."""
    peak = mfu_peak(cfg.model, cfg.train.seq_len, device, cfg.train.peak_tflops_per_gpu)
    mtp = {f"mtp_loss_{k}": loss for k, loss in enumerate(stats["mtp_losses"], start=1)}
    flops_per_token = model_flops_per_token(cfg.model, cfg.train.seq_len)
    return step_record(step, {"loss": stats["loss"], "lm_loss": stats["lm_loss"], **mtp,
                              "aux_loss": stats["aux_loss"], "dropped_tokens": int(stats["dropped"].sum())},
                       scalars, throughput_metrics(tokens, seconds, flops_per_token,
                                                   peak * cfg.parallel.world_size if peak else None),
                       expert_load_summary(stats["loads"]),
                       moe_layer_metrics(stats["loads"], stats["biases"].numpy(), stats["dropped"].long().tolist(),
                                         stats["losses"]),
                       straggler_metrics(*stats["received"], expert_row_flops(cfg.model),
                                         tokens * flops_per_token / cfg.parallel.world_size))



@torch.no_grad()
def evaluate(stages: list[Stage], runtime: PipelineRuntime | None, batches: DataFeed, cfg: RunConfig,
             eos: int | None = None) -> float:
    """Mean LM loss over the first held-out micro-batches (train.eval_batches, rounded up to fill
    every DP rank's pipeline steps), the same ones every time; eos: document masking (forward_backward). Padded EP
    exchanges run exact here (an evaluation step may read to the host)."""
    unit = cfg.parallel.dp * (cfg.chunks_per_step if runtime is not None else 1)
    count = -(-cfg.train.eval_batches // unit) * unit
    held_out = batches.held_out(count)  # this DP rank's share; raises when the held-out rows are too few
    for stage in stages:
        stage.eval()
    with exact_exchanges(stages, grow=False):  # its loss is read at once: no overflow to rerun after
        total, _ = forward_backward(stages, runtime, held_out, cfg.chunks_per_step, 1 / count, eos=eos)
    for stage in stages:
        stage.train()
        stage.reset_tallies()
    dist.all_reduce(total)
    return float(to_host(total)) / cfg.parallel.tp  # every TP rank computed the same loss

