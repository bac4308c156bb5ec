"""The swarm key and how calls prove they come from its holders, without the key ever crossing the wire.

A swarm key is a secret text (`swarm keygen` makes one: 32 random bytes). Everything on the wire is derived
from it with HMAC-SHA256 under a distinct label, so no derived value gives the key or another value away:

- Call tags. Every call carries `swarm-auth` metadata: `v1.<session>.<counter>.<ms>.<tag>`, where the tag is an
  HMAC over the method, the session (random per client), the counter (one up per call), the client's clock in
  ms and the SHA-256 of the serialized request. A node recomputes it (constant-time compare), refuses a clock
  more than WINDOW_SECONDS off and any (session, counter) it has seen (a sliding window per session, as IPsec
  does against replays), so a listener can neither forge, alter, nor replay a call.
- The key id: what mDNS records say of a node's swarm, so that two swarms of one model on a network take
  only their own nodes.
- The TLS identity: an ECDSA P-256 key and a self-signed certificate that every holder derives identically
  (deterministic ECDSA signatures, fixed names and dates). Off loopback, nodes serve TLS with it and require it
  of clients: activations are private on the wire and only key holders connect at all.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import functools
import hashlib
import hmac
import ipaddress
import itertools
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarm.sharding.errors import UserError

AUTH_METADATA = "swarm-auth"
KEY_ENV = "SWARM_KEY"
KEY_FILE_ENV = "SWARM_KEY_FILE"
KEY_BYTES = 32
KEY_PREFIX = "swarm-key-v1:"
# A call whose client clock differs from the node's by more than this is refused (and so is its replay later).
WINDOW_SECONDS = 60.0
# Calls of one session a node accepts out of order (calls run concurrently and may arrive in any order).
REPLAY_WINDOW = 1024
# Client sessions a node tracks at once; past that it refuses new sessions until old ones go quiet.
MAX_SESSIONS = 4096
# Below this many characters a key given by hand is weak enough to be guessed from a captured call.
WEAK_KEY_CHARS = 16
TLS_NAME = "swarm"  # the name in every swarm certificate; clients check it instead of a host name


def is_loopback_host(host: str) -> bool:
    """Whether a host name or address is this machine's loopback (where the wire needs no privacy):
    "localhost", 127.0.0.0/8 or ::1 (bracketed or not). Other names are not resolved: they count as off it."""
    h = host.strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def generate_key_text() -> str:
    return KEY_PREFIX + base64.urlsafe_b64encode(secrets.token_bytes(KEY_BYTES)).decode().rstrip("=")


def _derive(secret: bytes, label: str) -> bytes:
    return hmac.new(secret, label.encode(), hashlib.sha256).digest()


@dataclass(frozen=True)
class SwarmKey:
    """A swarm's secret. Built from the text a user keeps (a `swarm keygen` file, $SWARM_KEY)."""

    secret: bytes = field(repr=False)

    @classmethod
    def from_text(cls, text: str) -> SwarmKey:
        text = text.strip()
        if not text:
            raise UserError("the swarm key is empty; make one with `swarm keygen --out swarm.key`")
        return cls(hashlib.sha256(b"swarm key text\0" + text.encode()).digest())

    @classmethod
    def load(cls, path: str | Path) -> SwarmKey:
        p = Path(path)
        try:
            text = p.read_text()
        except FileNotFoundError:
            raise UserError(f"{p}: no such key file; make one with `swarm keygen --out {p}`") from None
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{p}: cannot read the swarm key ({e})") from None
        return cls.from_text(text)

    @property
    def id(self) -> str:
        """A short public name of this swarm (mDNS records carry it)."""
        return _derive(self.secret, "swarm key id v1").hex()[:16]

    @functools.cached_property
    def _auth_key(self) -> bytes:
        return _derive(self.secret, "swarm call auth v1")

    def tag(self, method: str, session: str, counter: int, ms: int, body_digest: bytes) -> str:
        msg = f"{method}\n{session}\n{counter}\n{ms}\n".encode() + body_digest
        return hmac.new(self._auth_key, msg, hashlib.sha256).hexdigest()

    @functools.cached_property
    def tls_identity(self) -> tuple[bytes, bytes]:
        """(private key PEM, certificate PEM): the same bytes wherever this key is held."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        order = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551  # P-256's group order
        scalar = int.from_bytes(_derive(self.secret, "swarm tls key v1"), "big") % (order - 1) + 1
        sk = ec.derive_private_key(scalar, ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{TLS_NAME} {self.id}")])
        utc = datetime.UTC
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(sk.public_key())
            .serial_number(int(self.id, 16) | 1)
            .not_valid_before(datetime.datetime(2020, 1, 1, tzinfo=utc))
            .not_valid_after(datetime.datetime(9999, 12, 31, tzinfo=utc))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(TLS_NAME)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(sk, hashes.SHA256(), ecdsa_deterministic=True)
        )
        key_pem = sk.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def key_from(key_file: str | Path | None, env: dict[str, str] | None = None) -> SwarmKey | None:
    """The swarm key a command runs with: --key-file, else $SWARM_KEY_FILE, else $SWARM_KEY; None for none."""
    env = os.environ if env is None else env
    if key_file:
        return SwarmKey.load(key_file)
    if env.get(KEY_FILE_ENV):
        return SwarmKey.load(env[KEY_FILE_ENV])
    if env.get(KEY_ENV):
        return SwarmKey.from_text(env[KEY_ENV])
    return None


def weak_key_warning(key_file: str | Path | None, env: dict[str, str] | None = None) -> str:
    """A warning for a hand-made key short enough to guess ("" when it is fine)."""
    env = os.environ if env is None else env
    try:
        text = Path(key_file).read_text() if key_file else env.get(KEY_ENV, "")
    except OSError:
        return ""
    text = text.strip()
    if text and not text.startswith(KEY_PREFIX) and len(text) < WEAK_KEY_CHARS:
        return (
            f"the swarm key is {len(text)} characters: a captured call lets anyone try guesses offline; "
            "use `swarm keygen`"
        )
    return ""


def body_digest(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()


class Signer:
    """The client side: one session, a counter, a tag per call."""

    def __init__(self, key: SwarmKey, clock: Callable[[], float] = time.time) -> None:
        self.key = key
        self.session = secrets.token_hex(8)
        self._counter = itertools.count(1)
        self._lock = threading.Lock()
        self._clock = clock

    def token(self, method: str, body: bytes) -> str:
        with self._lock:
            counter = next(self._counter)
        ms = int(self._clock() * 1000)
        tag = self.key.tag(method, self.session, counter, ms, body_digest(body))
        return f"v1.{self.session}.{counter}.{ms}.{tag}"


@dataclass
class _Session:
    top: int = 0  # the highest counter seen
    seen: int = 0  # bit i: counter top - i was seen
    last: float = 0.0


class Verifier:
    """The node side: whether a call's token is genuine and new. Holds only state for genuine sessions."""

    def __init__(self, key: SwarmKey, clock: Callable[[], float] = time.time) -> None:
        self.key = key
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()
        self._clock = clock

    def check(self, method: str, token: str | None, body: bytes) -> str:
        """ "" when the call may go ahead, else why it is refused (for an UNAUTHENTICATED status)."""
        if not token:
            return (
                "this node needs the swarm key: run the coordinator with the same key "
                f"(--key-file, ${KEY_FILE_ENV} or ${KEY_ENV})"
            )
        parts = token.split(".")
        if len(parts) != 5 or parts[0] != "v1" or len(parts[1]) != 16 or len(parts[4]) != 64:
            return "malformed swarm-auth token; use the same swarm version on both ends"
        _, session, counter_s, ms_s, tag = parts
        if not (counter_s.isdigit() and ms_s.isdigit() and len(counter_s) < 20 and len(ms_s) < 20):
            return "malformed swarm-auth token; use the same swarm version on both ends"
        counter, ms = int(counter_s), int(ms_s)
        expect = self.key.tag(method, session, counter, ms, body_digest(body))
        if not hmac.compare_digest(expect, tag):
            return "the call's tag does not verify: it was made with another swarm key, or altered on the way"
        now = self._clock()
        skew = now - ms / 1000
        if abs(skew) > WINDOW_SECONDS:
            return (
                f"the call is {skew:+.0f} s off this node's clock (more than {WINDOW_SECONDS:.0f} s): a replayed "
                "call, or a clock to set right (NTP) on the node or the coordinator"
            )
        with self._lock:
            return self._fresh(session, counter, now)

    def _fresh(self, session: str, counter: int, now: float) -> str:
        s = self._sessions.get(session)
        if s is None:
            if len(self._sessions) >= MAX_SESSIONS:
                quiet = now - 2 * WINDOW_SECONDS
                for name in [n for n, v in self._sessions.items() if v.last < quiet]:
                    del self._sessions[name]
                if len(self._sessions) >= MAX_SESSIONS:
                    return f"this node tracks {MAX_SESSIONS} client sessions already; try again in a minute"
            s = self._sessions[session] = _Session()
        if counter > s.top:
            shift = counter - s.top
            s.seen = ((s.seen << shift) | 1) & ((1 << REPLAY_WINDOW) - 1) if shift < REPLAY_WINDOW else 1
            s.top = counter
        else:
            back = s.top - counter
            if back >= REPLAY_WINDOW:
                return "replayed or very late call (older than the session's replay window); refused"
            if s.seen >> back & 1:
                return "replayed call (this session already made it); refused"
            s.seen |= 1 << back
        s.last = now
        return ""


def add_key_argument(g: Any) -> None:
    """--key-file: where a command finds the swarm key (never on the command line itself, where every
    process listing would show it)."""
    g.add_argument(
        "--key-file",
        default=None,
        metavar="FILE",
        help="the swarm key (`swarm keygen --out FILE` makes one; default: $SWARM_KEY_FILE, else the key "
        "text in $SWARM_KEY, else none: an open swarm, loopback only)",
    )


def swarm_key(args: argparse.Namespace, who: str) -> SwarmKey | None:
    """The SwarmKey the command runs with (or None), after a warning for a weak hand-made one."""
    key = key_from(args.key_file)
    warning = weak_key_warning(args.key_file)
    if warning:
        print(f"swarm {who}: warning: {warning}", file=sys.stderr)
    return key
