"""An app served by uvicorn in a background thread on a free port of 127.0.0.1: what the explorer page's browser
test and ``docs/screenshots.py`` point Chromium at, and where that Chromium is."""
from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any


class BackgroundServer:
    """``with BackgroundServer(app) as s: ... s.url ...``: uvicorn on 127.0.0.1 (a port the OS picks), stopped on
    exit (the app's lifespan shutdown runs, so its model worker ends)."""

    def __init__(self, app: Any, *, timeout: float = 20.0) -> None:
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="nmtflow-serve-background")
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                self.close()
                raise RuntimeError(f"the server on {self.url} did not start within {timeout:.0f} s")
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def chromium_binary() -> str | None:
    """The system's Chromium (``NMTFLOW_CHROMIUM`` first, then Debian's ``/usr/bin/chromium`` and the ``PATH``), for
    Playwright's ``executable_path``: nmtflow never runs a browser that Playwright downloads."""
    for candidate in (os.environ.get("NMTFLOW_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None
