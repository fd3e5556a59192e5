"""A real S3-compatible server on a loopback port, for the object-store tests.

``moto_server`` (the ``moto[server]`` test extra) runs as a process of its own,
so host processes reach it over HTTP exactly as they would reach a cluster's
object store; nothing is stubbed inside the processes under test.
"""

from __future__ import annotations

import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class S3Server:
    """``moto_server`` on 127.0.0.1; :meth:`bucket` makes a fresh bucket per test."""

    port: int = field(default_factory=_free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """What a user passes as ``DDict(storage_options=...)`` for this server."""
        return {"key": "testing", "secret": "testing", "endpoint_url": self.endpoint}

    def __enter__(self) -> S3Server:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(30)
            self.proc = None

    def bucket(self) -> str:
        """A new empty bucket's URL."""
        import s3fs

        name = f"ddict-{secrets.token_hex(6)}"
        s3fs.S3FileSystem(**self.storage_options).mkdir(name)
        return f"s3://{name}"

    def keys(self, url: str) -> list[str]:
        """Every object under ``url``, as the server has it now."""
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)
        return sorted(fs.find(url))
