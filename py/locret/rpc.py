"""llama.cpp's RPC backend from Python: layers (and their KV caches, evicted in place) on other machines.

llama.cpp's tools take ``--rpc host:port,...``: each endpoint is an ``ggml-rpc-server`` whose devices are registered
before the model loads, and ``-ngl`` puts layers on them. llama-cpp-python 0.3.36 has no such argument, so
``locret.Llama(..., rpc_servers="host:port,...", n_gpu_layers=99)`` does the same through ``add_servers``.

``RpcServers`` starts local ``ggml-rpc-server`` processes on free ports and stops them whatever happens (the tests,
``scripts/bench_rpc.py``). An RPC server runs whatever graph it is sent and is not secure: bind it to 127.0.0.1 or a
private network only, as llama.cpp says.
"""
from __future__ import annotations

import contextlib
import ctypes
import socket
import subprocess
import time
from pathlib import Path
from typing import Sequence

from ._library import library_dir, tool_path
from .serve import free_port

SERVER_TOOL = "ggml-rpc-server"


class RpcError(RuntimeError):
    """An RPC server cannot be used or started; the message says why."""


_registered: dict[str, int] = {}  # endpoint -> devices registered (llama.cpp keeps them for the process)


def parse_endpoints(servers: str | Sequence[str]) -> list[str]:
    """"host:port,host:port" (or a list of them) as a list, each checked for its form."""
    items = servers.split(",") if isinstance(servers, str) else list(servers)
    out = []
    for item in (i.strip() for i in items):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RpcError(f"RPC server {item!r} is not host:port")
        out.append(item)
    if not out:
        raise RpcError("no RPC server given")
    return out


def reachable(endpoint: str, timeout: float = 2.0) -> bool:
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def add_servers(servers: str | Sequence[str]) -> list[str]:
    """Register the devices of each RPC server with ggml, as llama.cpp's ``--rpc`` does, so that the next model load
    can put layers on them (``n_gpu_layers``). Returns the endpoints. llama.cpp aborts the process when a server
    cannot be reached, so each is tried here first and refused with RpcError."""
    endpoints = parse_endpoints(servers)
    for endpoint in endpoints:
        if endpoint in _registered:
            continue
        if not reachable(endpoint):
            raise RpcError(f"RPC server {endpoint} cannot be reached (is {SERVER_TOOL} running there?)")
        rpc = ctypes.CDLL(str(library_dir() / "libggml-rpc.so"))
        ggml = ctypes.CDLL(str(library_dir() / "libggml.so"))
        rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
        rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
        ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
        ggml.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
        ggml.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
        reg = rpc.ggml_backend_rpc_add_server(endpoint.encode())
        if not reg:
            raise RpcError(f"RPC server {endpoint} has no devices")
        ggml.ggml_backend_register(reg)
        _registered[endpoint] = int(ggml.ggml_backend_reg_dev_count(reg))
    return endpoints


class RpcServers(contextlib.AbstractContextManager):
    """`n` local ggml-rpc-server processes on free ports of 127.0.0.1, each with `threads` CPU threads; `endpoints`
    is their "host:port" list. All are stopped on exit, whatever happened."""

    def __init__(self, n: int = 2, threads: int = 1, log_dir: Path | None = None, start_timeout: float = 30.0):
        self.n, self.threads, self.log_dir, self.start_timeout = n, threads, log_dir, start_timeout
        self.procs: list[subprocess.Popen] = []
        self.endpoints: list[str] = []
        self._logs: list = []

    @property
    def servers(self) -> str:
        return ",".join(self.endpoints)

    def __enter__(self) -> "RpcServers":
        tool = tool_path(SERVER_TOOL)
        if not tool.is_file():
            raise RpcError(f"{tool} is not built (scripts/setup.sh builds it when LOCRET_RPC is on)")
        try:
            for i in range(self.n):
                port = free_port()
                log = open(self.log_dir / f"rpc-server-{i}.log", "w") if self.log_dir else subprocess.DEVNULL
                self._logs.append(log)
                self.procs.append(subprocess.Popen([str(tool), "-H", "127.0.0.1", "-p", str(port),
                                                    "-t", str(self.threads)], stdout=log, stderr=log))
                self.endpoints.append(f"127.0.0.1:{port}")
            deadline = time.time() + self.start_timeout
            for proc, endpoint in zip(self.procs, self.endpoints):
                while not reachable(endpoint, timeout=0.5):
                    if proc.poll() is not None:
                        raise RpcError(f"{SERVER_TOOL} for {endpoint} exited with {proc.returncode}")
                    if time.time() > deadline:
                        raise RpcError(f"{SERVER_TOOL} for {endpoint} did not listen within {self.start_timeout} s")
                    time.sleep(0.1)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._logs:
            if log is not subprocess.DEVNULL:
                log.close()
        self._logs.clear()

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def __exit__(self, *exc) -> None:
        self.stop()
