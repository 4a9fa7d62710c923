"""Reward servers for tests (loopback only): a reward served from a thread of the test process, a
stub that answers whatever a test wants, and a `flowrl serve-reward` child process.

    from helpers_reward_server import served
    with served("digits") as url:                      # or served(my_reward_object)
        remote = flowrl.rewards.build("remote", url=url)

A contract battery over every registered reward builds ``remote`` with ``remote_kwargs(url)`` inside
``served("digits")``.
"""
from __future__ import annotations

import contextlib
import socket
from typing import Callable, Iterator, Optional

from flowrl.rewards.server import ServeOptions, load_reward, serve_in_thread
from flowrl.rewards.server_process import spawn  # noqa: F401 (for the tests that import it from here)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(reward="digits", options: Optional[dict] = None, **serve_options) -> Iterator[str]:
    """Serve a registered reward (by name, with ``options``) or a reward object from a thread; yields the URL."""
    obj = load_reward(reward, options) if isinstance(reward, str) else reward
    label = reward if isinstance(reward, str) else getattr(reward, "name", type(reward).__name__)
    with serve_in_thread(obj, label, ServeOptions(**serve_options)) as url:
        yield url


def remote_kwargs(url: str, **extra) -> dict:
    """Keyword arguments of a fast-failing ``remote`` reward for ``url`` (tests must not wait minutes)."""
    return {"url": url, "timeout": 10.0, "retries": 1, "backoff": 0.05, **extra}


@contextlib.contextmanager
def stub(handler: Callable) -> Iterator[str]:
    """A Starlette app whose every request (``/health`` answers like a reward server) goes to
    ``async handler(request) -> Response``; yields its URL."""
    import asyncio
    import threading
    import time

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def health(request):
        return JSONResponse({"status": "ok", "reward": "stub", "protocol": 1})

    app = Starlette(routes=[Route("/health", health), Route("/{path:path}", handler, methods=["GET", "POST"])])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", access_log=False, lifespan="off"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
