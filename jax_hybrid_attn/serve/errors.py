"""OpenAI-style errors: `APIError` raised by the server's code, its JSON body, and pydantic's validation errors
turned into one.

The body is ``{"error": {"message", "type", "param", "code"}}``, as OpenAI's API sends it; `param` names the
request field at fault (dotted for nested ones, e.g. ``messages.0.content``).
"""

import http

__all__ = ["APIError", "error_body", "validation_error"]

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable_error"


class APIError(Exception):
    """An error the client gets as OpenAI's error JSON with HTTP status `status`."""

    def __init__(
        self,
        message: str,
        *,
        status: int = http.HTTPStatus.BAD_REQUEST,
        param: str | None = None,
        code: str | None = None,
        type: str = INVALID_REQUEST,
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, int(status), param, code, type

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error(errors: list[dict]) -> APIError:
    """A 400 from pydantic's ``ValidationError.errors()``: the first error, its field named in `param` and at the
    start of the message."""
    first = errors[0]
    field = ".".join(str(part) for part in first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return APIError(f"the request body is not valid JSON: {first.get('msg')}", code="invalid_json")
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    if "input" in first and first.get("type") != "missing":
        message += f" (got {_short(first['input'])})"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return APIError(f"{field or 'body'}: {message}{more}", param=field or None, code="invalid_value")


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
