"""A request body as Envoy streams it in (FULL_DUPLEX_STREAMED): bounded as the bytes arrive,
by the body limit (413) and the process's in-flight byte budget (503), and joined once."""

from __future__ import annotations

from ext_proc.byte_budget import StreamBytes
from ext_proc.errors import GatewayError


def too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"request body exceeds {limit} bytes", code="request_too_large")


class RequestBody:
    def __init__(self, limit: int, held: StreamBytes) -> None:
        self._limit = limit
        self._held = held
        self._pieces: list[bytes] = []  # as they came: no re-allocation while the body grows
        self._size = 0

    def add(self, piece: bytes) -> GatewayError | None:
        """Keep a piece, or say why the request must be answered now (the rest unread)."""
        self._size += len(piece)
        if self._size > self._limit:
            return too_large(self._limit)
        if not self._held.take(len(piece)):
            return GatewayError(503, "the gateway is out of request buffer space", code="overloaded")
        self._pieces.append(piece)
        return None

    def take(self) -> bytes:
        """The whole body, once; what it held is let go (it is parsed once, then not kept)."""
        raw = b"".join(self._pieces)
        self.drop()
        return raw

    def drop(self) -> None:
        self._pieces = []
        self._held.release()
