"""One heavy half for one edge, replicated on the cloud's ranks: each batch split by rows (``--split-batch``).

A cloud launched as N ranks (torchrun's variables) holds N replicas of the session's half. Rank 0
serves the edge as any cloud does (listener, protocol, codecs, the reply cache); ranks >= 1 run
:class:`Worker` and only hear rank 0 (:mod:`.batch_link`). For each forward call rank 0 decodes
the request, sends each rank its rows (dim 0 of every tensor argument), computes its own, and
gathers the outputs back in order. Whatever comes after the half (the loss of a plain split)
runs on rank 0 on the whole batch's outputs, so every loss and reduction is the whole batch's.
In the backward rank 0 takes the gradient of those outputs, sends each rank its rows, every rank
backpropagates its shard, the input gradients are gathered, and the parameter gradients summed
over the ranks: every replica holds the whole batch's gradient and steps identically. Mirrored
operations (optimizer, zero_grad, loss, modes, frozen parameters, loaded weights) are broadcast
and applied on every rank in the order rank 0 applies them; the weights come from rank 0 at hello.

With the identity codec N ranks equal one process (up to the order of floating-point sums).
What cannot be split exactly is refused: BatchNorm in the half (its batch statistics would be a
shard's), key/value caches, outputs without the batch as first dim. An edge's eager backward is
answered as a forward, then a backward request. With ``--shard`` (:mod:`.shard`) each rank holds
a shard of the half instead of a replica, and FSDP2's collectives replace the gradient sum.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..devices import autocast_region
from ..errors import ConfigError, ModelError, ProtocolError, SplitFTError
from ..wire import protocol
from ..wire.coding import SLOTS, Same, flatten, unflatten
from ..wire.tree import Leaf
from .batch_link import DTYPES, BatchLink, shard_sizes, spec
from .blame import blame
from .budget import GraphMeter, holdings
from .calls import Inputs
from .graphs import Pending
from .session import CloudSession

log = logging.getLogger(__name__)


@dataclass
class _Shards:
    """Rank 0's view of one forward call: rows per rank, its own shard's graph, the joined outputs."""

    rows: list[int]
    leaves: list[torch.Tensor]  # the whole batch's input leaves (their gradients go to the edge)
    own_leaves: list[torch.Tensor]  # rank 0's shard of them, as its graph saw them
    own_outs: list[torch.Tensor]  # rank 0's shard's outputs
    joined: list[torch.Tensor]  # the whole batch's outputs: leaves the loss (or the edge) starts from


def refuse_unsplittable(chain: nn.Module) -> None:
    """A half whose result depends on the batch as a whole cannot be split by rows exactly."""
    for name, module in chain.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise ConfigError(f"--split-batch cannot split a batch through {name or 'the half'} "
                              f"({type(module).__name__}): its batch statistics would be each rank's shard's, "
                              "not the batch's. Use LayerNorm/GroupNorm in the cloud half, or serve it "
                              "without --split-batch")


def batch_rows(tensors: list[torch.Tensor]) -> int:
    """The batch size every tensor argument agrees on (dim 0); refuses what cannot be split."""
    shapes = [tuple(t.shape) for t in tensors]
    if not shapes or any(len(s) == 0 for s in shapes) or len({s[0] for s in shapes}) != 1 or shapes[0][0] == 0:
        raise ConfigError(f"--split-batch splits dim 0 of every tensor the edge sends to the half; the tensors "
                          f"have shapes {shapes}: they need one batch size (>= 1) as their first dim")
    return shapes[0][0]


def pack_skeleton(node: Any) -> Any:
    """A skeleton as msgpack-able plain values (leaves and tuples tagged)."""
    if isinstance(node, Leaf):
        if node.expand is not None:
            raise ProtocolError("a compacted leaf reached the batch split")
        return {"$leaf": node.index}
    if isinstance(node, Same):
        return {"$same": node.index}
    if isinstance(node, tuple):
        return {"$tuple": [pack_skeleton(v) for v in node]}
    if isinstance(node, list):
        return [pack_skeleton(v) for v in node]
    if isinstance(node, dict):
        return {k: pack_skeleton(v) for k, v in node.items()}
    return node


def unpack_skeleton(node: Any) -> Any:
    if isinstance(node, dict) and set(node) == {"$leaf"}:
        return Leaf(node["$leaf"])
    if isinstance(node, dict) and set(node) == {"$same"}:
        return Same(node["$same"])
    if isinstance(node, dict) and set(node) == {"$tuple"}:
        return tuple(unpack_skeleton(v) for v in node["$tuple"])
    if isinstance(node, list):
        return [unpack_skeleton(v) for v in node]
    if isinstance(node, dict):
        return {k: unpack_skeleton(v) for k, v in node.items()}
    return node


def _materialized(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """``skeleton`` without compacted leaves: their tensors are repeated to full size in ``tensors``."""
    if isinstance(skeleton, Leaf):
        if skeleton.expand is not None:
            tensors[skeleton.index] = unflatten(skeleton, tensors).contiguous()
        return Leaf(skeleton.index)
    if isinstance(skeleton, tuple):
        return tuple(_materialized(v, tensors) for v in skeleton)
    if isinstance(skeleton, list):
        return [_materialized(v, tensors) for v in skeleton]
    if isinstance(skeleton, dict):
        return {k: _materialized(v, tensors) for k, v in skeleton.items()}
    return skeleton


def shard_outputs(value: Any, rows: int) -> list[torch.Tensor]:
    """The half's outputs for a shard of ``rows`` rows; each must carry the batch as its first dim."""
    outs, _ = flatten(value, "the cloud half's output")
    bad = [tuple(t.shape) for t in outs if t.dim() == 0 or t.shape[0] != rows]
    if bad:
        raise ConfigError(f"--split-batch joins the half's outputs along dim 0, but for {rows} rows it returned "
                          f"shapes {bad}; every output must have the batch as its first dim")
    return outs


def _stash(params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    prior = [p.grad for p in params]
    for p in params:
        p.grad = None
    return prior


def _restore(params: list[torch.Tensor], prior: list[torch.Tensor | None]) -> None:
    """Add back the gradients accumulated before this backward (as autograd accumulates)."""
    for p, before in zip(params, prior):
        if before is not None:
            p.grad = before if p.grad is None else before.add_(p.grad)


def backward_shard(link: BatchLink, params: list[torch.Tensor], outs: list[torch.Tensor],
                   grads: list[torch.Tensor | None]) -> str | None:
    """Backpropagate a shard's outputs; returns the error it met, if any (the ranks go on in step)."""
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    try:
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return None
    except Exception as exc:  # noqa: BLE001 — reported to rank 0, which answers the edge with it
        for p in params:
            p.grad = None  # a failed backward contributes nothing
        return f"{type(exc).__name__}: {exc}"


class BatchSplitSession(CloudSession):
    """Rank 0's session: an edge's half whose every batch is computed by all the ranks together."""

    # Every rank must take part in each collective, in order: the work stays on the serving
    # thread, and the half (whose forward all-gathers when sharded) is never run on meta tensors.
    off_thread = False
    count_on_meta = False
    groups_passes = False

    def __init__(self, hello: protocol.Hello, *args: Any, link: BatchLink,
                 report: Callable[[str], None] | None = None, **kwargs: Any) -> None:
        super().__init__(hello, *args, **kwargs)
        if self.half.shared is not None:
            raise ConfigError("--split-batch serves one heavy half per edge; it cannot be a --shared-model")
        refuse_unsplittable(self.half.chain)
        self.link = link
        self.report = report
        self._reported = False
        self.shards: dict[int, _Shards] = {}
        self._call = 0
        self._last: _Shards | None = None
        hello = dataclasses.replace(hello, codecs={slot: "identity" for slot in SLOTS}, weights=None,
                                    value_hash=None, resume=None)
        state = list(self.half.chain.state_dict().values())
        link.broadcast({"op": "open", "state": [spec(t) for t in state]}, protocol.encode(hello))
        link.broadcast_tensors(state)

    # ------------------------------------------------------------ operations

    def apply_ops(self, values: list) -> int:
        if values:
            self.link.broadcast({"op": "ops"}, protocol.encode(protocol.Sync(ops=values)))
        try:
            return super().apply_ops(values)
        finally:
            self._prune()
            self._reported = self._reported or report_holdings(self, self.link.rank, self.report)

    def _prune(self) -> None:
        for call in [c for c in self.shards if c not in self.graphs.pending]:
            del self.shards[call]

    # ------------------------------------------------------------ forward

    def forward(self, msg: protocol.Forward) -> protocol.Output:
        self._call, self._last = msg.call, None
        return super().forward(dataclasses.replace(msg, eager=False))

    def run(self, inputs: Inputs, train: bool, grad: bool,
            autocast: str | None = None) -> tuple[list[torch.Tensor], Any, GraphMeter]:
        args_skel, kw_skel, target_skel = inputs.skeletons
        n_in = sum(inputs.counts)
        if self.caches.named((args_skel, kw_skel)):
            raise ConfigError("--split-batch cannot split key/value caches across ranks: call the model with "
                              "use_cache=False, or serve it without --split-batch")
        tensors = list(inputs.tensors)
        skeleton = _materialized((args_skel, kw_skel), tensors)
        rows = self._split_rows(batch_rows(tensors[:n_in]))
        leaves = [t.detach().requires_grad_() if g and t.is_floating_point() else t
                  for t, g in zip(tensors, inputs.grads)]
        pieces = [t.detach().split(rows) for t in tensors[:n_in]]
        self.link.broadcast({"op": "forward", "call": self._call, "train": train, "grad": grad, "autocast": autocast,
                             "rows": rows, "skeleton": pack_skeleton(skeleton), "counts": list(inputs.counts),
                             "grads": list(inputs.grads[:n_in]), "tensors": [spec(t, rows=True) for t in tensors[:n_in]]})
        for r in range(1, self.link.world):
            for piece in pieces if rows[r] else []:
                self.link.send(piece[r], r)
        error: BaseException | None = None
        try:
            own = Inputs([p[0] for p in pieces], list(inputs.coded[:n_in]), list(inputs.grads[:n_in]),
                          (*skeleton, None), inputs.counts)
            own_leaves, value, saved = super().run(own, train, grad, autocast)
            own_outs, out_skel = shard_outputs(value, rows[0]), flatten(value)[1]
        except Exception as exc:  # noqa: BLE001 — raised once the other ranks' answers are in
            error = exc
        theirs = [self._gather(r, rows[r]) for r in range(1, self.link.world)]
        if error is not None:
            raise error
        joined = self._join(own_outs, theirs)
        value = unflatten(out_skel, joined)
        target = unflatten(target_skel, leaves[n_in:], dict(enumerate(leaves[:n_in])), n_in)
        if target is not None:
            loss_fn = self.mirrored.loss_fn
            if loss_fn is None:
                raise ConfigError("a target arrived but no loss was configured: use model.remote_loss(criterion)")
            with torch.set_grad_enabled(grad), blame(ModelError, "the loss failed on the cloud half's outputs"), \
                    autocast_region(autocast, self.half.placement.device):
                value = loss_fn(value, target)
        self._last = _Shards(rows, leaves[:n_in], own_leaves, own_outs, joined)
        return leaves, value, saved

    def _split_rows(self, total: int) -> list[int]:
        """Rows per rank for a batch of ``total`` rows."""
        return shard_sizes(total, self.link.world)

    def _sum_grads(self, params: list[torch.Tensor]) -> None:
        """Every replica's gradient becomes the sum over the ranks' rows."""
        self.link.sum_grads(params)

    def _gather(self, rank: int, rows: int) -> list[torch.Tensor]:
        status = self.link.recv_header(rank)
        outs = [self.link.recv(dtype, shape, rank) for dtype, shape in status.get("outputs", [])]
        if status.get("error"):
            raise ModelError(f"the cloud half failed on rank {rank}'s {rows} row(s): {status['error']}")
        return outs

    @staticmethod
    def _join(own: list[torch.Tensor], theirs: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        joined = []
        for j, mine in enumerate(own):
            parts = [mine.detach()]
            for outs in theirs:
                if not outs:
                    continue
                if len(outs) != len(own) or outs[j].dtype != mine.dtype or outs[j].shape[1:] != mine.shape[1:]:
                    raise ModelError("the ranks' replicas of the half returned outputs of different kinds")
                parts.append(outs[j].to(mine.device))
            joined.append(torch.cat(parts).requires_grad_(mine.requires_grad))
        return joined

    def keep_graph(self, msg: protocol.Forward, *args: Any) -> None:
        super().keep_graph(msg, *args)
        if self._last is not None:
            self.shards[msg.call] = self._last
        self._prune()

    # ------------------------------------------------------------ backward

    def backpropagate(self, call: int, outputs: list[torch.Tensor], grads: list[torch.Tensor],
                      only: list[torch.Tensor] | None = None) -> None:
        if only is not None:
            raise ConfigError("a backward into the inputs alone (backward(inputs=...), autograd.grad on the edge) "
                              "is not served by a batch split across ranks (--split-batch)")
        shards = self.shards.pop(call, None)
        if shards is None:
            raise ProtocolError(f"call {call}'s shards are gone (freed by an optimizer step)")
        params: list[torch.Tensor] = list(self.half.chain.parameters())
        prior = _stash(params)
        try:
            with blame(ModelError, "backpropagating the edge's gradient failed"):
                torch.autograd.backward(outputs, grads)  # to the joined outputs: the whole batch's loss
            out_grads = [t.grad.split(shards.rows) if t.grad is not None else None for t in shards.joined]
            self.link.broadcast({"op": "backward", "call": call, "rows": shards.rows,
                                 "grads": [None if g is None else spec(g[0], rows=True) for g in out_grads]})
            for r in range(1, self.link.world):
                for g in out_grads if shards.rows[r] else []:
                    if g is not None:
                        self.link.send(g[r], r)
            error = backward_shard(self.link, params, shards.own_outs,
                                   [None if g is None else g[0] for g in out_grads])
            theirs = [self._gather_input_grads(r) for r in range(1, self.link.world)]
            self._sum_grads(params)
            failed = [(r, e) for r, (e, _) in enumerate([(error, None), *theirs]) if e]
            if failed:
                raise ModelError("backpropagating the edge's gradient failed on rank "
                                 + "; rank ".join(f"{r}: {e}" for r, e in failed))
            self._input_grads(shards, [g for _, g in theirs])
        finally:
            _restore(params, prior)

    def _gather_input_grads(self, rank: int) -> tuple[str | None, list[torch.Tensor]]:
        status = self.link.recv_header(rank)
        return status.get("error"), [self.link.recv(dtype, shape, rank) for dtype, shape in status.get("grads", [])]

    @staticmethod
    def _input_grads(shards: _Shards, theirs: list[list[torch.Tensor]]) -> None:
        """The whole batch's input gradients: each rank's rows, in order."""
        needed = [i for i, leaf in enumerate(shards.leaves) if leaf.requires_grad]
        for k, i in enumerate(needed):
            own = shards.own_leaves[i]
            parts = [own.grad if own.grad is not None else torch.zeros_like(own)]
            parts += [grads[k].to(own.device) for grads in theirs if grads]
            shards.leaves[i].grad = torch.cat(parts).to(shards.leaves[i].dtype)


class Worker:
    """A rank >= 1: a replica of the session's half, computing the rows rank 0 sends it."""

    def __init__(self, link: BatchLink, factories: dict[str, Callable[..., nn.Module]], limits: Any = None,
                 placement: Any = None, report: Callable[[str], None] | None = None) -> None:
        self.link, self.factories, self.limits, self.placement = link, factories, limits, placement
        self.report = report
        self.session: CloudSession | None = None
        self._reported = False

    def handlers(self) -> dict[str, Callable[[dict, list[bytes]], None]]:
        """The commands this rank follows, by name."""
        return {"open": self._open, "ops": self._ops, "forward": self._forward, "backward": self._backward}

    def serve(self) -> None:
        """Follow rank 0's commands until it says stop (or its process is gone)."""
        handlers = self.handlers()
        while True:
            header, frames = self.link.broadcast()
            if header.get("op") == "stop":
                return
            handlers[header["op"]](header, frames)

    def _open(self, header: dict, frames: list[bytes]) -> None:
        state = self.link.broadcast_tensors([torch.empty(shape, dtype=_dtype(d)) for d, shape in header["state"]])
        self._reported = False
        try:
            hello = protocol.decode(frames)
            if not isinstance(hello, protocol.Hello):
                raise ProtocolError(f"rank 0 opened a replica with a {hello.TYPE} message")
            session = self._replica(hello)
            with torch.no_grad():
                for target, value in zip(session.half.chain.state_dict().values(), state, strict=True):
                    target.copy_(value)
            self.session = session
            log.info("rank %d: holds a replica of %s cut at %s", self.link.rank, hello.factory, hello.cut)
        except (SplitFTError, ValueError) as exc:
            self.session = None
            log.warning("rank %d: cannot open the replica: %s", self.link.rank, exc)

    def _replica(self, hello: protocol.Hello) -> CloudSession:
        """This rank's copy of the half, before rank 0's weights are copied in (dropout: this rank's
        rows draw a stream of their own, not a copy of rank 0's masks)."""
        return CloudSession(hello, self.factories, self.limits, restoring=True, placement=self.placement,
                            stream=self.link.rank)

    def _ops(self, header: dict, frames: list[bytes]) -> None:
        if self.session is None:
            return
        try:
            self.session.apply_ops(getattr(protocol.decode(frames), "ops", []))
        except SplitFTError as exc:  # rank 0 met the same, and told the edge
            log.debug("rank %d: operations refused: %s", self.link.rank, exc)
        self._reported = self._reported or report_holdings(self.session, self.link.rank, self.report)

    def _sum_grads(self, params: list[torch.Tensor]) -> None:
        self.link.sum_grads(params)

    def _forward(self, header: dict, frames: list[bytes]) -> None:
        rows = header["rows"][self.link.rank]
        tensors = [self.link.recv(d, [rows, *shape], 0) for d, shape in header["tensors"]] if rows else []
        outs: list[torch.Tensor] = []
        leaves: list[torch.Tensor] = []
        error = None
        session = self.session
        if rows:
            try:
                if session is None:
                    raise ConfigError("this rank holds no replica of the half (its hello failed here)")
                skeleton = unpack_skeleton(header["skeleton"])
                inputs = Inputs(tensors, [], header["grads"], (*skeleton, None), tuple(header["counts"]))
                leaves, value, _ = session.run(inputs, header["train"], header["grad"], header["autocast"])
                outs = shard_outputs(value, rows)
            except Exception as exc:  # noqa: BLE001 — reported to rank 0, which answers the edge with it
                error, outs = f"{type(exc).__name__}: {exc}", []
        self.link.send_header({"error": error, "outputs": [spec(t) for t in outs]}, 0)
        for t in outs:
            self.link.send(t, 0)
        if session is not None and rows and error is None and header["grad"]:
            session.graphs.keep(header["call"], Pending(leaves, [], header["grads"], outs, [], None))

    def _backward(self, header: dict, frames: list[bytes]) -> None:
        rows = header["rows"][self.link.rank]
        grads = [None if s is None else self.link.recv(s[0], [rows, *s[1]], 0) for s in header["grads"]] \
            if rows else []
        pending = self.session.graphs.take(header["call"]) if self.session is not None else None
        params: list[torch.Tensor] = list(self.session.half.chain.parameters()) if self.session is not None else []
        prior = _stash(params)
        try:
            error: str | None = None
            back: list[torch.Tensor] = []
            if rows and pending is None:
                error = "this rank kept no graph for the call"
            elif rows and pending is not None:
                error = backward_shard(self.link, params, pending.outputs, grads)
                back = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                        for leaf in pending.inputs if leaf.requires_grad] if error is None else []
            self.link.send_header({"error": error, "grads": [spec(g) for g in back]}, 0)
            for g in back:
                self.link.send(g, 0)
            self._sum_grads(params)
        finally:
            _restore(params, prior)


def report_holdings(session: CloudSession, rank: int, report: Callable[[str], None] | None) -> bool:
    """Once the first optimizer step made its state: say what this rank holds; whether it was said."""
    optimizer = session.mirrored.optimizer
    if session.mirrored.steps < 1 or optimizer is None:
        return False
    if report is not None:
        report(f"rank {rank}: {holdings(session.half.chain, optimizer).describe()}")
    return True


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ProtocolError(f"rank 0 announced a tensor of dtype {name!r}")
    return DTYPES[name]


__all__ = ["BatchSplitSession", "Worker", "batch_rows", "refuse_unsplittable", "report_holdings"]
