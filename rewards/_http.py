"""HTTP with retries for the rewards that call a server (``vlm_judge``, ``remote``): stdlib only.

A refused or dropped connection, a timeout and HTTP 408 / 429 / 500-class gateway answers (502,
503, 504) are retried with exponential backoff; any other HTTP status is final. Both failures name
the address and say what went wrong.
"""
from __future__ import annotations

import http.client
import logging
import socket
import time
import urllib.error
import urllib.request
from typing import Callable

log = logging.getLogger(__name__)

RETRY_STATUS = {408, 429, 500, 502, 503, 504}


def fetch(req: urllib.request.Request, *, timeout: float, retries: int, backoff: float, what: str,
          error: type[Exception], detail: Callable[[urllib.error.HTTPError], str],
          retry_status: frozenset | set = frozenset(RETRY_STATUS), hint: str = "", refused_is_final: bool = False) -> bytes:
    """The body of ``req``'s answer, trying ``retries + 1`` times (``backoff``, ``2 backoff``, ... apart);
    each failed attempt but the last is logged (a warning).

    Raises ``error("{what} answered HTTP {code}: {detail(e)}")`` for a final HTTP status, and
    ``error("{what} failed after N attempts (timeout T s each): {last cause}{hint}")`` once retries
    are spent. ``refused_is_final``: a refused connection (nothing listens at the address: a wrong URL,
    or a server not started) is final at once, ``error("{what}: connection refused ...{hint}")``."""
    last = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            text = detail(e)
            if e.code not in retry_status:
                raise error(f"{what} answered HTTP {e.code}: {text}") from None
            last = f"HTTP {e.code}: {text}"
        except (TimeoutError, socket.timeout):
            last = f"timed out after {timeout:g} s"
        except urllib.error.URLError as e:
            if refused_is_final and isinstance(e.reason, ConnectionRefusedError):
                raise error(f"{what}: connection refused (nothing listens at that address){hint}") from None
            last = f"timed out after {timeout:g} s" if isinstance(e.reason, (TimeoutError, socket.timeout)) \
                else f"{e.reason}"
        except (ConnectionError, http.client.HTTPException, OSError) as e:
            last = f"{type(e).__name__}: {e}" if str(e) else f"connection dropped ({type(e).__name__})"
        if attempt < retries:  # the last one is in the error raised below
            log.warning("%s failed (attempt %d/%d): %s", what, attempt + 1, retries + 1, last)
    raise error(f"{what} failed after {retries + 1} attempts (timeout {timeout:g} s each): {last}{hint}")
