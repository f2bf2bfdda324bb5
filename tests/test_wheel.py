"""`pip install .` installs the service and nothing of the workshop: the wheel
carries no bench, chaos or demo code and no switch that breaks the engine on
purpose. The tools (tools/) are a distribution of their own that the dev and
bench installs add, and there the `intentledger` command has their commands."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import distribution, entry_points
from pathlib import Path

import pytest

from tests.support import INTENTLEDGER

ROOT = Path(__file__).resolve().parent.parent
TOOL_COMMANDS = {"bench", "chaos", "demo"}
# The deliberate double charge the chaos harness must catch, and the soak's
# replay window of minutes, under any of the spellings a setting, a flag or an
# environment variable would give them.
TEST_ONLY_SWITCHES = (
    "break_for_tests",
    "blind_retry",
    "short_retention",
    "shortest_test_replay_window",
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    # Built from a copy: a build writes build/ and *.egg-info beside its sources.
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), "."],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (built,) = out.glob("intentledger-*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_holds_no_bench_chaos_or_demo_code(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    assert "intentledger/cli.py" in names  # the service itself is there
    workshop = [
        name
        for name in names
        if name.startswith(("intentledger/bench/", "intentledger_tools"))
        or name in ("intentledger/chaos.py", "intentledger/demo.py")
    ]
    assert workshop == []
    (entry_points_txt,) = (name for name in names if name.endswith(".dist-info/entry_points.txt"))
    assert "intentledger.commands" not in wheel.read(entry_points_txt).decode()


def test_no_file_of_the_wheel_names_a_test_only_switch(wheel: zipfile.ZipFile) -> None:
    found = {}
    for name in wheel.namelist():
        text = wheel.read(name).decode("utf-8", errors="replace").lower().replace("-", "_")
        named = [switch for switch in TEST_ONLY_SWITCHES if switch in text]
        if named:
            found[name] = named
    assert found == {}


def test_the_dev_install_has_the_tools_and_their_commands() -> None:
    assert distribution("intentledger-tools").name == "intentledger-tools"
    commands = {command.name: command for command in entry_points(group="intentledger.commands")}
    assert set(commands) == TOOL_COMMANDS
    for command in commands.values():
        assert callable(command.load())
    from intentledger_tools import blind_retry, chaos, demo, short_retention
    from intentledger_tools.bench import runner

    assert chaos.MUTATIONS["blind-retry"] == blind_retry.__name__
    assert short_retention.__name__ == chaos.SHORT_RETENTION
    assert demo.SCENARIOS and runner.PHASES
    listed = subprocess.run(
        [*INTENTLEDGER, "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    for name in TOOL_COMMANDS:
        assert f" {name} " in listed, listed
