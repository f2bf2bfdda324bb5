"""The package's layering: which module may import which, and where SQL is written.

- The import contracts in pyproject.toml ([tool.importlinter]) hold: the layer
  tree of docs/architecture.md, the domain free of I/O libraries, the command
  line, the API and the console as siblings, the entry points off the store,
  and no cycle between the children of any package. `lint-imports` checks them
  here on this checkout's source; each is shown to fail on the import it forbids.
- No package's __init__ forms a cycle with its own modules (the one cycle the
  contracts cannot see).
- Every SQL statement is built in store/ (migrations included); the workshop
  that left the package (tools/: bench, chaos, demo) is not held to it.

Imports are read from the source, so nothing is imported to check them, and an
import inside a function or under TYPE_CHECKING counts like any other.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path

import grimp
import pytest
from importlinter.api import read_configuration
from importlinter.contracts.acyclic_siblings import AcyclicSiblingsContract
from importlinter.contracts.forbidden import ForbiddenContract
from importlinter.contracts.layers import LayersContract
from importlinter.domain.contract import Contract

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "intentledger"
PYPROJECT = ROOT / "pyproject.toml"
SQL_BUILDERS = frozenset({"select", "insert", "update", "delete", "text"})


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    tree: ast.Module


def _modules() -> list[Module]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        found.append(Module(".".join(parts), path, tree))
    return found


MODULES = _modules()


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_the_import_contracts_hold() -> None:
    """`lint-imports` on this checkout's package, not on one installed elsewhere;
    a broken contract fails with every chain that breaks it."""
    check_and_lint = (
        "import importlib.util, sys\n"
        "origin = importlib.util.find_spec('intentledger').origin\n"
        "if origin != sys.argv.pop(1): sys.exit(f'intentledger is imported from {origin}')\n"
        "from importlinter.cli import lint_imports_command\n"
        "lint_imports_command()\n"
    )
    path = os.pathsep.join(filter(None, [str(PACKAGE.parent), os.environ.get("PYTHONPATH")]))
    expected = str(PACKAGE / "__init__.py")
    linted = subprocess.run(
        [sys.executable, "-c", check_and_lint, expected, str(PYPROJECT), "--no-cache", "--no-logo"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    if linted.returncode != 0:
        pytest.fail(linted.stdout + linted.stderr, pytrace=False)


def _contracts() -> dict[str, Contract]:
    kinds: dict[str, type[Contract]] = {
        "layers": LayersContract,
        "forbidden": ForbiddenContract,
        "acyclic_siblings": AcyclicSiblingsContract,
    }
    config = read_configuration(str(PYPROJECT))
    return {
        options["id"]: kinds[options["type"]](
            name=options["name"],
            session_options=config["session_options"],
            contract_options=options,
        )
        for options in config["contracts_options"]
    }


def _broken(graph: grimp.ImportGraph) -> set[str]:
    return {
        contract_id
        for contract_id, contract in _contracts().items()
        if not contract.check(deepcopy(graph), verbose=False).kept
    }


EXTERNALS = ("sqlalchemy", "fastapi", "starlette", "httpx", "aiohttp", "orjson")


def _layered_package() -> grimp.ImportGraph:
    """A package laid out as the contracts ask, with an import of each kind
    they allow: the command line starts the service, the roots mount the API
    and the console, which read through web/ and the engine; the store and the
    domain use their libraries."""
    graph = grimp.ImportGraph()
    graph.add_module("intentledger")
    for layer in _contracts()["layers"].layers:
        for tail in layer.module_tails:
            graph.add_module(f"intentledger.{tail.name}")
    for external in EXTERNALS:
        graph.add_module(external, is_squashed=True)
    for importer, imported in [
        ("cli", "ops_cli"),
        ("cli", "service"),
        ("ops_cli", "service"),
        ("service", "app"),
        ("service", "settings"),
        ("app", "api.app"),
        ("app", "console.pages"),
        ("api.app", "web.problems"),
        ("console.pages", "web.problems"),
        ("web.problems", "engine.refusal"),
        ("engine.refusal", "store.ledger"),
        ("engine.refusal", "observability.metrics"),
        ("store.announcements", "store.ledger"),
        ("store.ledger", "domain.states"),
        ("store.ledger", "sqlalchemy"),
        ("providers.stripe", "domain.states"),
        ("domain.states", "orjson"),
    ]:
        graph.add_import(
            importer=f"intentledger.{importer}",
            imported=imported if imported in EXTERNALS else f"intentledger.{imported}",
        )
    return graph


def test_the_contracts_allow_the_layering_they_describe() -> None:
    assert _broken(_layered_package()) == set()


# An import up the layers against one down them is a cycle between packages too.
@pytest.mark.parametrize(
    ("importer", "imported", "contracts"),
    [
        ("intentledger.domain.states", "intentledger.store.tables", {"layers", "acyclic"}),
        ("intentledger.engine.refusal", "intentledger.web.problems", {"layers", "acyclic"}),
        ("intentledger.store.ledger", "intentledger.observability.metrics", {"layers"}),
        ("intentledger.store.ledger", "intentledger.providers.stripe", {"layers"}),
        ("intentledger.api.app", "intentledger.console.pages", {"layers"}),
        ("intentledger.domain.states", "sqlalchemy", {"pure-domain"}),
        ("intentledger.ops_cli", "intentledger.console.pages", {"command-line"}),
        ("intentledger.cli", "intentledger.api.app", {"command-line"}),
        ("intentledger.console.pages", "intentledger.store.ledger", {"no-store-in-entry-points"}),
        ("intentledger.store.ledger", "intentledger.store.announcements", {"acyclic"}),
    ],
)
def test_each_contract_fails_on_an_import_it_forbids(
    importer: str, imported: str, contracts: set[str]
) -> None:
    graph = _layered_package()
    graph.add_import(importer=importer, imported=imported)
    assert _broken(graph) == contracts


def test_a_new_top_level_module_must_be_given_a_layer() -> None:
    graph = _layered_package()
    graph.add_module("intentledger.unplaced")
    assert _broken(graph) == {"layers"}


def _cycle_through(package: str, graph: grimp.ImportGraph) -> list[str] | None:
    """A chain by which the package's __init__ imports itself through its own
    modules, if there is one: acyclic_siblings compares a package's children
    with each other, never the package with them."""
    inside = graph.find_descendants(package) | {package}
    came_from: dict[str, str] = {}
    frontier = [package]
    while frontier:
        module = frontier.pop(0)
        for imported in sorted(graph.find_modules_directly_imported_by(module) & inside):
            if imported == package:
                chain = [module]
                while chain[-1] != package:
                    chain.append(came_from[chain[-1]])
                return [*reversed(chain), package]
            if imported not in came_from:
                came_from[imported] = module
                frontier.append(imported)
    return None


def _cycles_through_packages(graph: grimp.ImportGraph) -> dict[str, list[str]]:
    return {
        package: chain
        for package in sorted(graph.modules)
        if graph.find_children(package) and (chain := _cycle_through(package, graph))
    }


def test_no_package_imports_itself_through_its_own_modules() -> None:
    origin = importlib.util.find_spec("intentledger")
    assert origin is not None and origin.origin == str(PACKAGE / "__init__.py"), origin
    assert _cycles_through_packages(grimp.build_graph("intentledger", cache_dir=None)) == {}


def test_the_package_cycle_check_sees_a_cycle_through_an_init() -> None:
    graph = grimp.ImportGraph()
    for module in ("sandbox", "sandbox.app", "sandbox.rows", "sandbox.store"):
        graph.add_module(f"intentledger.{module}")
    graph.add_import(importer="intentledger.sandbox", imported="intentledger.sandbox.app")
    graph.add_import(importer="intentledger.sandbox.app", imported="intentledger.sandbox.rows")
    graph.add_import(importer="intentledger.sandbox.store", imported="intentledger.sandbox.rows")
    assert _cycles_through_packages(graph) == {}
    graph.add_import(importer="intentledger.sandbox.rows", imported="intentledger.sandbox")
    assert _cycles_through_packages(graph) == {
        "intentledger.sandbox": [
            "intentledger.sandbox",
            "intentledger.sandbox.app",
            "intentledger.sandbox.rows",
            "intentledger.sandbox",
        ]
    }


def _sql_built(module: Module) -> Iterator[str]:
    """Where the module builds SQL: a statement constructor taken from
    SQLAlchemy (by name or through the module), or a table's own
    insert()/update()/delete()/select() on a table from store/tables.py."""
    constructors: set[str] = set()
    sqlalchemy_aliases: set[str] = set()
    tables: set[str] = set()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            if _within(node.module, "sqlalchemy"):
                constructors |= {
                    alias.asname or alias.name for alias in node.names if alias.name in SQL_BUILDERS
                }
            if node.module == "intentledger.store.tables":
                tables |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            sqlalchemy_aliases |= {
                alias.asname or alias.name
                for alias in node.names
                if _within(alias.name, "sqlalchemy")
            }
    for node in ast.walk(module.tree):
        if not isinstance(node, ast.Call):
            continue
        where = f"{module.path.relative_to(PACKAGE.parent)}:{node.lineno}"
        func = node.func
        if isinstance(func, ast.Name) and func.id in constructors:
            yield f"{where} calls {func.id}()"
        elif isinstance(func, ast.Attribute) and func.attr in SQL_BUILDERS:
            owner = func.value
            while isinstance(owner, ast.Attribute):
                owner = owner.value
            if isinstance(owner, ast.Name) and owner.id in sqlalchemy_aliases | tables:
                yield f"{where} calls {ast.unparse(func)}()"


def test_sql_is_built_only_in_the_store() -> None:
    outside = [module for module in MODULES if not _within(module.name, "intentledger.store")]
    assert [found for module in outside for found in _sql_built(module)] == []


def test_the_sql_check_finds_every_form_of_building_a_statement() -> None:
    """The detector is not blind: it sees the statements store/ builds, and each
    spelling a module elsewhere could use."""
    store = [module for module in MODULES if _within(module.name, "intentledger.store")]
    assert any("work_queue.py" in where for module in store for where in _sql_built(module))
    source = """
import sqlalchemy as sa
from sqlalchemy import select as pick
from sqlalchemy.dialects.sqlite import insert
from intentledger.store.tables import outbox

pick(outbox)
insert(outbox)
sa.text("SELECT 1")
outbox.update()
outbox.c.id.in_([1])
"""
    probe = Module("intentledger.engine.probe", PACKAGE / "engine" / "probe.py", ast.parse(source))
    assert [where.split(" ", 1)[1] for where in _sql_built(probe)] == [
        "calls pick()",
        "calls insert()",
        "calls sa.text()",
        "calls outbox.update()",
    ]
