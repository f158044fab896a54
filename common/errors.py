"""Exception types the services map to gRPC status codes at their one error boundary."""


class SpecdecError(Exception):
    """Base class of the errors a request can cause."""


class InvalidRequest(SpecdecError, ValueError):
    """The request itself is malformed (maps to INVALID_ARGUMENT)."""


class UnknownSequence(SpecdecError, KeyError):
    """A sequence id that the service does not hold (maps to NOT_FOUND)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown sequence"


class CapacityExhausted(SpecdecError):
    """No free KV slot or context left (maps to RESOURCE_EXHAUSTED)."""


class PeerUnavailable(SpecdecError):
    """A downstream service could not be reached (maps to UNAVAILABLE)."""
