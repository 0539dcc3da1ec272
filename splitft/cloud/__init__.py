"""The cloud runtime, one room per job (docs/architecture.md maps them all).

- :mod:`.server` — sockets, the session registry, admission, one answer per message (handlers
  registered by message type, :mod:`.dispatch`), expiry;
- :mod:`.session` — one edge's session, composed of rooms that each own a piece of its state:
  :mod:`.half` (its half and parameters), :mod:`.handlers` (what the edge mirrored: optimizer,
  loss, modes, steps; one handler per operation), :mod:`.replies` (request numbers and the reply
  cache), :mod:`.graphs` (graphs awaiting their backward), :mod:`.admission` (its seat),
  :mod:`.costs` (its pricing); :mod:`.calls` moves a call's tensors through its codecs;
- :mod:`.snapshots` — checkpoints, restores and resuming sessions;
- :mod:`.ranks`, :mod:`.rank_server`, :mod:`.workers` — a cloud of several processes;
- :mod:`.rounds`, :mod:`.allreduce` — a shared half trained in synchronous data-parallel rounds;
- :mod:`.batch_split`, :mod:`.replicas`, :mod:`.shard`, :mod:`.batch_link` — one edge's batch
  split by rows across ranks, on replicas or FSDP2 shards of its half.

Model factories (shared with the edge) live in :mod:`splitft.factories`, budgets in
:mod:`splitft.cloud.limits` and :mod:`splitft.cloud.budget`, the negotiation policy in :mod:`splitft.cloud.codec_policy`.
"""

from ..errors import PeerGone
from ..factories import load_factory
from .half import SharedPart
from .limits import Limits
from .server import CloudServer, serve_in_thread
from .session import CloudSession

__all__ = ["CloudServer", "CloudSession", "Limits", "PeerGone", "SharedPart", "load_factory", "serve_in_thread"]
