"""Invites: what a node needs to dial out to a coordinator and join its swarm (`swarm node --join INVITE`).

A phone or a laptop behind NAT takes no incoming connection and may hear no multicast, so instead of being
found it dials out (swarm.node.join) and keeps one link to the coordinator, which sends its calls back over it.
An invite says where to dial and lets each end prove itself to the other without the swarm key in it:

- `addresses`: the coordinator's join listener, as "host:port", tried in turn.
- `model`: the first 16 hex digits of the model's fingerprint and of its source GGUF's header hash, so that a
  node started on another model is told so before it dials (either form of the model matches, as in mDNS).
- `pin`: SHA-256 of the swarm key's TLS certificate (swarm.node.auth). Only a holder of the key has its private
  key, so a coordinator whose TLS handshake shows that certificate holds the key; the certificate itself is
  public (any node shows it), which is why the pin can travel.
- `secret`: the join secret, HMAC-SHA256 of the key under its own label. A node shows it knows it by a
  challenge-response inside that TLS channel (swarm.node.link); it gives neither the key nor anything else
  derived from it (call tags, the TLS identity), so an invite lets a device join as a node and no more.
  Whoever holds an invite can join: share it as a password (a new swarm key makes old invites void).

The text is `swarm-invite-v1:` and the base64url of compact JSON with a 4-byte checksum in front, so that an
invite copied in part is told apart from another swarm's.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import json
from dataclasses import dataclass

from swarm.node.auth import SwarmKey
from swarm.sharding.errors import UserError
from swarm.sharding.identity import ModelIdentity

INVITE_PREFIX = "swarm-invite-v1:"
JOIN_PORT = 7470  # the coordinator's join listener when none is named
MODEL_DIGITS = 16
_CHECK_BYTES = 4


def join_secret(key: SwarmKey) -> bytes:
    return hmac.new(key.secret, b"swarm join secret v1", hashlib.sha256).digest()


def cert_pin(key: SwarmKey) -> str:
    """SHA-256 (hex) of the DER form of the key's TLS certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate(key.tls_identity[1])
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


@dataclass(frozen=True)
class Invite:
    addresses: tuple[str, ...]
    fingerprint: str  # the model's, first MODEL_DIGITS hex digits
    source_sha256: str  # its source GGUF's header hash, first MODEL_DIGITS hex digits ("" when not known)
    pin: str
    secret: bytes

    def matches(self, identity: ModelIdentity) -> bool:
        """Whether a node holding `identity` serves the invite's model (its shard directory or its GGUF)."""
        if identity.fingerprint.startswith(self.fingerprint):
            return True
        return bool(self.source_sha256) and identity.source_sha256.startswith(self.source_sha256)

    def text(self) -> str:
        body = json.dumps(
            {
                "a": list(self.addresses),
                "f": self.fingerprint,
                "s": self.source_sha256,
                "p": base64.urlsafe_b64encode(bytes.fromhex(self.pin)).decode().rstrip("="),
                "k": base64.urlsafe_b64encode(self.secret).decode().rstrip("="),
            },
            separators=(",", ":"),
        ).encode()
        check = hashlib.sha256(body).digest()[:_CHECK_BYTES]
        return INVITE_PREFIX + base64.urlsafe_b64encode(check + body).decode().rstrip("=")


def make_invite(key: SwarmKey, identity: ModelIdentity, addresses: list[str]) -> Invite:
    if not addresses:
        raise UserError("an invite needs at least one address where nodes reach the coordinator")
    return Invite(
        tuple(addresses),
        identity.fingerprint[:MODEL_DIGITS],
        identity.source_sha256[:MODEL_DIGITS],
        cert_pin(key),
        join_secret(key),
    )


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def parse_invite(text: str) -> Invite:
    """The invite in `text`; a UserError that says what is wrong with it otherwise."""
    text = "".join(text.split())
    if not text.startswith(INVITE_PREFIX):
        raise UserError(
            f"not a swarm invite (it starts {text[:16]!r}, an invite starts {INVITE_PREFIX!r}); print one with "
            "`swarm invite MODEL` on the coordinator's machine, or give --join HOST:PORT with --key-file"
        )
    broken = UserError(
        "the invite is incomplete or altered (copied only in part?); copy it whole again, or scan its QR code"
    )
    try:
        raw = _unb64(text[len(INVITE_PREFIX) :])
    except (binascii.Error, ValueError):
        raise broken from None
    check, body = raw[:_CHECK_BYTES], raw[_CHECK_BYTES:]
    if len(check) < _CHECK_BYTES or hashlib.sha256(body).digest()[:_CHECK_BYTES] != check:
        raise broken
    try:
        d = json.loads(body)
        addresses = tuple(str(a) for a in d["a"])
        invite = Invite(addresses, str(d["f"]), str(d["s"]), _unb64(d["p"]).hex(), _unb64(d["k"]))
    except (ValueError, KeyError, TypeError, binascii.Error):
        raise broken from None
    if not addresses or len(invite.secret) != 32 or len(invite.pin) != 64:
        raise broken
    return invite


def local_addresses() -> list[str]:
    """This machine's interface addresses that another device could reach (IPv4, not loopback)."""
    import ifaddr  # a zeroconf dependency

    found = [
        ip.ip
        for adapter in ifaddr.get_adapters()
        for ip in adapter.ips
        if isinstance(ip.ip, str) and not ipaddress.ip_address(ip.ip).is_loopback
    ]
    return found or ["127.0.0.1"]


def listen_addresses(listen: str) -> list[str]:
    """Where nodes reach a join listener on `listen` ("host:port"): every interface's address with that port
    when it listens on all of them (0.0.0.0 or ::), else that address."""
    host, _, port = listen.rpartition(":")
    if host.strip("[]") in ("", "0.0.0.0", "::"):
        return [f"{a}:{port}" for a in local_addresses()]
    return [listen]


def qr_svg(text: str) -> str | None:
    """The QR code of `text` as an SVG document (None without the qrcode package)."""
    try:
        import qrcode
        import qrcode.image.svg
    except ImportError:
        return None
    qr = qrcode.QRCode(border=2, error_correction=qrcode.constants.ERROR_CORRECT_L,
                       image_factory=qrcode.image.svg.SvgPathFillImage)  # fmt: skip
    qr.add_data(text)
    qr.make(fit=True)
    return qr.make_image().to_string(encoding="unicode")
