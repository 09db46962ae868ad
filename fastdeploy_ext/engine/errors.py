"""Engine exceptions, importable without Paddle."""

from __future__ import annotations


class RankFailure(RuntimeError):
    """A tensor-parallel rank process died or failed; the engine cannot continue."""


class RequestError(ValueError):
    """A request the engine will not run. ``field`` names the request field at fault (the server's ``param``),
    ``status`` is the HTTP status the server answers with (400; 429 when the same request may succeed later) and
    ``kind`` the OpenAI error type. It is a ``ValueError``, so callers of ``LLM`` catch it as one."""

    def __init__(self, message: str, field: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.field, self.status, self.kind = message, field, status, kind

    @staticmethod
    def of(error: Exception, field: str | None, message: str | None = None, status: int = 400,
           kind: str = "invalid_request_error") -> "RequestError":
        """``error`` as a request error (``message`` defaults to its text); a ``TypeError`` stays one."""
        cls = RequestTypeError if isinstance(error, TypeError) else RequestError
        return cls(str(error) if message is None else message, field, status, kind)

    def within(self, where: str) -> "RequestError":
        """The same error, its message prefixed with ``where`` (which input of a batch: ``prompts[3]``)."""
        return type(self)(f"{where}: {self.message}", self.field, self.status, self.kind)


class RequestTypeError(RequestError, TypeError):
    """A request error about a value of the wrong type; catchable as ``TypeError`` too."""
