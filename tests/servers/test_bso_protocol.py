"""uvicorn's HTTP protocols as `joules serve` uses them: Nagle's algorithm off on every connection."""

from __future__ import annotations

import importlib.util
import socket
from typing import Any

import pytest

pytest.importorskip("uvicorn")

from joules.servers.batch_size import protocol  # noqa: E402


class _Transport:
    def __init__(self, sock: socket.socket | None) -> None:
        self.sock = sock

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.sock if name == "socket" else default


def test_no_delay_is_set_on_a_socket_rebuilt_with_protocol_zero() -> None:
    # What uvicorn's worker processes get: a TCP socket whose protocol number says 0.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM, 0) as sock:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
        protocol._no_delay(_Transport(sock))  # type: ignore[arg-type]
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


class _RecordingSocket:
    def __init__(self, family: socket.AddressFamily) -> None:
        self.family = family
        self.options: list[tuple[int, int, int]] = []

    def setsockopt(self, level: int, name: int, value: int) -> None:
        self.options.append((level, name, value))


def test_no_delay_leaves_other_sockets_alone() -> None:
    protocol._no_delay(_Transport(None))  # type: ignore[arg-type]  # no socket: nothing to do
    unix = _RecordingSocket(socket.AF_UNIX)
    protocol._no_delay(_Transport(unix))  # type: ignore[arg-type]
    assert unix.options == []  # not TCP: untouched
    tcp6 = _RecordingSocket(socket.AF_INET6)
    protocol._no_delay(_Transport(tcp6))  # type: ignore[arg-type]
    assert tcp6.options == [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]


def test_the_fast_parser_is_used_when_installed() -> None:
    module, name = protocol.HTTP_PROTOCOL.split(":")
    cls = getattr(importlib.import_module(module), name)
    if importlib.util.find_spec("httptools") is not None:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base  # type: ignore[assignment]
    assert issubclass(cls, Base) and cls.__name__ == f"NoDelay{Base.__name__}"
