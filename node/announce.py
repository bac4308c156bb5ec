"""A serving node's mDNS record (`swarm node` without --no-mdns or --join): registered off the start-up
path, and announced again whenever what the node serves changes. `node` is the daemon's serving node: its
args, server and `properties()`."""

from __future__ import annotations

import sys
import threading
from typing import Any


def _advertise(node: Any) -> Any:
    """The node's mDNS advertiser, started; None (and a warning) when advertising fails."""
    from swarm.node.discovery import Advertiser, default_mdns_interfaces

    args = node.args
    interfaces = args.mdns_interface if args.mdns_interface else default_mdns_interfaces(args.host)
    try:
        return Advertiser(node.server.port, args.host, node.properties(), interfaces, args.name).start()
    except OSError as e:
        print(
            f"swarm node: warning: mDNS advertising failed ({e}); reach this node by --peer", file=sys.stderr
        )
        return None


class Announcement:
    """The node's mDNS record, registered on a thread of its own: zeroconf probes for the name and announces
    it for about half a second, through which the node already serves (--peer reaches it, and its ready
    file says so)."""

    def __init__(self, node: Any) -> None:
        self.node = node
        self._advertiser: Any = None
        self._lock = threading.Lock()
        self._stale = False  # properties changed while it registered
        self._closed = False
        self._thread = threading.Thread(target=self._register, name="swarm-mdns-register", daemon=True)

    def start(self) -> Announcement:
        self._thread.start()
        return self

    def _register(self) -> None:
        advertiser = _advertise(self.node)
        with self._lock:
            if self._closed or advertiser is None:
                if advertiser is not None:
                    advertiser.close()
                return
            self._advertiser, stale = advertiser, self._stale
        if stale:
            advertiser.update(self.node.properties())

    def update(self) -> None:
        """Announce the node's properties as they are now."""
        with self._lock:
            advertiser = self._advertiser
            if advertiser is None:
                self._stale = True
                return
        advertiser.update(self.node.properties())

    def close(self) -> None:
        self._thread.join(10.0)
        with self._lock:
            self._closed = True
            advertiser, self._advertiser = self._advertiser, None
        if advertiser is not None:
            advertiser.close()
