"""free_port(): a port handed once is never handed again by the same process (the kernel may give a just-released
port to the next bind, and callers take several ports before starting any server: the cause of a CI failure, an
HTTP server and an RPC server both given port 56865)."""
from __future__ import annotations

import socket

import pytest

from locret import serve


class _Socket:
    """A socket whose bind(0) yields the ports of `ports` in turn, as a kernel reusing a released port would."""

    ports: list[int] = []

    def __init__(self, *a, **kw):
        self.port = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def bind(self, addr):
        self.port = _Socket.ports.pop(0)

    def getsockname(self):
        return ("127.0.0.1", self.port)


def test_a_port_given_once_is_not_given_again(monkeypatch):
    monkeypatch.setattr(serve, "_PORTS_GIVEN", set())
    monkeypatch.setattr(socket, "socket", _Socket)
    _Socket.ports = [41000, 41000, 41000, 41001, 41000, 41002]
    assert [serve.free_port(), serve.free_port(), serve.free_port()] == [41000, 41001, 41002]
    assert _Socket.ports == []


def test_a_kernel_that_only_repeats_a_port_given_is_refused_not_a_hang(monkeypatch):
    monkeypatch.setattr(serve, "_PORTS_GIVEN", {41000})
    monkeypatch.setattr(socket, "socket", _Socket)
    _Socket.ports = [41000] * 1000
    with pytest.raises(RuntimeError, match="no loopback port this process has not handed out already"):
        serve.free_port()


def test_real_ports_are_distinct_and_bindable():
    ports = [serve.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
