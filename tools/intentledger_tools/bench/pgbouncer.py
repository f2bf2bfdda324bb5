"""A throwaway PgBouncer in transaction mode in front of a PostgreSQL server,
for the tests and the bench's pooler phase (docs/scaling.md).

It runs Debian's `pgbouncer` (1.18 on this machine kind) with a configuration
written to a temporary directory: every database of the server under its own
name, `pool_mode = transaction`, and fewer server connections than clients,
so that consecutive transactions of one client really do land on different
server connections — the case that breaks automatic prepared statements.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

from intentledger.ports import free_port
from intentledger_tools.bench.tools import apt_install


def find_pgbouncer() -> str:
    """PgBouncer (Debian puts it in /usr/sbin, not on every user's PATH); as root,
    install Debian's package when it is missing."""

    def found() -> str | None:
        return shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")

    return found() or apt_install("pgbouncer", found)


@dataclass(frozen=True)
class PgBouncer:
    port: int
    workdir: Path
    # Its process, once started (the bench counts its CPU).
    pid: int | None = None

    def url_for(self, database_url: str) -> str:
        """The same database, user and password, reached through the pooler."""
        url = make_url(database_url).set(host="127.0.0.1", port=self.port)
        return url.render_as_string(hide_password=False)

    def log(self) -> str:
        path = self.workdir / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _config(server_url: str, port: int, workdir: Path, pool_size: int) -> str:
    server = make_url(server_url)
    user = server.username or "postgres"
    return f"""\
[databases]
* = host={server.host or "127.0.0.1"} port={server.port or 5432}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {workdir}/userlist.txt
pool_mode = transaction
default_pool_size = {pool_size}
max_client_conn = 2000
logfile = {workdir}/pgbouncer.log
pidfile = {workdir}/pgbouncer.pid
admin_users = {user}
; After a server restart, log in again within a second (default 15 s).
server_login_retry = 1
"""


@contextmanager
def running_pgbouncer(server_url: str, *, pool_size: int = 8) -> Iterator[PgBouncer]:
    """PgBouncer in front of the server `server_url` points at, stopped on exit.
    Its work directory (configuration and log) is kept when the body fails.

    PgBouncer refuses to run as root: as root it runs as `postgres` (the user
    the test and bench clusters run as)."""
    server = make_url(server_url)
    if {"host", "hostaddr", "port"} & set(server.query):
        # A client given url_for()'s URL would follow these to the server itself.
        raise ValueError("give PgBouncer's server as the URL's host and port, not in its query")
    binary = find_pgbouncer()
    user = server.username or "postgres"
    as_postgres: dict[str, Any] = (
        {"user": "postgres", "group": "postgres", "extra_groups": []} if os.geteuid() == 0 else {}
    )
    workdir = Path(tempfile.mkdtemp(prefix="intentledger-pgbouncer-"))
    bouncer = PgBouncer(free_port(), workdir)
    process: subprocess.Popen[bytes] | None = None
    failed = False
    try:
        (workdir / "pgbouncer.ini").write_text(
            _config(server_url, bouncer.port, workdir, pool_size)
        )
        # Looked up even with auth_type=trust, and the password is what PgBouncer
        # logs in to the server with.
        (workdir / "userlist.txt").write_text(f'"{user}" "{server.password or ""}"\n')
        if as_postgres:
            for path in (workdir, workdir / "pgbouncer.ini", workdir / "userlist.txt"):
                shutil.chown(path, "postgres", "postgres")
        # PgBouncer logs every connection to stderr as well as to its log file: a
        # pipe nobody reads fills up and then PgBouncer blocks, and every client
        # with it. So -q, and what it says before its log is open goes to a file.
        with (workdir / "stderr.log").open("wb") as stderr:
            process = subprocess.Popen(
                [binary, "-q", str(workdir / "pgbouncer.ini")],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                **as_postgres,
            )
        _wait_listening(process, bouncer)
        yield dataclasses.replace(bouncer, pid=process.pid)
    except BaseException:
        failed = True
        raise
    finally:
        if process is not None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        if failed:
            print(f"pgbouncer: its configuration and log are kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def _wait_listening(process: subprocess.Popen[bytes], bouncer: PgBouncer) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if process.poll() is not None:
            stderr = (bouncer.workdir / "stderr.log").read_text(errors="replace")
            raise RuntimeError(f"pgbouncer exited ({process.returncode}):\n{stderr}{bouncer.log()}")
        try:
            socket.create_connection(("127.0.0.1", bouncer.port), timeout=0.5).close()
        except OSError:
            time.sleep(0.05)
            continue
        if process.poll() is None:  # it is PgBouncer listening, not another program
            return
    raise RuntimeError(f"pgbouncer did not listen on {bouncer.port} within 15 s:\n{bouncer.log()}")
