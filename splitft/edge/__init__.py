"""The edge runtime: the half of a split that trains on the device, in rooms of one job each.

=============  ===========================================================================
requests.py    the reliable request layer: the handshake, numbered requests, the replay log,
               reconnecting with backoff, heartbeats (:class:`EdgeSession`). No autograd.
schedule.py    micro-batches and eager backward: which message goes when. No sockets.
stage.py       one part's messages: encoding what crosses through the codecs, decoding replies.
model.py       :class:`SplitModel` and the cut as an autograd function.
mirror.py      optimizer, loss and backward-scale operations mirrored to the cloud.
resume.py      edge checkpoints, and continuing a session from one.
api.py         :func:`split`: the options wired into the rooms above.
=============  ===========================================================================

The options that :func:`split` takes (:mod:`splitft.options`) are re-exported here.
"""

from __future__ import annotations

from ..options import Codecs, Factory, Faults, Link, Schedule
from .api import split
from .model import CutActivation, RemoteLoss, SplitModel
from .requests import EdgeSession

__all__ = ["Codecs", "CutActivation", "EdgeSession", "Factory", "Faults", "Link", "RemoteLoss", "Schedule",
           "SplitModel", "split"]
