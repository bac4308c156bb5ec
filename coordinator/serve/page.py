"""`swarm serve`'s pages: a chat at `/` and a live map of the swarm at `/swarm`, with the map's data as JSON
at `/swarm.json` (the structure `swarm status --json` prints, plus what the server knows of its requests).

Every asset comes from coordinator/serve/static/ through this server: the pages work without network
access, and nothing is built. The pages run no inline script (the Content-Security-Policy forbids it), and
the chat's Markdown renderer escapes the model's text before it adds any markup of its own.
"""

from __future__ import annotations

import base64
import ipaddress
from collections.abc import Callable
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from swarm.coordinator.serve.api_error import ApiError
from swarm.coordinator.serve.watch import SwarmWatch
from swarm.node.invite import qr_svg

STATIC = Path(__file__).parent / "static"
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a new version of the server serves its new pages at once
}


class Pages:
    def __init__(
        self, watch: SwarmWatch, check_key: Callable[[Request], None], invite: str | None = None,
        keyed: bool = False,
    ) -> None:  # fmt: skip
        """`invite`: what nodes join this coordinator with (--listen), shown on the map; `keyed`: the server
        has an API key (`check_key` asks for it)."""
        self.watch, self.check_key, self.invite, self.keyed = watch, check_key, invite, keyed
        # read once at start: a handful of small files, and a request can then never name another path
        self.files = {p.name: (p.read_bytes(), TYPES[p.suffix]) for p in sorted(STATIC.iterdir())
                      if p.is_file() and p.suffix in TYPES}  # fmt: skip

    def routes(self) -> list[Route]:
        return [
            Route("/", self.chat, methods=["GET"]),
            Route("/swarm", self.swarm, methods=["GET"]),
            Route("/swarm.json", self.swarm_json, methods=["GET"]),
            Route("/swarm/invite", self.swarm_invite, methods=["GET"]),
            Route("/static/{name}", self.static, methods=["GET"]),
        ]

    def _file(self, name: str) -> Response:
        found = self.files.get(name)
        if found is None:
            return ApiError(404, f"no file /static/{name}").response()
        body, ctype = found
        return Response(body, media_type=ctype, headers=HEADERS)

    async def chat(self, request: Request) -> Response:
        return self._file("chat.html")

    async def swarm(self, request: Request) -> Response:
        return self._file("swarm.html")

    async def static(self, request: Request) -> Response:
        return self._file(request.path_params["name"])

    async def swarm_json(self, request: Request) -> Response:
        """The swarm's map for the page and for scripts; behind the API key like the API (it names the
        nodes' addresses)."""
        try:
            self.check_key(request)
        except ApiError as e:
            return e.response()
        return JSONResponse(self.watch.snapshot(), headers={"Cache-Control": "no-store"})


    async def swarm_invite(self, request: Request) -> Response:
        """The invite nodes join with (`swarm invite`'s text and its QR code as an SVG data URL) for the map. An
        invite lets its holder join as a node and fetch the expert slabs: behind the API key where the server
        has one, else shown to this machine's own browser only."""
        try:
            if self.invite is None:
                raise ApiError(
                    404, "this server takes no joining nodes: start it with --listen HOST:PORT and --key-file "
                    "(`swarm invite` prints the same invite)",
                )  # fmt: skip
            if self.keyed:
                self.check_key(request)
            elif not _loopback(request):
                raise ApiError(
                    403, "the invite is shown on the coordinator's own machine only (this server has no "
                    "--api-key): open the map there, or start the server with --api-key",
                    "permission_error",
                )  # fmt: skip
        except ApiError as e:
            return e.response()
        svg = qr_svg(self.invite)
        qr = "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode() if svg is not None else None
        return JSONResponse({"invite": self.invite, "qr": qr}, headers={"Cache-Control": "no-store"})


def _loopback(request: Request) -> bool:
    host = request.client.host if request.client is not None else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def page_routes(
    watch: SwarmWatch, check_key: Callable[[Request], None], invite: str | None = None, keyed: bool = False
) -> list[Route]:
    return Pages(watch, check_key, invite, keyed).routes()
