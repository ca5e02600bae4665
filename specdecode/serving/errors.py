"""Errors in OpenAI's shape (``{"error": {message, type, param, code}}``) and the app's
handlers that turn every failure, FastAPI's and Starlette's included, into one."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered as ``{"error": {message, type, param, code}}`` (OpenAI's shape)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        return JSONResponse(self.body(), status_code=self.status, headers={**headers, **self.headers})


CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, but /metrics counts it


def client_gone() -> APIError:
    return APIError(CLIENT_CLOSED, "the client closed the request", code="client_closed_request")


def shutting_down(message: str = "the server is shutting down") -> APIError:
    # Retry-After: a restarted or other replica may take it (clients such as openai's honour it)
    return APIError(503, message, type="server_error", code="shutting_down", headers={"Retry-After": "5"})


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        # FastAPI answers 422; OpenAI clients expect 400 in their error shape.
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in err["loc"][1:]) or None
        return APIError(400, f"invalid '{param}': {err['msg']}", param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):  # unknown routes and methods
        response = APIError(e.status_code, f"{e.detail} ({request.method} {request.url.path})").response()
        response.headers.update(e.headers or {})  # e.g. Allow on a 405
        return response

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, "internal server error; see the server log", type="server_error").response()
