"""Point-to-point transfer of a list of tensors whose shapes and dtypes are negotiated per message.

A message is a fixed-size int64 header (count, then per tensor: dtype code, requires_grad, ndim,
dims) followed by one uint8 payload holding every tensor's bytes, so any number of tensors of
any shape and dtype crosses in two sends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

HEADER_LEN = 64
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)


def _header(tensors: list[Tensor]) -> Tensor:
    fields = [len(tensors)]
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"pipeline boundary tensors of dtype {t.dtype} are not supported")
        fields += [_DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
    if len(fields) > HEADER_LEN:
        raise ValueError(f"{len(tensors)} boundary tensors with these ranks do not fit a {HEADER_LEN}-entry header")
    return torch.tensor(fields + [0] * (HEADER_LEN - len(fields)), dtype=torch.int64)


@dataclass
class TensorMeta:
    """Shape, dtype and grad flag of one tensor of a message."""

    dtype: torch.dtype
    requires_grad: bool
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Payload bytes of this tensor."""
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


def _parse(header: Tensor) -> list[TensorMeta]:
    fields = header.tolist()
    metas, i = [], 1
    for _ in range(fields[0]):
        code, grad, ndim = fields[i:i + 3]
        metas.append(TensorMeta(_DTYPES[code], bool(grad), tuple(fields[i + 3:i + 3 + ndim])))
        i += 3 + ndim
    return metas


def _payload(tensors: list[Tensor]) -> Tensor:
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)


class Channel:
    """Sends and receives tensor lists to/from group ranks; one tag pair per stream keeps them apart."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.device = device
        self._sends: list[tuple[dist.Work, Tensor]] = []

    def send(self, tensors: list[Tensor], peer: int, stream: int) -> None:
        """Start sending tensors to group rank peer (non-blocking; finished by wait_sends)."""
        for buf, tag in ((_header(tensors).to(self.device), 2 * stream), (_payload(tensors), 2 * stream + 1)):
            self._sends.append((dist.isend(buf, group=self.group, group_dst=peer, tag=tag), buf))

    def post_recv(self, peer: int, stream: int) -> tuple[dist.Work, Tensor]:
        """Post the receive of the next message's header from peer on stream."""
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        return dist.irecv(header, group=self.group, group_src=peer, tag=2 * stream), header

    def finish_recv(self, posted: tuple[dist.Work, Tensor], peer: int, stream: int) -> list[tuple[Tensor, bool]]:
        """Wait for a posted message; return its tensors with their requires_grad flags."""
        work, header = posted
        work.wait()
        metas = _parse(header.cpu())
        payload = torch.empty(sum(m.nbytes for m in metas), dtype=torch.uint8, device=self.device)
        dist.recv(payload, group=self.group, group_src=peer, tag=2 * stream + 1)
        out, offset = [], 0
        for m in metas:
            raw = payload[offset:offset + m.nbytes]
            if offset % torch.empty((), dtype=m.dtype).element_size():
                raw = raw.clone()  # a view as m.dtype needs an aligned start
            out.append((raw.view(m.dtype).view(m.shape), m.requires_grad))
            offset += m.nbytes
        return out

    def wait_sends(self) -> None:
        """Complete every send started so far."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
