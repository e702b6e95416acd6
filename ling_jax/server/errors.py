"""OpenAI's error JSON for every refusal: `{"error": {"message", "type", "param", "code"}}`.

Why one place: every 4xx the server gives (validation, auth, unknown route or model, full queue,
oversize body) goes through these handlers, so a client always gets the same shape, a message
naming the field, and never a traceback; an unexpected exception becomes a 500 with a generic
message (its traceback goes to the server log only).
"""
from __future__ import annotations

import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ling_jax.server.protocol import ErrorBody, ErrorResponse

log = logging.getLogger("ling_jax.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """A refusal with its HTTP status; `param` names the request field at fault."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    err = ErrorBody(message=message, type=_TYPES.get(status, "server_error" if status >= 500 else
                                                     "invalid_request_error"), param=param, code=code)
    return ErrorResponse(error=err).model_dump()


def error_response(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                   headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _loc_text(loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_UNION_FIELDS = {"prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
                 "stop": "a string or a list of strings"}


_MISMATCH = ("_type", "missing", "union_tag_invalid", "union_tag_not_found")


def _is_tag(part) -> bool:
    """A pydantic union member's label in an error location (`list[constrained-int]`, `str`,
    `TextPart`), which is not a field of the request."""
    return isinstance(part, str) and ("[" in part or "-" in part or part[:1].isupper()
                                      or part in ("str", "int", "float", "bool"))


def validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    """(message, param) for the first validation error: param is the top-level field. Of a union
    field's errors (one per member) the first that is not a mere type mismatch is reported: a
    string prompt with a lone surrogate says so, not "expected a string or ..."."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    e = errors[0]
    loc = [p for p in e.get("loc", ()) if p != "body"]
    if e.get("type") == "json_invalid":
        return f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    if not loc or isinstance(loc[0], int):
        return f"request body: {e.get('msg')} (expected a JSON object)", None
    field = str(loc[0])
    if e.get("type") == "extra_forbidden":
        return f"unrecognized request argument supplied: {_loc_text(loc)}", field
    if e.get("type") == "missing":
        return f"missing required field: {_loc_text(loc)}", field
    same = [x for x in errors if [p for p in x.get("loc", ()) if p != "body"][:1] == [loc[0]]]
    specific = [x for x in same if not str(x.get("type", "")).endswith(_MISMATCH)]
    if any(_is_tag(p) for p in loc[1:]):  # a union: its most specific member error, if any
        if not specific:
            if field in _UNION_FIELDS:
                return f"{field}: expected {_UNION_FIELDS[field]}", field
        else:
            e = specific[0]
    loc = [p for p in e.get("loc", ()) if p != "body" and not _is_tag(p)]
    msg = str(e.get("msg", "")).removeprefix("Value error, ")
    got = e.get("input")
    got_text = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    if len(got_text) > 60:
        got_text = got_text[:57] + "..."
    def strip(x):
        return tuple(p for p in x.get("loc", ()) if p != "body" and not _is_tag(p))
    real = {strip(x) for x in errors
            if not (any(_is_tag(p) for p in x.get("loc", ())) and str(x.get("type", "")).endswith(_MISMATCH))}
    others = len(real - {tuple(loc)})
    more = f" (and {others} more error(s))" if others > 0 else ""
    return f"{_loc_text(loc)}: {msg}, got {got_text}{more}", field


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else exc.headers
        return error_response(exc.status, exc.message, exc.param, exc.code, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return error_response(404, f"no route {request.method} {request.url.path}", code="not_found")
        if exc.status_code == 413:
            return error_response(413, "request body too large", code="request_too_large",
                                  headers={"Connection": "close"})
        if exc.status_code == 408:
            return error_response(408, str(exc.detail), code="request_timeout", headers={"Connection": "close"})
        if exc.status_code == 405:
            return error_response(405, f"method {request.method} is not allowed on {request.url.path}",
                                  headers=getattr(exc, "headers", None))
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error answering %s %s", request.method, request.url.path)
        # uvicorn closes the connection after an unhandled exception: say so, so a client's pool
        # does not send its next request down a dead keep-alive connection
        return error_response(500, "internal server error", code="internal_error", headers={"Connection": "close"})
