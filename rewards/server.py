"""``flowrl serve-reward``: a reward in its own process (its own environment, GPU or node) behind HTTP.

``flowrl serve-reward NAME [--options ...] [--host 127.0.0.1] [--port N]`` builds the reward (a
registered name, or ``module:callable`` from the current directory or the environment), binds, and
prints ``... ready at http://HOST:PORT`` once it serves: the ``url`` of the ``remote`` reward
(:mod:`flowrl.rewards.remote`). Endpoints: ``POST /score`` (the wire format of
:mod:`flowrl.rewards._wire`: safetensors body, JSON answer, no pickle) and ``GET /health``.

Serving stack: Starlette on uvicorn (ASGI). Requests that arrive together (several ranks, several
runs) are merged into one reward call of at most ``max_batch`` images (``max_wait`` seconds for
company after the first; :mod:`flowrl.rewards.batching`); the reward runs on one worker thread, one
call at a time, while the event loop keeps reading requests. :mod:`flowrl.rewards.server_process`
runs this in a child process. Limits: body
size (413), images per request and pixels per image (400); a bearer token (``--token-env VAR``:
the token is read from that environment variable, never from the command line) guards ``/score``.
It binds to 127.0.0.1 unless ``--host`` says otherwise.

``module:callable``: a class or a factory is called with the options and returns the reward; a
function taking ``(images, prompts)`` (two required positional parameters) and given no options is
the reward itself.
"""
from __future__ import annotations

import asyncio
import hmac
import importlib
import inspect
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from ._clip_common import require
from ._wire import CONTENT_TYPE, ENCODINGS, PROTOCOL, WireError, decode_request, encode_response
from .batching import Batcher, RewardRejected

READY = "ready at"  # the line a server prints once it serves: "... ready at http://HOST:PORT"


@dataclass
class ServeOptions:
    """Where and how a reward is served (``flowrl serve-reward --help``)."""

    host: str = "127.0.0.1"
    port: int = 0                 # 0: a free port, printed
    max_batch: int = 64           # images per reward call; requests are merged up to this
    max_wait: float = 0.005       # seconds a request waits for others to merge with
    max_request_mb: float = 256.0
    max_images: int = 1024        # per request
    max_pixels: int = 4096 * 4096  # per image
    token_env: Optional[str] = None

    def __post_init__(self) -> None:
        if not 0 <= int(self.port) <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for k in ("max_batch", "max_images", "max_pixels"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")
        if self.max_wait < 0 or self.max_request_mb <= 0:
            raise ValueError("need max_wait >= 0 and max_request_mb > 0")

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mb * (1 << 20))

    def token(self) -> Optional[str]:
        if not self.token_env:
            return None
        value = os.environ.get(self.token_env)
        if not value:
            raise ValueError(f"--token-env {self.token_env}: that environment variable is not set or empty; export "
                             f"the bearer token there (the remote reward reads it with token_env)")
        return value


# ---------------------------------------------------------------- the reward
def parse_options(items: Optional[list[str]]) -> dict:
    """``--options`` items -> keyword arguments: a YAML file, a YAML mapping (``'{device: cuda:1}'``)
    or ``key=value`` (the value read as YAML), merged left to right."""
    import yaml

    out: dict = {}
    for item in items or []:
        if os.path.isfile(item):
            try:
                value = yaml.safe_load(Path(item).read_text())
            except yaml.YAMLError as e:
                raise ValueError(f"--options {item}: the file is not YAML ({e})") from None
        elif "=" in item and not item.lstrip().startswith("{"):
            k, _, v = item.partition("=")
            value = {k.strip(): yaml.safe_load(v) if v.strip() else None}
        else:
            try:
                value = yaml.safe_load(item)
            except yaml.YAMLError as e:
                raise ValueError(f"--options {item!r}: not YAML ({e}); balance its brackets, or give key=value "
                                 f"items") from None
        if not isinstance(value, dict):
            raise ValueError(f"--options {item!r}: expected key=value, a YAML (or JSON) mapping or a YAML file")
        out.update(value)
    return out


def load_reward(name: str, options: Optional[dict] = None):
    """A registered reward by name, or ``module:callable`` (module doc) built with ``options``."""
    options = dict(options or {})
    if ":" not in name:
        from . import _resolve, check_options

        check_options(name, options, "--options")
        return _resolve(name)(**options)
    mod_name, _, attr = name.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a user's module beside the command, as `python -m` would find it
    try:
        target = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load {name!r}: {e}") from None
    if not callable(target):
        raise ValueError(f"{name!r} is not callable")
    if inspect.isclass(target) or options:
        return target(**options)
    try:
        required = [p for p in inspect.signature(target).parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        required = []
    return target if len(required) >= 2 else target()


# ---------------------------------------------------------------- the app
def build_app(reward, label: str, opts: ServeOptions):
    """The Starlette app serving ``reward`` (``/score``, ``/health``)."""
    require("starlette", "starlette uvicorn  (or: pip install 'flowrl[serve]')")
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    batcher = Batcher(reward, opts.max_batch, opts.max_wait)
    token = opts.token()
    limit = opts.max_request_bytes

    def error(status: int, field: str, message: str) -> JSONResponse:
        return JSONResponse({"error": message, "field": field}, status_code=status)

    async def health(request):
        return JSONResponse({"status": "ok", "reward": label, "protocol": PROTOCOL, "encodings": list(ENCODINGS),
                             "max_batch": opts.max_batch, "max_images": opts.max_images,
                             "max_request_bytes": limit, **batcher.stats})

    async def score(request):
        if token is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return error(401, "Authorization", "missing or wrong bearer token (this server was started with "
                                                   "--token-env; pass the same token with the remote reward's token_env)")
        ctype = request.headers.get("content-type", "")
        if not ctype.startswith(CONTENT_TYPE):
            return error(415, "Content-Type", f"expected {CONTENT_TYPE} (a safetensors body), got {ctype!r}")
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return error(413, "body", f"{declared} bytes exceed the server's limit of {limit} bytes "
                                      f"(--max-request-mb {opts.max_request_mb:g}); send fewer images per request")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                return error(413, "body", f"more than the server's limit of {limit} bytes (--max-request-mb "
                                          f"{opts.max_request_mb:g}); send fewer images per request")
        try:
            images, prompts, meta = await run_in_threadpool(decode_request, bytes(body), opts.max_images,
                                                            opts.max_pixels)
        except WireError as e:
            return error(400, e.field, str(e))
        try:
            total, comps = await batcher.score(images, prompts, meta)
            return JSONResponse(encode_response(total, comps, len(prompts)))
        except RewardRejected as e:
            return error(422, "reward", f"the reward {label!r} rejected the request: {e}")
        except WireError as e:
            return error(500, e.field, f"the reward {label!r} answered wrongly: {e}")
        except Exception as e:  # noqa: BLE001 (the reward's own failure, reported to the client)
            return error(500, "reward", f"the reward {label!r} failed: {type(e).__name__}: {e}")

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        await batcher.start()
        yield
        await batcher.stop()

    app = Starlette(routes=[Route("/health", health, methods=["GET"]), Route("/score", score, methods=["POST"])],
                    lifespan=lifespan)
    app.state.batcher = batcher
    return app


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted server gets its port back
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot bind {host}:{port}: {e}") from None
    sock.listen(2048)
    return sock


def url_of(sock: socket.socket, host: str) -> str:
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def _server(app):
    """A uvicorn server for ``app`` (it handles SIGINT / SIGTERM when run on the main thread)."""
    uvicorn = require("uvicorn", "uvicorn starlette  (or: pip install 'flowrl[serve]')")
    return uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                         timeout_keep_alive=30))


def serve(reward, label: str, opts: ServeOptions, announce: Callable[[str], None] = print) -> None:
    """Serve ``reward`` until interrupted (SIGINT / SIGTERM); ``announce(line)`` once it is ready."""
    app = build_app(reward, label, opts)
    sock = _bind(opts.host, opts.port)
    server = _server(app)
    url = url_of(sock, opts.host)

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started:
            announce(f"flowrl serve-reward: {label!r} {READY} {url}  (POST {url}/score, GET {url}/health)")
        await task

    if opts.host not in ("127.0.0.1", "localhost", "::1") and opts.token_env is None:
        print(f"flowrl serve-reward: WARNING: listening on {opts.host} without a token (--token-env): anyone who "
              f"can reach it can use the reward", file=sys.stderr, flush=True)
    asyncio.run(main())


@contextmanager
def serve_in_thread(reward, label: str = "reward", opts: Optional[ServeOptions] = None) -> Iterator[str]:
    """Serve ``reward`` from a thread of this process (tests, benchmarks); yields its URL."""
    opts = opts or ServeOptions()
    sock = _bind(opts.host, opts.port)
    server = _server(build_app(reward, label, opts))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True,
                              name="flowrl-serve-reward")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process reward server did not start")
        time.sleep(0.01)
    try:
        yield url_of(sock, opts.host)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def serve_reward_command(name: str, options: Optional[list[str]], opts: ServeOptions) -> int:
    """The CLI verb: build the reward, then serve it (blocks)."""
    try:
        reward = load_reward(name, parse_options(options))
    except TypeError as e:  # options the reward does not take
        raise ValueError(f"{name} --options: {e}") from None
    serve(reward, name, opts, announce=lambda line: print(line, flush=True))
    return 0
