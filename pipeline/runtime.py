"""DualPipe and DualPipeV runtimes: execute a schedule's actions with real stage modules and p2p."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from dispatch.progress import ACTION, mark
from pipeline import schedules
from pipeline.graphs import ActionGraphs
from pipeline.overlap import complete, start
from pipeline.p2p import P2PChannel, TensorMeta, TransferLog
from pipeline.schedules import Action, Op, Schedule
from pipeline.wgrad import WeightGradStore, install_split_linear

_STREAM = {Op.SEND_F: 0, Op.RECV_F: 0, Op.SEND_B: 2, Op.RECV_B: 2}  # + phase: 4 message streams


def _as_tuple(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)


class PipelineRuntime(nn.Module):
    """Shared machinery: holds the rank's two stage modules and runs schedule actions on them.

    split_bw: weight grads in W actions (False: inside each B); overlap: F&B pairs overlap a
    chunk's EP communication with the other chunk's compute (see pipeline.overlap): in both
    directions when both modules of a pair declare `concurrent_backward` (the backward then runs
    on a helper thread beside the forward), else only the forward's (modules with forward_steps);
    False runs each pair's forward, then its backward. merge_w: chunks whose weight grads one W action computes together (1: a W per chunk as in
    DeepSeek's schedules; see schedules.merge_weight_grads).
    """

    schedule_name = ""
    modules_per_rank = 2

    def __init__(self, modules: Sequence[nn.Module], process_group: dist.ProcessGroup | None = None, *,
                 batch_dim: int = 0, split_bw: bool = True, overlap: bool = True, merge_w: int = 1) -> None:
        super().__init__()
        if len(modules) != self.modules_per_rank or not all(isinstance(m, nn.Module) for m in modules):
            shape = "a pair (m0, m1)" if self.modules_per_rank == 2 else "a 1-tuple (m,)"
            raise ValueError(f"modules must be {shape} of nn.Module, got {len(modules)} item(s)")
        if not isinstance(merge_w, int) or merge_w < 1 or (merge_w > 1 and not split_bw):
            raise ValueError(f"merge_w = {merge_w!r}: chunks per W action must be an integer >= 1 "
                             f"(and 1 when split_bw is False)")
        self.module = nn.ModuleList(modules)
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.num_ranks = dist.get_world_size(self.group)
        self._check_ranks()
        self.batch_dim = batch_dim
        self.split_bw = split_bw
        self.overlap = overlap
        self.merge_w = merge_w
        self.store = WeightGradStore()
        self._phases_of: dict[Tensor, list[int]] = {}  # param -> phases (modules) holding it, set per step
        self._closed: set[int] = set()  # phases whose last backward of the step has begun
        if split_bw:
            install_split_linear(list(modules))
        # [] to record (act, start, end, busy) per action, and the messages' times (transfers)
        self.timeline: list[tuple[Action, float, float, float]] | None = None
        # recorded with the timeline: per F&B pair whose forward ran (and sent its outputs) before
        # its backward, the share of the pair's busy time its forward took
        self.forward_shares: dict[Action, float] = {}
        self.current_action: Action | None = None
        self._schedules: dict[tuple[int, bool, bool], Schedule] = {}
        self._channel = P2PChannel(self.group, self._device())  # made here: it creates process groups
        self._backward_thread: ThreadPoolExecutor | None = None  # runs the backward of concurrent pairs
        # train.cuda_graphs: the compute actions run through these graphs (pipeline.graphs; None: eagerly)
        self.graphs: ActionGraphs | None = None
        self.kept: dict[int, tuple[Tensor, ...]] = {}  # per exit chunk, what the criterion kept beside the loss

    def fix_boundary(self, metas: list[TensorMeta]) -> None:
        """Every message between stages carries tensors of these dtypes and shapes (requires_grad taken as
        True): p2p sends no headers and receives never wait on the host (pipeline.p2p)."""
        self._channel.fixed = metas

    @property
    def transfers(self) -> TransferLog | None:
        """Times of the last step's messages, recorded along with the timeline."""
        return self._channel.log

    def _check_ranks(self) -> None:
        """Raise ValueError if the rank count does not suit the schedule."""

    def schedule(self, num_chunks: int, forward_only: bool = False) -> Schedule:
        """This runtime's schedule (with communication) for num_chunks chunks."""
        key = (num_chunks, forward_only, self.split_bw)
        if key not in self._schedules:
            sched = schedules.build(self.schedule_name, self.num_ranks, num_chunks, split_bw=self.split_bw)
            if self.merge_w > 1:
                sched = schedules.merge_weight_grads(sched, self.merge_w)
            if forward_only:
                sched = schedules.forward_only(sched)
            self._schedules[key] = schedules.with_communication(sched)
        return self._schedules[key]

    def step(self, *inputs: Tensor, num_chunks: int, criterion: Callable[..., Tensor] | None = None,
             labels: Sequence[Tensor] = (), return_outputs: bool = False,
             context: Sequence[Tensor] = ()) -> tuple[Tensor | None, Any]:
        """Run one pipelined step over num_chunks micro-batches; accumulate grads into the modules.

        Ranks holding first stages pass the inputs, ranks holding last stages the labels (criterion
        gets (*outputs, *labels) per chunk and returns the loss, or (loss, *kept): detached tensors left in
        self.kept[chunk], in the order the chunks' losses were computed; without criterion the last stage's output is
        the loss). With self.graphs active (train.cuda_graphs) the compute actions are captured and replayed
        (pipeline.graphs); return_outputs is then refused.
        context: tensors of all num_chunks chunks (split like inputs) that every stage of this rank receives
        after its inputs for each chunk; never sent between ranks nor differentiated (e.g. document ids).
        Returns (per-chunk losses stacked, outputs concatenated along batch_dim) on the ranks holding
        last stages, (None, None) elsewhere. Under torch.no_grad() only forwards run.
        """
        forward_only = not torch.is_grad_enabled()
        sched = self.schedule(num_chunks, forward_only)  # validates num_chunks
        layout = sched.layout
        entry, exit_ = layout.entry_chunks(self.rank), layout.exit_chunks(self.rank)
        self._inputs = self._split("inputs", inputs, entry, num_chunks) if entry else {}
        self._labels = self._split("labels", tuple(labels), exit_, num_chunks) if exit_ and labels else {}
        self._context = self._split("context", tuple(context), list(range(num_chunks)), num_chunks) if context else {}
        self._criterion = criterion
        self._layout = layout
        self._channel.device = self._device()
        self._channel.log = TransferLog() if self.timeline is not None else None
        self._local: dict[tuple[Op, int, int], list[tuple[Tensor, bool]]] = {}  # hand-overs on this rank
        self._posted: dict[tuple[Op, int, int], Any] = {}  # receives in flight
        self._outbox: dict[tuple[Op, int, int], list[Tensor]] = {}  # waiting for their SEND action
        self._saved: dict[tuple[int, int], tuple[list[Tensor], tuple]] = {}  # (inputs, outputs or their edges) for B
        self._results: dict[int, tuple[Tensor, ...]] = {}  # last-stage outputs, kept only for return_outputs
        self._keep_outputs = return_outputs
        self._losses: dict[int, Tensor] = {}
        self.kept = {}
        if return_outputs and self.graphs is not None and self.graphs.active:
            raise ValueError("return_outputs: a graphed pipeline step keeps no outputs (train.cuda_graphs)")
        self._sent_early: set[tuple[Op, int, int]] = set()
        self.forward_shares = {}
        self._phases_of = {}
        for phase, module in enumerate(self.module):
            for param in module.parameters():
                self._phases_of.setdefault(param, []).append(phase)
        self._closed = set()
        last_backward = {(act.backward or act).phase: i for i, act in enumerate(sched.actions[self.rank])
                         if act.op in (Op.B, Op.FB)}
        for i, act in enumerate(sched.actions[self.rank]):
            self._closed.update(phase for phase, last in last_backward.items() if last == i)
            self._run(act)
        self._channel.wait_sends()
        if self.store.pending():
            raise RuntimeError(f"{self.store.pending()} weight-grad closures were never run")
        if not exit_:
            return None, None
        loss = torch.stack([self._losses[c] for c in exit_])
        outputs = None
        if return_outputs:
            parts = list(zip(*(self._results[c] for c in exit_)))
            outputs = tuple(torch.cat(p, self.batch_dim) for p in parts)
            outputs = outputs[0] if len(outputs) == 1 else outputs
        return loss, outputs

    def last_grad(self, param: Tensor) -> bool:
        """Asked from param's post-accumulate-grad hook during step(): whether the grad just accumulated is the
        last this step adds to param. It is once the last backward (B) of every stage holding param has begun
        and no weight-grad work queued for a W action will still add to it (WeightGradStore.outstanding):
        a B accumulates each param once, and a W runs a param's queued work once per chunk, or once per
        merged W. Params of no stage here: never (their caller reduces them after the step)."""
        phases = self._phases_of.get(param)
        return bool(phases) and self._closed.issuperset(phases) and self.store.outstanding(param) == 0

    def _device(self) -> torch.device:
        param = next(self.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def _split(self, what: str, tensors: tuple, chunks: list[int], num_chunks: int) -> dict[int, tuple]:
        if not tensors:
            raise ValueError(f"rank {self.rank} holds a first/last stage and needs {what}")
        for i, t in enumerate(tensors):
            if t.shape[self.batch_dim] % len(chunks):
                raise ValueError(f"{what}[{i}] has batch size {t.shape[self.batch_dim]}, not divisible into the "
                                 f"{len(chunks)} chunks this rank holds (num_chunks={num_chunks})")
        parts = [t.chunk(len(chunks), self.batch_dim) for t in tensors]
        return {c: tuple(p[i] for p in parts) for i, c in enumerate(chunks)}

    # -- actions -------------------------------------------------------------------------------

    def _run(self, act: Action) -> None:
        mark(f"{act.op.value} of stage {self._stage(act.phase)} chunk {act.chunk}", ACTION)
        self.current_action = act
        self._waited = 0.0
        self._forward_busy: float | None = None
        t0 = time.perf_counter()
        if self.graphs is not None and self.graphs.active and act.op in (Op.F, Op.B, Op.W, Op.FB):
            self._graphed(act)
        elif act.op is Op.F:
            inputs, out = self._start_forward(act.phase, act.chunk)
            self._finish_forward(act.phase, act.chunk, inputs, complete(out))
        elif act.op is Op.B:
            self._backward(act.phase, act.chunk, act.split)
        elif act.op is Op.W:
            self.store.run(*((act.phase, c) for c in act.chunks))
        elif act.op is Op.FB:
            self._forward_backward(act)
        elif act.op in (Op.RECV_F, Op.RECV_B):
            self._posted[(act.op, act.phase, act.chunk)] = self._channel.post_recv(act.peer, self._stream(act))
        elif (act.op, act.phase, act.chunk) in self._sent_early:
            self._sent_early.remove((act.op, act.phase, act.chunk))
        else:
            self._channel.send(self._outbox.pop((act.op, act.phase, act.chunk)), act.peer, self._stream(act))
        if self.timeline is not None:
            end = time.perf_counter()
            self.timeline.append((act, t0, end, end - t0 - self._waited))
            if self._forward_busy is not None:
                self.forward_shares[act] = self._forward_busy / max(end - t0 - self._waited, 1e-12)
        self.current_action = None

    @staticmethod
    def _stream(act: Action) -> int:
        return _STREAM[act.op] + act.phase

    def _stage(self, phase: int) -> int:
        return self._layout.stage_of(self.rank, phase)

    def _hand_over(self, op: Op, phase: int, chunk: int, neighbour: int, tensors: list[tuple[Tensor, bool]]) -> None:
        """Pass tensors to the stage at position neighbour: directly if it is here, else via SEND."""
        rank, nb_phase = self._layout.locate(chunk, neighbour)
        if rank == self.rank:
            self._local[(Op.RECV_F if op is Op.SEND_F else Op.RECV_B, nb_phase, chunk)] = tensors
        else:
            self._outbox[(op, phase, chunk)] = [t for t, _ in tensors]

    def _fetch(self, op: Op, phase: int, chunk: int) -> list[tuple[Tensor, bool]]:
        """Tensors for (phase, chunk) from a hand-over on this rank or a posted receive (its wait
        is counted apart from compute)."""
        key = (op, phase, chunk)
        if key not in self._posted:
            return self._local.pop(key)
        blocked = self._channel.blocked_s
        peer = self._layout.locate(chunk, self._stage(phase) + (-1 if op is Op.RECV_F else 1))[0]
        tensors = self._channel.finish_recv(self._posted.pop(key), peer, _STREAM[op] + phase)
        self._waited += self._channel.blocked_s - blocked
        return tensors

    def _send_early(self, phase: int, chunk: int) -> None:
        """Send a forward's outputs now rather than at its SEND action after the whole F&B pair
        (per stream the order of messages is unchanged)."""
        key = (Op.SEND_F, phase, chunk)
        if key in self._outbox:
            peer = self._layout.locate(chunk, self._stage(phase) + 1)[0]
            self._channel.send(self._outbox.pop(key), peer, _STREAM[Op.SEND_F] + phase)
            self._sent_early.add(key)

    def _forward_inputs(self, phase: int, chunk: int) -> list[Tensor]:
        """The chunk's inputs of the stage of phase (fed or received), then the chunk's context."""
        context = list(self._context.get(chunk, ()))
        if self._stage(phase) == 0:
            return list(self._inputs[chunk]) + context
        grad = torch.is_grad_enabled()
        return [t.detach().requires_grad_(flag and grad) for t, flag in self._fetch(Op.RECV_F, phase, chunk)] + context

    def _start_forward(self, phase: int, chunk: int) -> tuple[list[Tensor], Any]:
        inputs = self._forward_inputs(phase, chunk)
        return inputs, self._call(phase, inputs)

    def _call(self, phase: int, inputs: list[Tensor]) -> Any:
        """The stage module of phase on inputs: a forward_steps generator under EP overlap, else its output."""
        module = self.module[phase]
        if self.overlap and hasattr(module, "forward_steps"):
            return module.forward_steps(*inputs)
        return module(*inputs)

    def _is_last(self, phase: int) -> bool:
        return self._stage(phase) == self._layout.num_stages - 1

    def _finish_forward(self, phase: int, chunk: int, inputs: list[Tensor], out: Any) -> None:
        self._hand_forward(phase, chunk, self._forward_tail(phase, chunk, inputs, out, self._labels.get(chunk, ())))

    def _forward_tail(self, phase: int, chunk: int, inputs: list[Tensor], out: Any, labels: Sequence[Tensor]
                      ) -> tuple[Tensor, ...]:
        """The compute after a stage's forward and what it hands on: on the last stage its loss (criterion, with
        labels), detached, and what the criterion kept; elsewhere the outputs for the next stage. What the
        backward needs is saved."""
        outputs = tuple(t for t in _as_tuple(out) if isinstance(t, Tensor))
        last = self._is_last(phase)
        handed = outputs
        if last:
            if self._keep_outputs:  # else each chunk's logits would live until the step ends
                self._results[chunk] = tuple(t.detach() for t in outputs)
            result = outputs[0] if self._criterion is None else self._criterion(*outputs, *labels)
            loss, *kept = result if isinstance(result, tuple) else (result,)
            outputs, handed = (loss,), (loss.detach(), *kept)
        if torch.is_grad_enabled():  # a handed-over output is kept as its autograd edge only: its bytes are the
            # next stage's (a payload copy, or its input here) and backward needs the edge, not the values
            kept_for_backward = outputs if last else tuple(get_gradient_edge(t) for t in outputs if t.requires_grad)
            self._saved[(phase, chunk)] = (inputs, kept_for_backward)
        return handed

    def _hand_forward(self, phase: int, chunk: int, handed: tuple[Tensor, ...]) -> None:
        """_forward_tail's result to its place: the last stage's loss and kept tensors, else the next stage."""
        if self._is_last(phase):
            self._losses[chunk] = handed[0]
            if len(handed) > 1:
                self.kept[chunk] = handed[1:]
        else:
            self._hand_over(Op.SEND_F, phase, chunk, self._stage(phase) + 1, [(t, t.requires_grad) for t in handed])

    def _backward(self, phase: int, chunk: int, split: bool) -> None:
        self._run_backward(phase, chunk, split, self._output_grads(phase, chunk))

    def _output_grads(self, phase: int, chunk: int) -> list[Tensor] | None:
        """Grads of the stage's outputs for its backward (None on the last stage: its output is the loss)."""
        if self._stage(phase) == self._layout.num_stages - 1:
            return None
        return [g for g, _ in self._fetch(Op.RECV_B, phase, chunk)]

    def _run_backward(self, phase: int, chunk: int, split: bool, grads: list[Tensor] | None) -> None:
        self._hand_backward(phase, chunk, self._backward_compute(phase, chunk, split, grads))

    def _backward_compute(self, phase: int, chunk: int, split: bool, grads: list[Tensor] | None) -> list[Tensor]:
        """The backward of (phase, chunk) from its outputs' grads (weight grads deferred to the store when split);
        the grads of its inputs that require one (none on stage 0)."""
        inputs, outputs = self._saved.pop((phase, chunk))
        with self.store.capture((phase, chunk)) if split else nullcontext():
            torch.autograd.backward(list(outputs), grads)
        if self._stage(phase) == 0:
            return []
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs if t.requires_grad]

    def _hand_backward(self, phase: int, chunk: int, in_grads: list[Tensor]) -> None:
        stage = self._stage(phase)
        if stage > 0:
            self._hand_over(Op.SEND_B, phase, chunk, stage - 1, [(g, True) for g in in_grads])

    def _graphed(self, act: Action) -> None:
        """A compute action (F, B, W, F&B) through its graph (self.graphs, pipeline.graphs): the receives it needs
        are waited for and the hand-overs it makes are done eagerly, before and after the graph; an F&B pair's
        forward and backward interleave inside one graph as eager (its forward's outputs are sent after the pair)."""
        if act.op is Op.W:
            keys = tuple((act.phase, c) for c in act.chunks)
            self.graphs.run((Op.W, *keys), lambda: self.store.run(*keys), [])
            return
        fwd = None if act.op is Op.B else act
        bwd = act if act.op is Op.B else act.backward
        inputs = self._forward_inputs(fwd.phase, fwd.chunk) if fwd else []
        labels = list(self._labels.get(fwd.chunk, ())) if fwd and self._is_last(fwd.phase) else []
        grads = self._output_grads(bwd.phase, bwd.chunk) if bwd else None
        n, m = len(inputs), len(labels)

        def work(*static: Tensor) -> tuple[tuple[Tensor, ...], list[Tensor]]:
            ins, labs, out_grads = list(static[:n]), static[n:n + m], (list(static[n + m:]) if grads is not None
                                                                        else None)
            if fwd is None:
                return (), self._backward_compute(bwd.phase, bwd.chunk, bwd.split, out_grads)
            done, out = start(self._call(fwd.phase, ins))
            handed = self._forward_tail(fwd.phase, fwd.chunk, ins, out, labs) if done else ()
            in_grads = self._backward_compute(bwd.phase, bwd.chunk, bwd.split, out_grads) if bwd else []
            if not done:  # EP overlap: the backward ran while the forward's communication was in flight
                handed = self._forward_tail(fwd.phase, fwd.chunk, ins, complete(out), labs)
            return handed, in_grads

        handed, in_grads = self.graphs.run((act.op, act.phase, act.chunk), work, [*inputs, *labels, *(grads or [])])
        if fwd:
            self._hand_forward(fwd.phase, fwd.chunk, handed)
            if bwd:
                self._send_early(fwd.phase, fwd.chunk)
        if bwd:
            self._hand_backward(bwd.phase, bwd.chunk, in_grads)

    def _forward_backward(self, act: Action) -> None:
        bwd = act.backward
        if (self.overlap and all(getattr(self.module[p], "concurrent_backward", False) for p in (act.phase, bwd.phase))
                and not self._channel.fake):  # a rehearsal (fake group): one thread, which its dispatch modes see
            self._forward_beside_backward(act)
            return
        t0 = time.perf_counter()
        inputs, started = self._start_forward(act.phase, act.chunk)
        done, out = start(started)
        if done:
            self._finish_forward(act.phase, act.chunk, inputs, out)
            self._send_early(act.phase, act.chunk)
            self._forward_busy = time.perf_counter() - t0 - self._waited
            self._backward(bwd.phase, bwd.chunk, bwd.split)
        else:  # EP overlap: the backward runs while the forward's communication is in flight
            self._backward(bwd.phase, bwd.chunk, bwd.split)
            self._finish_forward(act.phase, act.chunk, inputs, complete(out))

    def _forward_beside_backward(self, act: Action) -> None:
        """An F&B pair overlapped in both directions: the backward runs on a helper thread while this
        thread runs the forward, so each one's EP exchanges are in flight while the other computes.

        Both receives are waited for first, on this thread (as DeepSeek's DualPipe does), so the
        helper thread never touches the p2p channel, the transfer log or the wait accounting; it
        only pops its own saved tensors and leaves its input grads for their SEND action. The
        modules' collectives must use disjoint process groups per direction (their
        concurrent_backward says so): each group then sees one thread, in the same order on every
        rank. The helper's weight-grad capture is process-wide, which is safe because a forward
        never defers a weight grad. Grad mode is per thread; a backward needs none.
        """
        bwd = act.backward
        inputs = self._forward_inputs(act.phase, act.chunk)
        grads = self._output_grads(bwd.phase, bwd.chunk)
        if self._backward_thread is None:
            self._backward_thread = ThreadPoolExecutor(1, thread_name_prefix="pipeline-backward")
        backward = self._backward_thread.submit(self._run_backward, bwd.phase, bwd.chunk, bwd.split, grads)
        try:
            module = self.module[act.phase]
            out = module.forward_steps(*inputs) if hasattr(module, "forward_steps") else module(*inputs)
            self._finish_forward(act.phase, act.chunk, inputs, complete(out))
            self._send_early(act.phase, act.chunk)
        finally:
            backward.result()


class DualPipe(PipelineRuntime):
    """DualPipe: an even number PP of ranks; rank r holds stages r and PP-1-r as (m0, m1).

    Rank 0 feeds the first half of the batch and rank PP-1 the second; rank 0 computes the loss of
    the second half (its labels) and rank PP-1 that of the first.
    """

    schedule_name = "dualpipe"

    def _check_ranks(self) -> None:
        if self.num_ranks % 2:
            raise ValueError(f"DualPipe needs an even number of ranks in process_group, got {self.num_ranks}")


class DualPipeV(PipelineRuntime):
    """DualPipeV: N ranks hold 2N stages in a V; rank r holds stages r and 2N-1-r as (m0, m1).

    Rank 0 feeds the inputs and computes the loss (it holds both the first and the last stage).
    """

    schedule_name = "dualpipev"


class OneFOneB(PipelineRuntime):
    """1F1B: one stage per rank, modules=(m,); rank 0 feeds the inputs, the last rank computes the loss."""

    schedule_name = "1f1b"
    modules_per_rank = 1


class AFAB(OneFOneB):
    """All forward, all backward (GPipe): one stage per rank; every chunk's activations held until the backwards."""

    schedule_name = "afab"


class ZB1P(OneFOneB):
    """Zero-bubble ZB-H1: 1F1B whose backwards are split and whose weight passes fill the bubbles."""

    schedule_name = "zb1p"
