"""The package's layering, read from its source: which module imports which,
and where SQL is written.

- The API (api/) and the operator console (console/) are siblings over the
  engine: neither imports the other, and neither imports the store; what both
  need lies below them (web/, the engine, the domain). The composition root
  (intentledger/app.py) mounts them together.
- Providers are handed plain configuration and are timed where they are built:
  they import neither the settings nor observability.
- Every SQL statement is built in store/ (migrations included); the workshop
  that leaves the package (bench/, chaos.py, demo.py) is not held to it.

Imports are parsed with `ast` from the files under src/, so nothing is imported
to check them and an import inside a function counts like any other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "intentledger"
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


def _is_package(module: Module) -> bool:
    return module.path.name == "__init__.py"


def _imports(module: Module) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import, relative ones resolved; for
    `from x import y` both x and x.y are named (y may be a module)."""
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.name.split(".")
                if not _is_package(module):
                    package = package[:-1]
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _offences(importer: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        {
            f"{module.path.relative_to(PACKAGE.parent)}:{line} imports {imported}"
            for module in MODULES
            if _within(module.name, importer)
            for line, imported in _imports(module)
            if any(_within(imported, prefix) for prefix in forbidden)
        }
    )


def test_the_parser_sees_the_package() -> None:
    """The checks below are not vacuous: they read the real modules and their imports."""
    names = {module.name for module in MODULES}
    assert {"intentledger.api.app", "intentledger.console.pages", "intentledger.store"} <= names
    pages = next(module for module in MODULES if module.name == "intentledger.console.pages")
    assert any(_within(imported, "intentledger.engine") for _, imported in _imports(pages))


@pytest.mark.parametrize(
    ("importer", "forbidden"),
    [
        ("intentledger.api", ("intentledger.console",)),
        ("intentledger.console", ("intentledger.api",)),
    ],
)
def test_the_api_and_the_console_are_siblings(importer: str, forbidden: tuple[str, ...]) -> None:
    assert _offences(importer, forbidden) == []


@pytest.mark.parametrize("entry_point", ["intentledger.api", "intentledger.console"])
def test_entry_points_read_through_the_engine_not_the_store(entry_point: str) -> None:
    assert _offences(entry_point, ("intentledger.store",)) == []


def test_providers_get_plain_configuration_and_are_timed_where_they_are_built() -> None:
    forbidden = ("intentledger.settings", "intentledger.observability")
    assert _offences("intentledger.providers", forbidden) == []


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
