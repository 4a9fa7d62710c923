"""``flowrl serve-reward`` in a child process: started, its URL read from what it prints, stopped
(cleanly, or killed as a crash would). For benchmarks and tests that need a reward in another process."""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .server import READY


@dataclass
class ServerProcess:
    """``flowrl serve-reward`` run as a child process (:func:`spawn`)."""

    proc: subprocess.Popen
    url: str
    log: Path = field(repr=False, default=None)

    def stop(self, kill: bool = False) -> None:
        """SIGKILL (``kill``: a crash) or SIGTERM (a clean stop), then wait."""
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        if self.log is not None:
            self.log.unlink(missing_ok=True)

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def spawn(name: str, options: Optional[list[str]] = None, port: int = 0, args: Optional[list[str]] = None,
          env: Optional[dict] = None, timeout: float = 180.0) -> ServerProcess:
    """Start ``flowrl serve-reward NAME`` in a child process and wait for its URL (``--port 0``: any free port)."""
    log = Path(tempfile.mkstemp(prefix="flowrl-serve-reward-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "flowrl", "serve-reward", name, "--port", str(port), *(args or [])]
    if options:
        cmd += ["--options", *options]
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, text=True)
    lines: list[str] = []
    done = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if READY in line:
                done.set()
        done.set()

    threading.Thread(target=read, daemon=True).start()
    if not done.wait(timeout) or not any(READY in x for x in lines):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"`{' '.join(cmd)}` did not become ready within {timeout:g} s; its stderr ends with: "
                           f"{log.read_text(errors='replace')[-2000:]}")
    url = re.search(r"(https?://\S+)", next(x for x in lines if READY in x)).group(1)
    return ServerProcess(proc, url, log)
