"""uvicorn's HTTP protocols, with ``TCP_NODELAY`` set on every connection.

uvicorn's worker processes (``--workers N``) get the listening socket from the parent, rebuilt
from its file descriptor with protocol number 0, and asyncio only turns Nagle's algorithm off
on sockets whose protocol is ``IPPROTO_TCP``. Responses that go out in two writes (headers,
then body) then wait for the client's delayed ACK: about 40 ms per request. Setting the
option here makes every worker answer as fast as a single process.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


def _no_delay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class NoDelayH11Protocol(H11Protocol):
    """:class:`H11Protocol` that sets ``TCP_NODELAY`` on its connection."""

    def connection_made(self, transport: Any) -> None:
        _no_delay(transport)
        super().connection_made(transport)


HTTP_PROTOCOL = "joules.servers.batch_size.protocol:NoDelayH11Protocol"
"""The import string to pass as uvicorn's ``http`` (the httptools one when that is installed)."""

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is not installed: uvicorn would use h11 too
    pass
else:

    class NoDelayHttpToolsProtocol(HttpToolsProtocol):
        """:class:`HttpToolsProtocol` that sets ``TCP_NODELAY`` on its connection."""

        def connection_made(self, transport: Any) -> None:
            _no_delay(transport)
            super().connection_made(transport)

    HTTP_PROTOCOL = "joules.servers.batch_size.protocol:NoDelayHttpToolsProtocol"
