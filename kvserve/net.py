"""Network checks shared by the HTTP front ends (``kvserve serve``, ``kvserve router``):
whether a port can be listened on, asked before start-up so a taken port is one line."""

from __future__ import annotations

import errno
import socket


def check_port_free(host: str, port: int) -> None:
    """An ``OSError`` in one line when ``host:port`` cannot be listened on
    (uvicorn would log its own error after start-up and exit with status 3).
    Port 0 (any free port) always can."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio binds
        try:
            sock.bind((host, port))
        except OSError as exc:
            advice = {errno.EADDRINUSE: "another process is using the port; choose another "
                                        "--port",
                      errno.EACCES: "ports below 1024 need privileges; choose another --port"
                      }.get(exc.errno or 0, "check --host")
            raise OSError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): {advice}"
                          ) from exc
