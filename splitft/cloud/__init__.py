"""The cloud runtime, one room per job.

- :mod:`.server` — sockets, the session registry, admission (policy and budgets), one answer per
  message, expiry;
- :mod:`.session` — one edge's cloud half: decoding, compute, encoding, graphs awaiting their
  backward, memory held;
- :mod:`.ops` — the operations an edge mirrors (optimizer steps, zero_grad, ...);
- :mod:`.replies` — request numbers and the reply cache (each request applied once);
- :mod:`.checkpoints` — snapshots, restores and resuming sessions;
- :mod:`.guard` — typed blame for the edge's input, stage timers;
- :mod:`.ranks` — one rank of a cloud of several processes (torch.distributed): addresses,
  heartbeats and placement through the job's store; :mod:`.rank_server` — the front door's
  redirects and the bookkeeping ranks share; :mod:`.workers` — ``--workers N`` on torch's
  launcher, and the cloud command's hooks;
- :mod:`.rounds` — a shared half trained in synchronous data-parallel rounds;
- :mod:`.allreduce` — those rounds across ranks: DDP communication hooks on the gradient bucket.
- :mod:`.batch_split` — one edge's batch split by rows across ranks, replicas of its half;
- :mod:`.shard` — the same with the half sharded across the ranks (FSDP2) instead of replicated;
- :mod:`.batch_link` — the commands, tensors and gradient sums those ranks exchange.

Model factories (shared with the edge) live in :mod:`splitft.factories`, budgets in
:mod:`splitft.cloud.limits` and :mod:`splitft.cloud.budget`, the negotiation policy in :mod:`splitft.cloud.codec_policy`.
"""

from ..errors import PeerGone
from ..factories import load_factory
from .limits import Limits
from .server import CloudServer, serve_in_thread
from .session import CloudSession, SharedPart

__all__ = ["CloudServer", "CloudSession", "Limits", "PeerGone", "SharedPart", "load_factory", "serve_in_thread"]
