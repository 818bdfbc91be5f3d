"""Serve an ASGI app in this process on a Unix domain socket, for in-process clients.

A client in the same process (the coding agent) gets real HTTP semantics -- streaming, and
a closed connection aborting its engine request -- without opening a TCP port other users
of the machine could reach. uvicorn runs on a background thread; it installs signal
handlers only on the main thread, so Ctrl+C still reaches the program that started it.
httpx (a runtime dependency for this) is the client: its transports speak HTTP over a
Unix socket, which the standard library's clients do not.
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Self

import httpx
import uvicorn

SOCKET_NAME = "lodestar.sock"
GRACEFUL_SHUTDOWN_S = 2.0
# AF_UNIX paths hold at most 108 bytes on Linux (104 on macOS), the terminating NUL included.
MAX_SOCKET_PATH_BYTES = 103

def _remove_socket(path: Path, own_dir: bool) -> None:
    path.unlink(missing_ok=True)
    if own_dir:
        shutil.rmtree(path.parent, ignore_errors=True)


class _StartupErrors(logging.Handler):
    """The error lines uvicorn logs from one server thread: the cause of a failed start."""

    def __init__(self, thread_name: str) -> None:
        super().__init__(logging.ERROR)
        self.thread_name = thread_name
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.threadName == self.thread_name:
            text = record.getMessage().strip()
            if record.exc_info and record.exc_info[1] is not None:
                text = f"{text} {type(record.exc_info[1]).__name__}: {record.exc_info[1]}".strip()
            if text:
                self.lines.append(text.splitlines()[-1])   # a traceback's last line names the error


class LocalServer:
    """``app`` served over HTTP on ``socket_path`` from a background thread.

    ``socket_dir`` defaults to a fresh private directory (``tempfile.mkdtemp``, mode 0700),
    removed again by ``stop``; the socket itself is open to its owner only (mode 0600).
    """

    base_url: str = "http://lodestar.local"   # any host works over the socket; this one names it in logs

    def __init__(self, app, socket_dir: str | Path | None = None) -> None:
        self.app = app
        self._own_dir = socket_dir is None
        directory = Path(tempfile.mkdtemp(prefix="lodestar-")) if socket_dir is None else Path(socket_dir)
        # A unique name, so two servers given the same directory do not take each other's socket.
        name = SOCKET_NAME if self._own_dir else f"lodestar-{uuid.uuid4().hex[:12]}.sock"
        self.socket_path: Path = directory / name
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._failure: BaseException | None = None
        self._stopped = False
        # Also at interpreter exit, for a program that never called stop(): no socket left behind in /tmp.
        self._remove = weakref.finalize(self, _remove_socket, self.socket_path, self._own_dir)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> Self:
        """Start serving; returns once connections are accepted. Raises RuntimeError saying why it could not."""
        if self._stopped:
            raise RuntimeError("This LocalServer was stopped; create a new one to serve again.")
        if self._thread is not None:
            raise RuntimeError(f"This LocalServer is already serving on {self.socket_path}.")
        name = f"lodestar-local-server-{uuid.uuid4().hex[:8]}"   # tells its log lines apart
        errors = _StartupErrors(name)
        uvicorn_log = logging.getLogger("uvicorn.error")
        uvicorn_log.addHandler(errors)
        try:
            self._sock = self._listen()
            # log_config=None: leave the host program's logging setup alone.
            config = uvicorn.Config(self.app, log_config=None, access_log=False,
                                    timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
            self._server = uvicorn.Server(config)
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()
            deadline = time.monotonic() + timeout
            while not self._server.started:
                if not self._thread.is_alive():
                    self._thread.join()
                    raise RuntimeError(f"The local server on {self.socket_path} stopped while starting: "
                                       f"{self._cause(errors.lines)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"The local server on {self.socket_path} did not start within {timeout:g} s; "
                                       "pass a longer timeout to start() if the app's startup is slow.")
                time.sleep(0.005)
        except BaseException:
            self.stop()
            raise
        finally:
            uvicorn_log.removeHandler(errors)
        return self

    def stop(self) -> None:
        """Stop serving: running requests get ~2 s to finish, then are cancelled. Removes the socket
        (and the directory when it was made here). Safe to call more than once."""
        if self._stopped:
            return
        self._stopped = True
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(GRACEFUL_SHUTDOWN_S + 8)
            if self._thread.is_alive():             # a request ignored cancellation: stop waiting for it
                self._server.force_exit = True
                self._thread.join(5)
        if self._sock is not None:
            self._sock.close()
        self._remove()

    def __enter__(self) -> Self:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- clients ---------------------------------------------------------------------------
    def client_transport(self) -> httpx.AsyncHTTPTransport:
        """An httpx transport to this server; use it with ``base_url``."""
        return httpx.AsyncHTTPTransport(uds=str(self.socket_path))

    # -- internals -------------------------------------------------------------------------
    def _listen(self) -> socket.socket:
        """Bind the socket here, so a bad path is an error in the caller's thread rather than a log line."""
        path = str(self.socket_path)
        if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
            raise RuntimeError(f"The socket path {path} is {len(os.fsencode(path))} bytes; Unix sockets allow at "
                               f"most {MAX_SOCKET_PATH_BYTES}. Pass a socket_dir with a shorter path.")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            os.chmod(path, 0o600)       # before listen(): no other user ever connects to the API
            sock.listen(128)
        except OSError as e:
            sock.close()
            raise RuntimeError(f"Cannot listen on the Unix socket {path}: {e}. Check that its directory exists "
                               "and is writable, and that no other server uses that path.") from e
        return sock

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as e:   # uvicorn exits (SystemExit) when the app's startup fails
            self._failure = e

    def _cause(self, lines: list[str]) -> str:
        failure = self._failure
        if failure is not None and not isinstance(failure, SystemExit):
            lines = [*lines, f"{type(failure).__name__}: {failure}"]
        return "; ".join(lines) or "uvicorn gave no reason (see its log)"
