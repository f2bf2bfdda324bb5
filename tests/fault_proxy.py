"""The suite's fault proxies as OS processes: a provider's fake module runs its
`FaultProxy` (intentledger.testing.fault_proxy) with `python -m <module> proxy`,
so a reset or a refused port is a real process's; the control port, which stays
up while the public port refuses, configures the faults and reads the proxy's
log."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from intentledger.ports import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent


class FaultProxyControl:
    """A running proxy's control port."""

    def __init__(self, control_base: str) -> None:
        self.control_base = control_base

    def _control(self, method: str, path: str, payload: Any = None) -> Any:
        response = httpx.request(method, f"{self.control_base}{path}", json=payload, timeout=10)
        if response.status_code != 200:
            raise RuntimeError(f"{method} {path}: {response.status_code} {response.text}")
        return response.json()

    def reset(self) -> None:
        self._control("POST", "/_proxy/reset")

    def configure(self, **config: Any) -> None:
        self._control("POST", "/_proxy/config", config)

    def listener(self, open: bool) -> None:
        self._control("POST", "/_proxy/listener", {"open": open})

    def log(self) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = self._control("GET", "/_proxy/log")["data"]
        return entries


class FaultProxyProcess(FaultProxyControl):
    """A provider's proxy as a subprocess on free ports: `python -m <module>
    proxy --port P --control-port C --upstream URL`, the module being the
    provider's fake (its `main` runs its FaultProxy subclass)."""

    def __init__(
        self, module: str, upstream: str, workdir: Path, startup_timeout: float = 20.0
    ) -> None:
        self.public_port = free_port()
        self.control_port = free_port()
        super().__init__(f"http://127.0.0.1:{self.control_port}")
        self.module = module
        self.upstream = upstream
        self.base = f"http://127.0.0.1:{self.public_port}"
        self.startup_timeout = startup_timeout
        self._log = workdir / f"{module.rsplit('.', 1)[-1]}-proxy.log"
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> FaultProxyProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        with self._log.open("ab") as log:
            self._process = subprocess.Popen(
                [
                    *(sys.executable, "-m", self.module, "proxy"),
                    *("--port", str(self.public_port), "--control-port", str(self.control_port)),
                    *("--upstream", self.upstream),
                ],
                cwd=REPO_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"the {self.module} proxy exited early:\n{self.output()}")
            # The public port opens before the control port: a healthy control
            # port means both are up, and probing it leaves the proxy's log empty.
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.control_base}/_proxy/health", timeout=1).status_code == 200:
                    return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the {self.module} proxy is not up:\n{self.output()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=5)
        self._process = None

    def output(self) -> str:
        return self._log.read_text(errors="replace") if self._log.exists() else ""
