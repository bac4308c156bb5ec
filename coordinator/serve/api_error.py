"""An OpenAI-shaped error: what every part of the API answers a bad request with."""

from __future__ import annotations

from starlette.responses import JSONResponse


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
        code: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)
