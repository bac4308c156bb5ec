"""`swarm node --join`: the node dials out to the coordinator and keeps that link, so that a phone (no
multicast in Termux, an address that changes) or a laptop behind NAT serves a swarm that cannot reach it.

The link is one control connection and, as the coordinator asks for them over it, more connections of two
kinds (swarm.node.link): "stream" connections on which this node answers Compute frames exactly as on its
compute stream (the framing reversed in direction only: the coordinator calls, the node answers), and "grpc"
connections relayed to the node's own gRPC server on loopback (Info, Stats, health). Both ends ping over the
control connection; one that hears nothing for the link timeout takes the link as lost. The node then dials
again with backoff (its address may have changed: NAT rebinding, another Wi-Fi), while the coordinator fails
its calls over to other holders; a node that comes back under the same id is the same node to it.

With --fetch the coordinator is a source too (`fetch_link`): before the node has a manifest it fetches one,
and then its slabs, over "files" connections (swarm.node.link_files), and it joins once the manifest is in
place, serving each slab as it verifies: it tells the coordinator over the control connection whenever the
slabs it serves change (`announce`), as a node found by mDNS announces them again.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.node.auth import SwarmKey, Verifier, is_loopback_host
from swarm.node.invite import Invite, cert_pin, join_secret, parse_invite
from swarm.node.link import LINK_TIMEOUT, Control, LinkError, LinkRefused, dial, relay, shut
from swarm.node.streams import IDLE_SECONDS, Answer, serve_frames
from swarm.sharding.errors import UserError
from swarm.sharding.identity import ModelIdentity

if TYPE_CHECKING:
    from swarm.node.link_files import LinkFiles

log = logging.getLogger(__name__)

FIRST_BACKOFF, MAX_BACKOFF = 0.5, 30.0  # seconds between dials after a lost link, doubling up to the most


@dataclass(frozen=True)
class JoinTarget:
    """Where to dial and how to prove the key: from an invite, or from HOST:PORT and the swarm key."""

    addresses: tuple[str, ...]
    pin: str
    secret: bytes


def join_text(join: str) -> str:
    """--join's value: an invite, HOST:PORT, or a file holding an invite (which, unlike a command line, no
    process listing shows: an invite lets its holder join)."""
    path = Path(join)
    if not join.startswith("swarm-invite") and path.is_file():
        try:
            return path.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--join {join}: cannot read the invite ({e})") from None
    return join.strip()


def parse_join(join: str, key: SwarmKey | None) -> tuple[JoinTarget, Invite | None]:
    """Where `--join` says to dial and how to prove the key (and the invite, when it is one); a UserError
    that says what to fix."""
    join = join_text(join)
    if join.startswith("swarm-invite"):
        invite: Invite = parse_invite(join)
        if key is not None and cert_pin(key) != invite.pin:
            raise UserError(
                "the invite is of another swarm than this node's --key-file; leave the key out (the invite "
                "is enough) or ask for an invite of this swarm"
            )
        return JoinTarget(invite.addresses, invite.pin, invite.secret), invite
    host, sep, port = join.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UserError(
            f"--join {join!r}: give an invite (`swarm invite MODEL` prints one) or HOST:PORT of the coordinator"
        )
    if key is None:
        raise UserError(
            "--join HOST:PORT needs the swarm key (--key-file, $SWARM_KEY_FILE or $SWARM_KEY); or give an invite"
        )
    return JoinTarget((join,), cert_pin(key), join_secret(key)), None


def join_target(join: str, key: SwarmKey | None, identity: ModelIdentity) -> JoinTarget:
    """What `--join` names, checked against this node's key and model (a UserError that says what to fix)."""
    target, invite = parse_join(join, key)
    if invite is not None and not invite.matches(identity):
        raise UserError(
            f"the invite is for model {invite.fingerprint}..., this node holds {identity.fingerprint[:16]}... "
            "(another model); start it on the coordinator's model (`swarm node DIR --fetch --join INVITE` on an "
            "empty DIR fetches its slabs)"
        )
    return target


def dial_any(target: JoinTarget, hello: dict[str, Any]) -> tuple[ssl.SSLSocket, str]:
    """A proven connection (`hello` says of what kind), the target's addresses tried in turn; with the address
    that took it. LinkRefused when every address refused this node (final), else OSError naming what each met
    (worth dialing again)."""
    errors: list[str] = []
    refusals: list[LinkRefused] = []
    for address in target.addresses:
        try:
            return dial(address, target.pin, target.secret, hello), address
        except LinkRefused as e:
            refusals.append(e)
            errors.append(str(e))
        except (OSError, LinkError) as e:
            errors.append(f"{address}: {e}")
    if len(refusals) == len(target.addresses):
        raise refusals[0]
    raise OSError("; ".join(errors))


def fetch_link(args: argparse.Namespace, key: SwarmKey | None, model: ModelIdentity | None) -> LinkFiles:
    """The coordinator as a source for --fetch: its shard directory's files over "files" connections of the
    link, asked for `model` (what the directory already holds, or --fingerprint), else for the invite's model,
    else (--join HOST:PORT with the key) for whatever model the coordinator runs. Dialed before the node has
    a manifest, so the hello names a prefix of the model at most; the coordinator judges that."""
    from swarm.node.link_files import LinkFiles

    target, invite = parse_join(args.join, key)
    if model is None and invite is not None:
        model = ModelIdentity(invite.fingerprint, invite.source_sha256)
    hello = {
        "kind": "files",
        "conn": 0,
        "node": secrets.token_hex(8),
        "name": args.name or f"swarm-node-{os.uname().nodename}",
        "fingerprint": model.fingerprint if model is not None else "",
        "source_sha256": model.source_sha256 if model is not None else "",
    }
    where = " or ".join(target.addresses)
    return LinkFiles(f"coordinator {where}", lambda: dial_any(target, hello)[0], args.join_wait)


class JoinLink:
    """The node's link to its coordinator, kept on a thread of its own until `close`. `answer` and `verifier`
    are the node's compute stream's (a call is checked as there); `grpc_port` its loopback gRPC server."""

    def __init__(
        self,
        target: JoinTarget,
        identity: ModelIdentity,
        name: str,
        grpc_port: int,
        answer: Answer,
        verifier: Verifier | None,
        link_timeout: float = LINK_TIMEOUT,
        say: Callable[[str], None] = print,
    ) -> None:
        self.target, self.grpc_port, self.answer, self.verifier = target, grpc_port, answer, verifier
        self.link_timeout, self.say = link_timeout, say
        self.node_id = secrets.token_hex(8)  # the same across reconnects: the coordinator's name for this node
        self._hello = {
            "node": self.node_id,
            "name": name,
            "fingerprint": identity.fingerprint,
            "source_sha256": identity.source_sha256,
            "timeout": link_timeout,  # the coordinator pings often enough for it
        }
        self.joins = 0
        self.last_error = "no answer"  # what the last dial met
        self.failure = ""  # why the link was given up (a refusal); "" while it is kept
        self.changed = threading.Event()  # set on every join, and when given up
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()  # this link's connections, closed with it
        self._control: Control | None = None  # the control connection while linked
        self._thread = threading.Thread(target=self._run, name="swarm-join", daemon=True)

    def start(self) -> JoinLink:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._drop_all()
        self._thread.join(timeout=5)

    def _dial(self, kind: str, conn: int = 0) -> tuple[ssl.SSLSocket, str]:
        return dial_any(self.target, {**self._hello, "kind": kind, "conn": conn})

    def _run(self) -> None:
        backoff = FIRST_BACKOFF
        while not self._stop.is_set():
            try:
                ctl, address = self._dial("control")
            except LinkRefused as e:
                self._give_up(str(e))
                return
            except OSError as e:
                self.last_error = str(e)
                # jitter: nodes that lost one coordinator do not all dial it back in the same instant
                self._stop.wait(backoff * random.uniform(0.8, 1.2))
                backoff = min(MAX_BACKOFF, backoff * 2)
                continue
            backoff = FIRST_BACKOFF
            self.joins += 1
            self.say(f"swarm node: joined the coordinator at {address} (link {self.joins})")
            self.changed.set()
            why = self._keep(ctl)
            self._drop_all()
            if not self._stop.is_set():
                self.say(f"swarm node: the link to {address} was lost ({why}); dialing again")

    def _give_up(self, why: str) -> None:
        self.failure = why  # the daemon says it, as its error, and stops
        self.changed.set()

    def _keep(self, ctl: ssl.SSLSocket) -> str:
        """Serve the control connection until the link is lost; why it was."""
        self._track(ctl)
        self._control = control = Control(ctl, self.link_timeout)

        def on_message(message: dict[str, Any]) -> None:
            conn = message.get("conn")
            if message.get("t") == "open" and message.get("kind") in ("stream", "grpc") and isinstance(conn, int):
                threading.Thread(target=self._connection, args=(message["kind"], conn), daemon=True).start()
            # pings, and what a newer coordinator may send, are nothing to answer

        try:
            return control.keep(on_message, self._stop.is_set)
        finally:
            self._control = None

    def announce(self) -> None:
        """Tell the coordinator that the slabs this node serves changed (fetched, dropped by its check, back):
        it reads them again. Unlinked now, nothing to do: the coordinator reads them when the node dials back."""
        control = self._control
        if control is not None:
            with contextlib.suppress(OSError):
                control.send({"t": "held"})

    def _connection(self, kind: str, conn: int) -> None:
        """One more connection the coordinator asked for, dialed and served until it ends."""
        try:
            sock, _ = self._dial(kind, conn)
        except (OSError, LinkError, LinkRefused) as e:
            log.warning("a %s connection to the coordinator failed: %s", kind, e)
            return
        self._track(sock)
        if kind == "grpc":
            try:
                local = socket.create_connection(("127.0.0.1", self.grpc_port), timeout=5)
            except OSError as e:
                log.warning("cannot reach this node's own gRPC server (port %d): %s", self.grpc_port, e)
                shut(sock)
                return
            local.settimeout(None)
            relay(sock, local, "swarm-join-grpc")
            return
        try:
            serve_frames(sock, self.answer, self.verifier, IDLE_SECONDS)
        finally:
            with self._lock:
                self._open.discard(sock)
            shut(sock)

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.add(sock)

    def _drop_all(self) -> None:
        with self._lock:
            socks, self._open = list(self._open), set()
        for s in socks:
            shut(s)

    def wait_first(self, stop: threading.Event, wait: float) -> None:
        """Block until the first join (or `stop`); a UserError when refused, or when no coordinator answered
        within `wait` s (the link keeps dialing after that only once it has joined)."""
        deadline = time.monotonic() + wait
        while not stop.is_set() and self.joins == 0:
            if self.failure:
                raise UserError(self.failure)
            if time.monotonic() >= deadline:
                self._stop.set()
                where = ", ".join(self.target.addresses)
                raise UserError(
                    f"no coordinator answers at {where} ({self.last_error}) within "
                    f"{wait:g} s; is `swarm serve`/`run` running there with --listen, and does the network let "
                    "this device reach that port (port forward, firewall, or the same WireGuard/Tailscale net)?"
                )
            self.changed.wait(0.1)
        if self.failure:
            raise UserError(self.failure)


def check_join(args: argparse.Namespace) -> None:
    """What --join can tell before the slabs load: an invite's form, and a --host it leaves unused."""
    if not is_loopback_host(args.host):
        raise UserError(
            "--join serves the coordinator over the link this node dials: leave --host at 127.0.0.1 (the "
            "node's own gRPC server stays on loopback, nothing connects to it from outside)"
        )
    if (text := join_text(args.join)).startswith("swarm-invite"):
        parse_invite(text)


def join_from_args(
    args: argparse.Namespace, loaded: Any, server: Any, key: SwarmKey | None, stop: threading.Event
) -> JoinLink:
    """The node's link to its coordinator (--join), once it has joined; a UserError when it cannot."""
    identity = ModelIdentity(loaded.fingerprint, loaded.source_sha256)
    target = join_target(args.join, key, identity)
    name = args.name or f"swarm-node-{os.uname().nodename}"
    answer, verifier = server.servicer.compute_frame, server.verifier
    link = JoinLink(target, identity, name, server.port, answer, verifier, args.link_timeout).start()
    try:
        link.wait_first(stop, args.join_wait)
    except BaseException:
        link.close()
        raise
    return link
