"""The rank-0 serving protocol: what lets any rank call ``optimizer.state_dict()`` alone while the others
do whatever they do between steps. The requester's side and the protocol (peers.py), each rank's server
thread (server.py) over a gloo channel of its own (channel.py), the store mailboxes that announce a
request (inbox.py), and the versions of a rank's state kept while a request may still want one
(published.py). It reads the state's forms from the room above (canonical.py); that room never imports
this one (tests/test_package_layout.py)."""

from .peers import CheckpointSyncError

__all__ = ["CheckpointSyncError"]
