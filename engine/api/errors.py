"""A request an API refuses: its HTTP status, a message and the field at fault. Each API module renders it
in its own error shape."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
