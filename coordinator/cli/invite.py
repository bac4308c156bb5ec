"""`swarm invite`: what a node needs to join this coordinator from where it is (`swarm node --join`), as
text and as a QR code to scan with a phone (swarm.node.invite says what an invite holds)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from swarm.node.auth import add_key_argument, swarm_key
from swarm.node.invite import JOIN_PORT, local_addresses, make_invite
from swarm.sharding.errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "invite",
        help="print an invite for nodes to join this coordinator (`swarm node --join INVITE`)",
        description="Print an invite (text and a terminal QR code) with which a node dials out to this "
        "coordinator and joins its swarm from behind NAT or where multicast does not reach. Run the "
        "coordinator with --listen on the same port and --key-file. The invite proves the swarm key without "
        "holding it; whoever has it can join as a node: share it as a password.",
    )
    p.add_argument("model", help="the model the coordinator runs: a .gguf or a `swarm shard` directory")
    p.add_argument(
        "--address",
        action="append",
        default=None,
        metavar="HOST:PORT",
        help="where nodes reach the coordinator's --listen port (repeatable: tried in order); default: every "
        "address of this machine's interfaces, with --port (name a port forward's public address or a "
        "WireGuard/Tailscale address here)",
    )
    p.add_argument("--port", type=int, default=JOIN_PORT, help=f"the --listen port (default {JOIN_PORT})")
    p.add_argument("--no-qr", action="store_true", help="the text only, no QR code")
    add_key_argument(p)
    p.set_defaults(func=run_invite)


def print_qr(text: str, out: Any) -> bool:
    """The QR code of `text` in half-block characters (two rows a line); False without the qrcode package."""
    try:
        import qrcode
    except ImportError:
        return False
    qr = qrcode.QRCode(border=2, error_correction=qrcode.constants.ERROR_CORRECT_L)
    qr.add_data(text)
    qr.make(fit=True)
    qr.print_ascii(out=out, invert=True)
    return True


def run_invite(args: argparse.Namespace) -> int:
    from swarm.sharding.identity import identity_of

    key = swarm_key(args, "invite")
    if key is None:
        raise UserError(
            "an invite proves the swarm key: give --key-file (`swarm keygen --out swarm.key` makes one), the "
            "same the coordinator runs with"
        )
    addresses = args.address or [f"{a}:{args.port}" for a in local_addresses()]
    for a in addresses:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise UserError(f"--address {a!r}: give HOST:PORT")
    invite = make_invite(key, identity_of(args.model), addresses)
    text = invite.text()
    if not args.no_qr and not print_qr(text, sys.stdout):
        print("(install the qrcode package for a QR code)", file=sys.stderr)
    print(text)
    print(
        f"swarm invite: nodes dial {', '.join(addresses)}; run the coordinator with --listen 0.0.0.0:PORT "
        "and this --key-file, and on each device: swarm node MODEL --join INVITE",
        file=sys.stderr,
    )
    return 0
