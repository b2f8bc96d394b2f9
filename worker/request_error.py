"""The error a request is refused with, and the OpenAI-style error body it becomes.

Its own module so that every request parser (protocol, sampling_fields, chat_messages) and
the HTTP layer can import it without importing each other.
"""
from __future__ import annotations


class RequestError(Exception):
    """A request the server refuses; becomes an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """An OpenAI-style error body: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
