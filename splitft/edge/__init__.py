"""The edge runtime: the half of a split that trains on the device, in rooms of one job each.

==============  ===========================================================================
requests.py     the reliable request layer: the handshake, numbered requests, the replay log,
                reconnecting with backoff, heartbeats (:class:`EdgeSession`). No autograd.
outbox.py       the operations (records) waiting to ride on the next request.
schedule.py     micro-batches and eager backward: which message goes when. No sockets.
stage.py        one part's messages through the codecs; the codecs' state and the step count.
remote_call.py  a call of the cloud half, and the cut as an autograd function.
model.py        :class:`SplitModel`: the user's model, cut, answering through the rooms.
mirror.py       what the cloud must repeat: the optimizer, its steps, frozen parameters, modes, loss.
resume.py       edge checkpoints, and continuing a session from one.
api.py          :func:`split`: the options wired into the rooms above.
==============  ===========================================================================

The options that :func:`split` takes (:mod:`splitft.options`) are re-exported here.
"""

from __future__ import annotations

from ..options import Codecs, Factory, Faults, Link, Schedule
from .api import split
from .model import CutActivation, RemoteLoss, SplitModel
from .requests import EdgeSession

__all__ = ["Codecs", "CutActivation", "EdgeSession", "Factory", "Faults", "Link", "RemoteLoss", "Schedule",
           "SplitModel", "split"]
