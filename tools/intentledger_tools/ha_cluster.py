"""A throwaway PostgreSQL high-availability cluster under pg_auto_failover, for
the tests and `intentledger chaos --failover-every` (issue 38, docs/deploy.md
"High availability").

One monitor and three data nodes on loopback ports, each keeper
(`pg_autoctl run`) its own process group, all in one work directory. With
`synchronous=True` the formation requires one synchronous standby
(`number_sync_standbys = 1`, every standby in the replication quorum), so a
commit is acknowledged only once a standby has it; with `synchronous=False`
no standby is in the quorum and every node commits with
`synchronous_commit = local`: the counterexample, which can lose acknowledged
commits in a failover.

Three data nodes, not two: with one of two nodes gone the primary goes to
`wait_primary`, which turns synchronous replication off until the lost node
is back. With three, the surviving standby keeps commits synchronous after a
failover while the dead node is away.

The monitor's health checks are tuned from their defaults (a failover in
about 50 s) to seconds, and each keeper's `timeout.network_partition_timeout`
is kept below the monitor's `primary_demote_timeout`, so a primary cut off
from the monitor and its standbys stops itself before a standby is promoted.

Run as a module it starts a cluster, runs a command beside it with
INTENTLEDGER_TEST_POSTGRES_URL set to the multi-host URL, and tears it down:

    python -m intentledger_tools.ha_cluster [--async] -- CMD [ARGS...]
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import glob
import json
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal, NamedTuple

import psycopg

from intentledger.ports import free_port
from intentledger_tools.bench.tools import ToolMissing, apt_install

KillMode = Literal["postmaster", "node"]

MONITOR_DB = "pg_auto_failover"
# Every stale cluster of a killed test run is found here and swept at the next start.
REGISTRY = Path(tempfile.gettempdir()) / "intentledger-ha-clusters"
# The names the callers give their work directories (tempfile.mkdtemp in the
# temporary directory): a registry record naming anything else is not swept.
WORKDIR_PREFIXES = ("intentledger-ha-", "intentledger-ha.", "intentledger-bench-ha-")
SOCKET_DIR = Path("/var/run/postgresql")

# The monitor's failure detection, from its defaults (checks every 5 s, a node
# unhealthy after 20 s, 30 s for a primary to drain: about 50 s per failover)
# down to seconds. Names and meanings: pg_auto_failover's "Configuring
# pg_auto_failover" reference.
MONITOR_SETTINGS = {
    "pgautofailover.health_check_period": 1000,
    "pgautofailover.health_check_timeout": 1000,
    "pgautofailover.health_check_max_retries": 1,
    "pgautofailover.health_check_retry_delay": 500,
    "pgautofailover.node_considered_unhealthy_timeout": 2000,
    "pgautofailover.primary_demote_timeout": 4000,
    "pgautofailover.startup_grace_period": 2000,
}
# Seconds; below primary_demote_timeout, so a primary on the losing side of a
# network partition has stopped before the monitor promotes another node.
NETWORK_PARTITION_TIMEOUT = 3

# libpq's own defenses against a dead machine, which sends no RST: a
# connection attempt gives up after connect_timeout, and an open connection
# whose peer stopped answering is dropped after tcp_user_timeout (data unacked)
# or the keepalive probes (idle), instead of the kernel's ~15 minutes.
CLIENT_PARAMS = {
    "target_session_attrs": "read-write",
    "connect_timeout": "3",
    "keepalives": "1",
    "keepalives_idle": "5",
    "keepalives_interval": "2",
    "keepalives_count": "2",
    "tcp_user_timeout": "9000",
}


class HAClusterError(RuntimeError):
    pass


@dataclass(frozen=True)
class Node:
    name: str
    port: int
    pgdata: Path


class NodeState(NamedTuple):
    """A node as the monitor sees it: the state its keeper last reported and
    the one the monitor assigned it."""

    name: str
    port: int
    reported: str
    assigned: str


@dataclass
class Failover:
    """What one kill_primary/wait_stable pair saw, in seconds from the kill."""

    killed: str
    mode: KillMode
    promoted: str = ""
    to_new_primary: float = 0.0
    to_sync_standby: float = 0.0
    to_rejoined: float = 0.0
    # How long the new primary ran with no synchronous standby required or
    # attached (the monitor's wait_primary): commits there are not protected.
    wait_primary_seconds: float = 0.0
    states_seen: list[str] = field(default_factory=list)


def find_pg_autoctl() -> str:
    """pg_auto_failover's pg_autoctl (Debian's pg-auto-failover-cli, pulled in by
    postgresql-15-auto-failover); as root, install it when it is missing."""

    def found() -> str | None:
        return shutil.which("pg_autoctl") or shutil.which(
            "pg_autoctl", path="/usr/lib/postgresql/15/bin"
        )

    return found() or apt_install("postgresql-15-auto-failover", found)


def _pg_bin() -> Path:
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
        key=lambda p: [int(x) for x in re.findall(r"\d+", p)],
    )
    if not found:
        raise ToolMissing("no PostgreSQL server binaries under /usr/lib/postgresql/*/bin")
    return Path(found[-1]).parent


def _children_of() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for stat_file in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = Path(stat_file).read_text()
            # The command name may hold spaces and parentheses; the fields after it do not.
            fields = text[text.rindex(")") + 2 :].split()
            children.setdefault(int(fields[1]), []).append(int(stat_file.split("/")[2]))
    return children


def _tree(pid: int) -> list[int]:
    """`pid` and every process below it, parents first."""
    children = _children_of()
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _postmaster_pid(pgdata: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int((pgdata / "postmaster.pid").read_text().split()[0])
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return f"({path.name}: no log)"
    text = path.read_text(errors="replace").splitlines()
    return f"--- {path.name} (last {lines} lines) ---\n" + "\n".join(text[-lines:])


def _kill_recorded(record: dict[str, Any]) -> None:
    """Kill what a cluster's registry record names: its keepers' process groups
    (those still running pg_autoctl) and every postmaster still running from
    its work directory, with their children. A pid in a record or a stale
    postmaster.pid may since have been given to another process: each is
    checked before it is signalled."""
    for pgid in record.get("process_groups", []):
        if not isinstance(pgid, int) or pgid <= 1 or not _runs_pg_autoctl(pgid):
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGCONT)
            os.killpg(pgid, signal.SIGKILL)
    workdir = Path(record["workdir"])
    for pidfile in workdir.glob("*/pgdata/postmaster.pid"):
        pid = _postmaster_pid(pidfile.parent)
        if pid and _is_postmaster_of(pid, pidfile.parent):
            for each in _tree(pid):
                _signal(each, signal.SIGCONT)
                _signal(each, signal.SIGKILL)


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    return ""


def _runs_in(pid: int, pgdata: Path) -> bool:
    """Whether `pid` is a PostgreSQL process of the server in `pgdata`: every
    server process works in its data directory."""
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return False
    return cwd == str(pgdata.resolve()) and "postgres" in _cmdline(pid)


def _is_postmaster_of(pid: int, pgdata: Path) -> bool:
    """Whether `pid`, read from a postmaster.pid that may be stale (the
    postmaster SIGKILLed, the pid since reused), is that data directory's
    postmaster."""
    return pid > 1 and _runs_in(pid, pgdata)


def _process_group(pgid: int) -> list[int]:
    members = []
    for stat_file in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = Path(stat_file).read_text()
            if int(text[text.rindex(")") + 2 :].split()[2]) == pgid:
                members.append(int(stat_file.split("/")[2]))
    return members


def _runs_pg_autoctl(pgid: int) -> bool:
    """Whether process group `pgid` is (still) a keeper's: one of its
    processes runs pg_autoctl."""
    return any("pg_autoctl" in _cmdline(pid) for pid in _process_group(pgid))


def _private_registry() -> Path:
    """REGISTRY, created mode 0700; refused unless it is a directory of ours
    that no one else may write to (the records say what to kill and remove)."""
    with contextlib.suppress(FileExistsError):
        REGISTRY.mkdir(mode=0o700)
    info = REGISTRY.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise HAClusterError(f"{REGISTRY} is not a directory of user {os.geteuid()}: remove it")
    if info.st_mode & 0o022:
        raise HAClusterError(f"{REGISTRY} is writable by others: remove it")
    REGISTRY.chmod(0o700)
    return REGISTRY


def _sweepable(workdir: Path) -> bool:
    """Whether a record's work directory is one a cluster of ours made: a
    directory (not a link) directly in the temporary directory, named as the
    callers name theirs, owned by us (or, as root, by postgres, to whom the
    work directory is handed)."""
    owners = {os.geteuid()}
    if os.geteuid() == 0:
        with contextlib.suppress(KeyError):
            owners.add(pwd.getpwnam("postgres").pw_uid)
    try:
        info = workdir.lstat()
    except OSError:
        return False
    return (
        stat.S_ISDIR(info.st_mode)
        and info.st_uid in owners
        and workdir.parent.resolve() == Path(tempfile.gettempdir()).resolve()
        and workdir.name.startswith(WORKDIR_PREFIXES)
    )


def sweep_stale_clusters() -> list[str]:
    """Tear down clusters left by a process that died without stopping them
    (a SIGKILLed test run): its registry record names an owner that is gone."""
    swept = []
    for path in _private_registry().glob("*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            info = path.lstat()
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                continue
            record = json.loads(path.read_text())
            if _alive(int(record["owner"])):
                continue
            workdir = Path(record["workdir"])
            if _sweepable(workdir):
                _kill_recorded(record)
                shutil.rmtree(workdir, ignore_errors=True)
                swept.append(str(workdir))
            path.unlink(missing_ok=True)
    return swept


class HACluster:
    """A pg_auto_failover monitor and `data_nodes` data nodes in `workdir`
    (created; removed by stop())."""

    def __init__(self, workdir: Path, *, synchronous: bool = True, data_nodes: int = 3) -> None:
        if data_nodes < 2:
            raise ValueError("a failover needs at least two data nodes")
        self.workdir = Path(workdir)
        self.synchronous = synchronous
        self.data_nodes = data_nodes
        self.nodes: list[Node] = []
        self.monitor: Node | None = None
        self.failovers: list[Failover] = []
        self._keepers: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: dict[str, IO[bytes]] = {}
        self._frozen: set[str] = set()
        self._down: Node | None = None
        self._killed_at = 0.0
        self._in_wait_primary_since: float | None = None
        self._kill_mode: KillMode = "node"
        self._registry = REGISTRY / f"{os.getpid()}-{id(self):x}.json"
        self._stopped = False
        self._started = False
        # stop() may run while another thread is still in wait_stable() (a
        # cancelled asyncio.to_thread): no keeper may start once stop() took
        # its list of what to kill.
        self._lock = threading.RLock()
        self._thaw: threading.Timer | None = None
        self._pg_autoctl = ""
        self._pg_bin = Path()
        self._as_postgres = os.geteuid() == 0

    # -- life cycle --------------------------------------------------------------------------

    def __enter__(self) -> HACluster:
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
        if self._started:
            raise HAClusterError("this cluster was already started; make a new one")
        self._started = True
        self._pg_autoctl = find_pg_autoctl()
        self._pg_bin = _pg_bin()
        sweep_stale_clusters()
        atexit.register(self.stop)
        try:
            self._prepare_dirs()
            self._record()
            self._start_monitor()
            self._start_data_nodes()
            self._wait(self._settled, 120, "every node primary or secondary")
            self._configure_replication()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Kill everything this cluster started and remove its work directory."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._cancel_thaw()
            record = {"workdir": str(self.workdir), "process_groups": list(self._pgids())}
            _kill_recorded(record)
            for keeper in self._keepers.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    keeper.wait(timeout=10)
            for log in self._logs.values():
                log.close()
            self._keep_logs()
            shutil.rmtree(self.workdir, ignore_errors=True)
            self._registry.unlink(missing_ok=True)
            with contextlib.suppress(ValueError):
                atexit.unregister(self.stop)

    def _keep_logs(self) -> None:
        """Copy the keepers' and servers' logs to $INTENTLEDGER_HA_LOGS, if set,
        before the work directory goes."""
        target = os.environ.get("INTENTLEDGER_HA_LOGS")
        if not target:
            return
        where = Path(target) / self.workdir.name
        where.mkdir(parents=True, exist_ok=True)
        for log in [*self.workdir.glob("logs/*.log"), *self.workdir.glob("*/pgdata/log/*")]:
            name = log.name if log.parent.name == "logs" else f"{log.parts[-4]}-{log.name}"
            with contextlib.suppress(OSError):
                shutil.copy(log, where / name)

    # -- what callers use --------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.database_url("postgres")

    def database_url(self, dbname: str, *, primary_last: bool = False) -> str:
        """The multi-host URL of `dbname`. With `primary_last` the nodes are
        listed standbys first: only target_session_attrs=read-write then
        takes a new connection to the primary (a test's adversarial order)."""
        nodes = self.nodes
        if primary_last:
            primary = self.primary()
            nodes = [node for node in nodes if node != primary] + [primary]
        hosts = ",".join(f"127.0.0.1:{node.port}" for node in nodes)
        params = "&".join(f"{k}={v}" for k, v in CLIENT_PARAMS.items())
        return f"postgresql://postgres@{hosts}/{dbname}?{params}"

    def create_database(self, name: str) -> None:
        if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
            raise ValueError(f"database name {name!r}: lower-case letters, digits and _ only")
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")

    def states(self) -> list[NodeState]:
        with self._monitor_connection() as conn:
            rows = conn.execute(
                "SELECT nodename, nodeport, reportedstate::text, goalstate::text"
                " FROM pgautofailover.node ORDER BY nodeid"
            ).fetchall()
        return [NodeState(*row) for row in rows]

    def primary(self) -> Node:
        """The node the monitor has made primary (goal and reported state)."""
        for state in self.states():
            if state.assigned in ("primary", "wait_primary") and state.reported == state.assigned:
                return self._node_at(state.port)
        raise HAClusterError(f"no primary now: {self._describe()}")

    def sync_standbys(self, node: Node | None = None) -> list[str]:
        """The standbys the primary waits for on commit, as pg_stat_replication
        names them (sync_state 'sync' or 'quorum'), when synchronous commit is
        required there at all (synchronous_standby_names set)."""
        node = node or self.primary()
        with self._node_connection(node) as conn:
            names = conn.execute("SHOW synchronous_standby_names").fetchone()
            if not names or not names[0]:
                return []
            rows = conn.execute(
                "SELECT application_name FROM pg_stat_replication"
                " WHERE sync_state IN ('sync', 'quorum') AND state = 'streaming'"
            ).fetchall()
        return [row[0] for row in rows]

    def kill_primary(self, mode: KillMode) -> Node:
        """Kill the primary and return it at once. "postmaster": SIGKILL its
        postmaster, with its keeper frozen (SIGSTOP) first so it can neither
        restart PostgreSQL nor tell the monitor; "node": SIGKILL every process
        of the node, keeper and PostgreSQL, as if the machine died."""
        if self._down is not None:
            raise HAClusterError(f"{self._down.name} is still down: call wait_stable() first")
        old = self.primary()
        keeper = self._keepers[old.name]
        postmaster = _postmaster_pid(old.pgdata)
        if postmaster is None or not _is_postmaster_of(postmaster, old.pgdata):
            raise HAClusterError(f"{old.name} has no running postmaster (postmaster.pid)")
        if keeper.poll() is not None:
            raise HAClusterError(f"pg_autoctl for {old.name} exited with {keeper.returncode}")
        if mode == "postmaster":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(keeper.pid, signal.SIGSTOP)
            self._frozen.add(old.name)
            for pid in _tree(postmaster):
                _signal(pid, signal.SIGKILL)
        elif mode == "node":
            doomed = set(_tree(postmaster)) | set(_tree(keeper.pid))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(keeper.pid, signal.SIGKILL)
            for pid in doomed:
                _signal(pid, signal.SIGKILL)
            keeper.wait(timeout=10)
        else:
            raise ValueError(f"kill mode {mode!r}: 'postmaster' or 'node'")
        # The frozen walsenders died with the node; their pids may be reused.
        self._cancel_thaw()
        self._killed_at = time.monotonic()
        self._kill_mode = mode
        self._down = old
        self.failovers.append(Failover(killed=old.name, mode=mode))
        return old

    def wait_stable(self, timeout: float = 90) -> Node:
        """Wait for the monitor to promote another node and (synchronous) for a
        synchronous standby to be attached to it; then bring the killed node
        back once the monitor has demoted it, and wait until it is a standby
        again. Returns the new primary."""
        deadline = time.monotonic() + timeout
        if self._down is None:
            self._wait(self._settled, timeout, "every node primary or secondary")
            return self.primary()
        down = self._down
        record = self.failovers[-1]
        new = self._await_promotion(down, record, deadline)
        if self.synchronous:
            self._wait(
                lambda: bool(self._sync_or_none(new)),
                deadline - time.monotonic(),
                f"a synchronous standby of {new.name}",
                watch=lambda: self._watch(record),
            )
            record.to_sync_standby = time.monotonic() - self._killed_at
        # Only once the monitor has told the dead node to step down does it
        # come back: its keeper's first act is then to stay a non-primary.
        self._wait(
            lambda: self._assigned(down) in ("demoted", "catchingup", "secondary"),
            deadline - time.monotonic(),
            f"the monitor to demote {down.name}",
            watch=lambda: self._watch(record),
        )
        self._bring_back(down)
        # Its pg_rewind or base backup starts with a checkpoint on the new primary.
        self._with_checkpoints(
            new,
            self._settled,
            deadline - time.monotonic(),
            f"{down.name} to rejoin as a standby",
            watch=lambda: self._watch(record),
        )
        record.to_rejoined = time.monotonic() - self._killed_at
        self._down = None
        return new

    def freeze_replication(self, seconds: float) -> None:
        """SIGSTOP the primary's walsenders for `seconds`, in the background
        (returns at once; a timer sends SIGCONT). Commits made meanwhile reach
        no standby: asynchronous ones are acknowledged anyway, synchronous
        ones wait."""
        primary = self.primary()
        with self._node_connection(primary) as conn:
            pids = [row[0] for row in conn.execute("SELECT pid FROM pg_stat_replication")]
        if not pids:
            raise HAClusterError(f"{primary.name} has no walsender to freeze")
        for pid in pids:
            _signal(pid, signal.SIGSTOP)

        def thaw() -> None:
            # Only processes still this node's walsenders: by now the node may
            # have been killed and a pid given to another process.
            for pid in pids:
                if _runs_in(pid, primary.pgdata) and "walsender" in _cmdline(pid):
                    _signal(pid, signal.SIGCONT)

        with self._lock:
            self._cancel_thaw()
            self._thaw = threading.Timer(seconds, thaw)
            self._thaw.daemon = True
            self._thaw.start()

    def _cancel_thaw(self) -> None:
        if self._thaw is not None:
            self._thaw.cancel()
            self._thaw = None

    # -- start-up ----------------------------------------------------------------------------

    def _prepare_dirs(self) -> None:
        self.monitor = Node("monitor", free_port(), self.workdir / "monitor" / "pgdata")
        self.nodes = [
            Node(f"node{i}", free_port(), self.workdir / f"node{i}" / "pgdata")
            for i in range(1, self.data_nodes + 1)
        ]
        self.workdir.mkdir(parents=True, exist_ok=True)
        for sub in ("logs", "xdg/config", "xdg/data", "xdg/runtime", "monitor"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            node.pgdata.parent.mkdir(exist_ok=True)
        (self.workdir / "xdg/runtime").chmod(0o700)
        if self._as_postgres:
            closed = [p for p in self.workdir.resolve().parents if not p.stat().st_mode & 0o001]
            if closed:
                raise HAClusterError(
                    f"the servers run as postgres, who cannot enter {closed[0]}: "
                    "choose a work directory under an open one (tempfile.mkdtemp() in /tmp)"
                )
            postgres = pwd.getpwnam("postgres")
            SOCKET_DIR.mkdir(parents=True, exist_ok=True)
            os.chown(SOCKET_DIR, postgres.pw_uid, postgres.pw_gid)
            for path in [self.workdir, *self.workdir.rglob("*")]:
                os.chown(path, postgres.pw_uid, postgres.pw_gid)
        _private_registry()

    def _record(self) -> None:
        record = {
            "owner": os.getpid(),
            "workdir": str(self.workdir),
            "process_groups": list(self._pgids()),
        }
        self._registry.write_text(json.dumps(record))

    def _pgids(self) -> Iterator[int]:
        # Each keeper runs in its own session, so its process group id is its
        # pid. A keeper already reaped is left out: its pid may be reused.
        for keeper in self._keepers.values():
            if keeper.poll() is None:
                yield keeper.pid

    def _env(self) -> dict[str, str]:
        env = {
            "PATH": f"{self._pg_bin}:/usr/bin:/bin",
            "PG_CONFIG": str(self._pg_bin / "pg_config"),
            "XDG_CONFIG_HOME": str(self.workdir / "xdg/config"),
            "XDG_DATA_HOME": str(self.workdir / "xdg/data"),
            "XDG_RUNTIME_DIR": str(self.workdir / "xdg/runtime"),
            "PGHOST": str(SOCKET_DIR) if self._as_postgres else str(self.workdir),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
        }
        if self._as_postgres:
            env["HOME"] = pwd.getpwnam("postgres").pw_dir
        return env

    def _keeper(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with self._lock:
            self._refuse_if_stopped()
            log = self._logs.get(name) or (self.workdir / "logs" / f"{name}.log").open("ab")
            self._logs[name] = log
            extra: dict[str, Any] = {}
            if self._as_postgres:
                extra = {"user": "postgres", "group": "postgres", "extra_groups": []}
            proc = subprocess.Popen(
                [self._pg_autoctl, *args],
                env=self._env(),
                cwd=self.workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                **extra,
            )
            self._keepers[name] = proc
            self._record()
            return proc

    def _refuse_if_stopped(self) -> None:
        if self._stopped:
            raise HAClusterError("the cluster was stopped")

    def _pg_autoctl_run(self, name: str, *args: str) -> str:
        """A one-shot pg_autoctl command; its failure raises with its output."""
        extra: dict[str, Any] = {}
        if self._as_postgres:
            extra = {"user": "postgres", "group": "postgres", "extra_groups": []}
        done = subprocess.run(
            [self._pg_autoctl, *args],
            env=self._env(),
            cwd=self.workdir,
            capture_output=True,
            text=True,
            timeout=60,
            **extra,
        )
        if done.returncode != 0:
            raise HAClusterError(
                f"pg_autoctl {' '.join(args)} failed for {name} ({done.returncode}):\n"
                f"{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )
        return str(done.stdout)

    def _start_monitor(self) -> None:
        assert self.monitor is not None
        self._keeper(
            "monitor",
            [
                "create",
                "monitor",
                "--pgdata",
                str(self.monitor.pgdata),
                "--pgport",
                str(self.monitor.port),
                "--pgctl",
                str(self._pg_bin / "pg_ctl"),
                "--auth",
                "trust",
                "--no-ssl",
                "--hostname",
                "127.0.0.1",
                "--run",
            ],
        )
        self._wait(self._monitor_ready, 60, "the monitor to accept connections")
        with self._monitor_connection() as conn:
            for name, value in MONITOR_SETTINGS.items():
                conn.execute(f"ALTER SYSTEM SET {name} = {value}")
            conn.execute("SELECT pg_reload_conf()")

    def _monitor_ready(self) -> bool:
        try:
            with self._monitor_connection() as conn:
                conn.execute("SELECT count(*) FROM pgautofailover.formation")
        except psycopg.Error:
            return False
        return True

    def _start_data_nodes(self) -> None:
        assert self.monitor is not None
        monitor_uri = f"postgres://autoctl_node@127.0.0.1:{self.monitor.port}/{MONITOR_DB}"
        for node in self.nodes:
            self._keeper(
                node.name,
                [
                    "create",
                    "postgres",
                    "--pgdata",
                    str(node.pgdata),
                    "--pgport",
                    str(node.port),
                    "--pgctl",
                    str(self._pg_bin / "pg_ctl"),
                    "--monitor",
                    monitor_uri,
                    "--name",
                    node.name,
                    "--auth",
                    "trust",
                    "--no-ssl",
                    "--hostname",
                    "127.0.0.1",
                    "--pg-hba-lan",
                    "--replication-quorum",
                    "true" if self.synchronous else "false",
                    "--run",
                ],
            )
            if node is self.nodes[0]:
                self._wait(
                    lambda: self._reported(self.nodes[0]) == "single",
                    90,
                    "the first node to run as a single primary",
                )
                self._tune_first_node()
            else:
                self._with_checkpoints(
                    self.nodes[0],
                    lambda node=node: self._reported(node) == "secondary",  # type: ignore[misc]
                    90,
                    f"{node.name} to become a secondary",
                )

    def _tune_first_node(self) -> None:
        first = self.nodes[0]
        # Copied to every standby by its base backup; pg_autoctl leaves
        # postgresql.auto.conf alone.
        with self._node_connection(first) as conn:
            commit = "on" if self.synchronous else "local"
            conn.execute(f"ALTER SYSTEM SET synchronous_commit = {commit}")
            conn.execute("SELECT pg_reload_conf()")

    def _with_checkpoints(
        self,
        primary: Node,
        done: Callable[[], bool],
        timeout: float,
        what: str,
        watch: Callable[[], None] | None = None,
    ) -> None:
        """Wait for `done` while `primary` checkpoints every half second: a
        standby's base backup or rewind starts with a checkpoint there, which
        otherwise may wait for the next timed one (seen: a minute)."""
        stop = threading.Event()

        def checkpoint() -> None:
            while not stop.wait(0.5) and not self._stopped:
                with contextlib.suppress(psycopg.Error), self._node_connection(primary) as conn:
                    conn.execute("CHECKPOINT")

        thread = threading.Thread(target=checkpoint, daemon=True)
        thread.start()
        try:
            self._wait(done, timeout, what, watch=watch)
        finally:
            stop.set()
            thread.join(timeout=10)

    def _configure_replication(self) -> None:
        for node in self.nodes:
            self._pg_autoctl_run(
                node.name,
                "config",
                "set",
                "--pgdata",
                str(node.pgdata),
                "timeout.network_partition_timeout",
                str(NETWORK_PARTITION_TIMEOUT),
            )
        with self._monitor_connection() as conn:
            conn.execute(
                "SELECT pgautofailover.set_formation_number_sync_standbys('default', %s)",
                (1 if self.synchronous else 0,),
            )
        self._wait(self._settled, 60, "every node primary or secondary")
        primary = self.primary()
        if self.synchronous:
            self._wait(lambda: bool(self._sync_or_none(primary)), 60, "a synchronous standby")
        else:
            with self._node_connection(primary) as conn:
                names = conn.execute("SHOW synchronous_standby_names").fetchone()
            if names and names[0]:
                raise HAClusterError(f"asynchronous cluster requires standbys: {names[0]}")

    # -- failover ----------------------------------------------------------------------------

    def _await_promotion(self, down: Node, record: Failover, deadline: float) -> Node:
        promoted: list[Node] = []

        def promoted_elsewhere() -> bool:
            for state in self.states():
                if (
                    state.port != down.port
                    and state.assigned in ("primary", "wait_primary")
                    and state.reported == state.assigned
                ):
                    promoted.append(self._node_at(state.port))
                    return True
            return False

        self._wait(
            promoted_elsewhere,
            deadline - time.monotonic(),
            f"the monitor to promote a node other than {down.name}",
            watch=lambda: self._watch(record),
        )
        record.promoted = promoted[0].name
        record.to_new_primary = time.monotonic() - self._killed_at
        return promoted[0]

    def _watch(self, record: Failover) -> None:
        now = time.monotonic()
        if self._in_wait_primary_since is not None:
            record.wait_primary_seconds += now - self._in_wait_primary_since
            self._in_wait_primary_since = None
        with contextlib.suppress(psycopg.Error):
            states = self.states()
            seen = " ".join(f"{s.name}:{s.reported}/{s.assigned}" for s in states)
            for state in states:
                if state.reported == "wait_primary":
                    # What commits wait for there (M2: nothing, while it lasts).
                    self._in_wait_primary_since = now
                    with self._node_connection(self._node_at(state.port)) as conn:
                        names = conn.execute("SHOW synchronous_standby_names").fetchone()
                    seen += (
                        f" [{state.name} synchronous_standby_names={names[0] if names else ''!r}]"
                    )
            if not record.states_seen or record.states_seen[-1].split(" ", 1)[1] != seen:
                record.states_seen.append(f"{now - self._killed_at:.1f}s {seen}")

    def _bring_back(self, node: Node) -> None:
        with self._lock:
            self._refuse_if_stopped()
            keeper = self._keepers[node.name]
            if node.name in self._frozen and keeper.poll() is None:
                os.killpg(keeper.pid, signal.SIGCONT)
                self._frozen.discard(node.name)
                return
            self._keeper(node.name, ["run", "--pgdata", str(node.pgdata)])

    def _require_keepers(self) -> None:
        """Raise, with its log, if a keeper we did not kill has exited."""
        for name, keeper in list(self._keepers.items()):
            if keeper.poll() is not None and (self._down is None or name != self._down.name):
                raise HAClusterError(
                    f"pg_autoctl for {name} exited with {keeper.returncode}\n"
                    + _tail(self.workdir / "logs" / f"{name}.log")
                )

    def _settled(self) -> bool:
        states = self.states()
        return len(states) == len(self.nodes) and all(
            s.reported == s.assigned and s.reported in ("primary", "secondary") for s in states
        )

    # -- helpers -----------------------------------------------------------------------------

    def _wait(
        self,
        done: Callable[[], bool],
        timeout: float,
        what: str,
        watch: Callable[[], None] | None = None,
    ) -> None:
        deadline = time.monotonic() + max(timeout, 0)
        last_error: BaseException | None = None
        while True:
            self._refuse_if_stopped()
            self._require_keepers()
            if watch:
                watch()
            try:
                if done():
                    return
            except HAClusterError:
                raise
            except psycopg.Error as error:
                last_error = error
            if time.monotonic() >= deadline:
                raise HAClusterError(
                    f"timed out after {timeout:.0f}s waiting for {what}; "
                    f"last error: {last_error}\nstates: {self._describe()}\n"
                    + "\n".join(_tail(p) for p in sorted((self.workdir / "logs").glob("*.log")))
                )
            time.sleep(0.25)

    def _describe(self) -> str:
        try:
            return ", ".join(f"{s.name}:{s.reported}/{s.assigned}" for s in self.states())
        except psycopg.Error as error:
            return f"(monitor unreachable: {error})"

    def _reported(self, node: Node) -> str:
        for state in self.states():
            if state.port == node.port:
                return state.reported
        return ""

    def _assigned(self, node: Node) -> str:
        for state in self.states():
            if state.port == node.port:
                return state.assigned
        return ""

    def _node_at(self, port: int) -> Node:
        for node in self.nodes:
            if node.port == port:
                return node
        raise HAClusterError(f"the monitor names a node on port {port} this cluster did not start")

    def _sync_or_none(self, node: Node) -> list[str]:
        try:
            return self.sync_standbys(node)
        except psycopg.Error:
            return []

    def _monitor_connection(self) -> psycopg.Connection[Any]:
        assert self.monitor is not None
        return psycopg.connect(
            f"postgresql://postgres@127.0.0.1:{self.monitor.port}/{MONITOR_DB}",
            autocommit=True,
            connect_timeout=3,
        )

    def _node_connection(self, node: Node) -> psycopg.Connection[Any]:
        return psycopg.connect(
            f"postgresql://postgres@127.0.0.1:{node.port}/postgres",
            autocommit=True,
            connect_timeout=3,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m intentledger_tools.ha_cluster",
        description="Run CMD beside a throwaway pg_auto_failover cluster (a monitor and three "
        "data nodes), with INTENTLEDGER_TEST_POSTGRES_URL set to its multi-host URL.",
    )
    parser.add_argument(
        "--async",
        dest="asynchronous",
        action="store_true",
        help="no synchronous standby (the counterexample)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    workdir = Path(tempfile.mkdtemp(prefix="intentledger-ha."))
    try:
        with HACluster(workdir, synchronous=not args.asynchronous) as cluster:
            ports = ", ".join(f"{n.name} {n.port}" for n in cluster.nodes)
            mode = "synchronous" if cluster.synchronous else "asynchronous"
            print(f"ha_cluster: {mode}, primary {cluster.primary().name}; {ports}", file=sys.stderr)
            env = {**os.environ, "INTENTLEDGER_TEST_POSTGRES_URL": cluster.url}
            return subprocess.run(command, env=env).returncode
    except (HAClusterError, ToolMissing) as error:
        print(f"ha_cluster: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
