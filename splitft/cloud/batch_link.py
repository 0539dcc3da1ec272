"""Messages and tensors between the ranks of a cloud that splits one edge's batch (``--split-batch``).

Rank 0 talks to the edge; the other ranks only ever hear rank 0, through this link:

- a **command** (open a session, apply operations, run a forward or a backward, stop) is a
  msgpack header plus optional frames of a protocol message, broadcast from rank 0;
- **tensors** go point to point (``dist.send``/``dist.recv``) with their dtype and shape named
  in a header beforehand, so a receiver never guesses a size;
- **parameter gradients** are summed over the ranks with one all-reduce per dtype.

No pickle: headers are msgpack (``raw=False``), arrays are raw tensor buffers.
"""

from __future__ import annotations

import logging
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from ..errors import ProtocolError

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ProtocolError(f"a tensor of dtype {dtype} cannot travel between ranks; allowed: {sorted(DTYPES)}")
    return name


def spec(t: torch.Tensor, rows: bool = False) -> list:
    """[dtype, shape] of ``t`` (without its first dim when ``rows``: the receiver knows its rows)."""
    return [dtype_name(t.dtype), list(t.shape[1:] if rows else t.shape)]


class BatchLink:
    """The ranks of one process group, as seen by one of them.

    Args:
        group: the process group (default: the world, when torch.distributed is initialized;
            else this process alone, and every collective is a no-op).
        device: where received tensors land.
    """

    def __init__(self, group: Any = None, device: torch.device | None = None) -> None:
        ranked = group is not None or (dist.is_available() and dist.is_initialized())
        self.group = group
        self.world = dist.get_world_size(group) if ranked else 1
        self.rank = dist.get_rank(group) if ranked else 0
        self.device = device or torch.device("cpu")

    def peer(self, rank: int) -> int:
        """The global rank of ``rank`` of this group (what send/recv take)."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    # ------------------------------------------------------------ commands (rank 0 → all)

    def broadcast(self, header: dict | None = None, frames: list | None = None) -> tuple[dict, list[bytes]]:
        """Rank 0 gives ``header`` and ``frames``; every rank returns them."""
        if self.world == 1:
            return header or {}, list(frames or [])
        parts = [msgpack.packb(header, use_bin_type=True), *map(bytes, frames or [])] if self.rank == 0 else []
        count = torch.tensor([len(parts)], dtype=torch.int64)
        dist.broadcast(count, self.peer(0), group=self.group)
        sizes = torch.tensor([len(p) for p in parts], dtype=torch.int64) if self.rank == 0 \
            else torch.empty(int(count), dtype=torch.int64)
        dist.broadcast(sizes, self.peer(0), group=self.group)
        data = torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8) if self.rank == 0 \
            else torch.empty(int(sizes.sum()), dtype=torch.uint8)
        if data.numel():
            dist.broadcast(data, self.peer(0), group=self.group)
        raw = data.numpy().tobytes()
        offsets = [0, *torch.cumsum(sizes, 0).tolist()]
        pieces = [raw[a:b] for a, b in zip(offsets, offsets[1:])]
        return msgpack.unpackb(pieces[0], raw=False, strict_map_key=True), pieces[1:]

    def broadcast_tensors(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Rank 0's ``tensors`` on every rank (the others pass buffers of the right dtype and shape)."""
        out = []
        for t in tensors:
            buf = t.detach().to(torch.uint8 if t.dtype == torch.bool else t.dtype).contiguous()
            if self.world > 1:
                dist.broadcast(buf, self.peer(0), group=self.group)
            out.append(buf.to(torch.bool) if t.dtype == torch.bool else buf)
        return out

    # ------------------------------------------------------------ point to point

    def send_header(self, header: dict, dst: int) -> None:
        data = torch.frombuffer(bytearray(msgpack.packb(header, use_bin_type=True)), dtype=torch.uint8)
        dist.send(torch.tensor([data.numel()], dtype=torch.int64), self.peer(dst), group=self.group)
        dist.send(data, self.peer(dst), group=self.group)

    def recv_header(self, src: int) -> dict:
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, self.peer(src), group=self.group)
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(data, self.peer(src), group=self.group)
        return msgpack.unpackb(data.numpy().tobytes(), raw=False, strict_map_key=True)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        buf = tensor.detach()
        buf = (buf.to(torch.uint8) if buf.dtype == torch.bool else buf).contiguous()
        if buf.numel():
            dist.send(buf, self.peer(dst), group=self.group)

    def recv(self, dtype: str, shape: list[int], src: int) -> torch.Tensor:
        """A tensor from ``src`` of the dtype and shape a header named."""
        if dtype not in DTYPES or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise ProtocolError(f"a rank announced a tensor of dtype {dtype!r} and shape {shape!r}")
        kind = DTYPES[dtype]
        buf = torch.empty(shape, dtype=torch.uint8 if kind == torch.bool else kind, device=self.device)
        if buf.numel():
            dist.recv(buf, self.peer(src), group=self.group)
        return buf.to(torch.bool) if kind == torch.bool else buf

    # ------------------------------------------------------------ gradients

    def sum_grads(self, params: list[torch.Tensor]) -> None:
        """Replace each parameter's gradient by its sum over the ranks (None where no rank has one)."""
        if self.world == 1 or not params:
            return
        flags = torch.tensor([float(p.grad is not None) for p in params], dtype=torch.float64)
        dist.all_reduce(flags, group=self.group)
        by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for p, flag in zip(params, flags.tolist()):
            if flag > 0:
                grad = p.grad
                if grad is None:
                    grad = p.grad = torch.zeros_like(p)
                by_dtype.setdefault(grad.dtype, []).append((p, grad))
        for pairs in by_dtype.values():
            flat = torch.cat([grad.reshape(-1) for _, grad in pairs])
            dist.all_reduce(flat, group=self.group)
            for (p, grad), chunk in zip(pairs, flat.split([p.numel() for p, _ in pairs])):
                p.grad = chunk.view_as(grad).clone()


def shard_sizes(rows: int, world: int) -> list[int]:
    """Rows per rank: as even as can be, the first ranks one more (``torch.tensor_split``'s way)."""
    return [rows // world + (1 if r < rows % world else 0) for r in range(world)]


__all__ = ["BatchLink", "DTYPES", "dtype_name", "shard_sizes", "spec"]
