"""`swarm serve`'s pages: a chat at `/` and a live map of the swarm at `/swarm`, with the map's data as JSON
at `/swarm.json` (the structure `swarm status --json` prints, plus what the server knows of its requests).

Every asset comes from coordinator/serve/static/ through this server: the pages work without network
access, and nothing is built. The pages run no inline script (the Content-Security-Policy forbids it), and
the chat's Markdown renderer escapes the model's text before it adds any markup of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from swarm.coordinator.serve.api_error import ApiError
from swarm.coordinator.serve.watch import SwarmWatch

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
    def __init__(self, watch: SwarmWatch, check_key: Callable[[Request], None]) -> None:
        self.watch, self.check_key = watch, check_key
        # read once at start: a handful of small files, and a request can then never name another path
        self.files = {p.name: (p.read_bytes(), TYPES[p.suffix]) for p in sorted(STATIC.iterdir())
                      if p.is_file() and p.suffix in TYPES}  # fmt: skip

    def routes(self) -> list[Route]:
        return [
            Route("/", self.chat, methods=["GET"]),
            Route("/swarm", self.swarm, methods=["GET"]),
            Route("/swarm.json", self.swarm_json, methods=["GET"]),
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


def page_routes(watch: SwarmWatch, check_key: Callable[[Request], None]) -> list[Route]:
    return Pages(watch, check_key).routes()
