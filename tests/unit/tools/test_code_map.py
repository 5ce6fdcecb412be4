"""The map of the code stays true: package docstrings, cited paths and logger names
(issue #41, item 5).

docs/design/layout.md promises that each package's ``__init__.py`` docstring says what the
package owns, its invariants and what it may import, and names every module in it; the
strict docs build checks links, but not the module and test paths that code comments,
docstrings and the docs pages cite in code spans (``tests/unit/core/test_pool.py``,
``kvtierd.tiers.fs.ioworker``); and a logger named by hand keeps its name when its module
moves. These tests find what a move or a rename left behind.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
ROOTS = (REPO / "kvtierd", REPO / "client" / "kvtierd_client")
GENERATED = "_proto"  # kvtierd_client._proto: stubs generated at build time, not sources


def packages() -> list[Path]:
    """Every package directory of the daemon and the client (generated stubs left out)."""
    found = []
    for root in ROOTS:
        for init in sorted(root.rglob("__init__.py")):
            if GENERATED not in init.relative_to(root).parts[:-1]:
                found.append(init.parent)
    return found


def dotted(directory: Path) -> str:
    base = REPO / "client" if directory.is_relative_to(REPO / "client") else REPO
    return ".".join(directory.relative_to(base).parts)


def members(package: Path) -> list[str]:
    """The package's modules (``__main__`` included) and subpackages, by their short name."""
    names = [p.stem for p in package.glob("*.py") if p.name != "__init__.py"]
    names += [p.name for p in package.iterdir() if (p / "__init__.py").is_file()]
    return sorted(names)


def docstring(package: Path) -> str:
    return ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""


def code_spans(text: str) -> list[str]:
    """What a docstring writes as code: ````x````, ``:mod:`x```, ```x```."""
    return [a or b for a, b in re.findall(r"``([^`]+)``|`([^`]+)`", text)]


def names_member(spans: list[str], package: str, member: str) -> bool:
    """A span names ``member`` as itself, ``.member`` or ``package.member`` (or a name in it)."""
    pattern = re.compile(rf"(?:\.|{re.escape(package)}\.)?{re.escape(member)}(?:[.(].*)?")
    return any(pattern.fullmatch(span.strip()) for span in spans)


PACKAGES = packages()


@pytest.mark.parametrize("package", PACKAGES, ids=dotted)
def test_every_module_of_a_package_is_named_in_its_docstring(package: Path) -> None:
    name, doc = dotted(package), docstring(package)
    spans = code_spans(doc)
    unnamed = [m for m in members(package) if not names_member(spans, name, m)]
    assert not unnamed, (
        f"{name}'s docstring ({package.relative_to(REPO)}/__init__.py) does not name "
        f"{unnamed}: give each a line saying what it is for (docs/design/layout.md)"
    )


@pytest.mark.parametrize("package", PACKAGES, ids=dotted)
def test_every_package_docstring_states_its_invariants_and_imports(package: Path) -> None:
    doc = docstring(package)
    assert doc.split("\n\n")[0].strip(), f"{dotted(package)}: no first paragraph (what it owns)"
    words = " ".join(doc.split())
    assert "Invariant" in words, f"{dotted(package)}: no invariants in its docstring"
    assert "May import" in words, f"{dotted(package)}: no word on what it may import"


def test_a_module_left_unnamed_is_found() -> None:
    spans = code_spans("- ``pool``: one pool;\n- :mod:`.sessions` and ``kvtierd.core.claims``")
    assert names_member(spans, "kvtierd.core", "pool")
    assert names_member(spans, "kvtierd.core", "sessions")
    assert names_member(spans, "kvtierd.core", "claims")
    assert not names_member(spans, "kvtierd.core", "pools")  # ``pool`` is not ``pools``
    assert not names_member(code_spans("``kvtierd_client.wire``"), "kvtierd.api", "wire")


# Cited paths. A path: one of the repository's top folders, then a file with an extension.
# A dotted name: a module of the daemon or the client, then perhaps names defined in it.
PATH = re.compile(
    r"(?<![\w/.-])((?:kvtierd|client|tests|tools|benchmarks|deploy|docs|proto)"
    r"/[\w/.-]*\.(?:py|md|proto|ya?ml|toml|json|jsonl|sh|txt|service))\b"
)
DOTTED = re.compile(r"(?<![\w/.-])(kvtierd(?:_client)?(?:\.\w+)+)")
# Names that look dotted but are files and hosts: kvtierd.sock, kvtierd.toml,
# deploy/systemd/kvtierd.service, kvtierd.log, kvtierd.svc.cluster.local.
NOT_MODULES = {"sock", "toml", "service", "log", "svc"}
# Another project's file, cited as such: vLLM's ``tests/v1/kv_offload/...``.
OTHER_PROJECT = re.compile(r"(?:vLLM|SGLang)'s\W{0,3}$")


def python_sources() -> list[Path]:
    found = []
    for top in ("kvtierd", "client/kvtierd_client", "tests", "tools", "benchmarks"):
        found += [p for p in (REPO / top).rglob("*.py") if GENERATED not in p.parts]
    return sorted(found)


def live_documents() -> list[Path]:
    """The docs site's pages and the README (CHANGELOG.md is history: it cites what was)."""
    return [*sorted((REPO / "docs").rglob("*.md")), REPO / "README.md"]


def prose(path: Path) -> str:
    """What a file says in words: a Python file's comments and strings (docstrings
    included), any other file whole."""
    if path.suffix != ".py":
        return path.read_text()
    kept = (tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1))
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return "\n".join(token.string for token in tokens if token.type in kept)


def citations(text: str) -> Iterator[str]:
    """The module and file paths ``text`` cites, as written."""
    for match in PATH.finditer(text):
        if not OTHER_PROJECT.search(text[max(0, match.start() - 12) : match.start()]):
            yield match.group(1)
    for match in DOTTED.finditer(text):
        name = match.group(1)
        if name.split(".")[1] not in NOT_MODULES:
            yield name


@cache
def defined_names(module: Path) -> frozenset[str]:
    """Every name a module binds anywhere: its functions, classes, assignments, imports
    and attributes (what ``module.Name.attr`` may cite)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return frozenset(names)


def module_file(parts: list[str]) -> Path | None:
    base = REPO / "client" if parts[0] == "kvtierd_client" else REPO
    path = base.joinpath(*parts)
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def resolves(cited: str, where: Path) -> bool:
    """A path is a file of the repository (or, on a docs page, beside that page: a link);
    a dotted name is a module, or names defined in its longest module prefix."""
    if "/" in cited:
        beside = where.suffix == ".md" and (where.parent / cited).exists()  # a page's link
        return (REPO / cited).exists() or beside
    name = cited.rstrip(".")
    if name in interface_logger_names():
        return True
    parts = name.split(".")
    for length in range(len(parts), 0, -1):
        module = module_file(parts[:length])
        if module is not None:
            rest = [a for a in parts[length:] if not a.startswith("__")]  # __file__...
            return all(attr in defined_names(module) for attr in rest)
    return False


def dangling(sources: list[Path]) -> list[str]:
    found = []
    for source in sources:
        for cited in citations(prose(source)):
            if not resolves(cited, source):
                where = source.relative_to(REPO) if source.is_relative_to(REPO) else source
                found.append(f"{where}: {cited}")
    return sorted(set(found))


def test_every_module_and_test_path_cited_in_code_exists() -> None:
    here = Path(__file__).resolve()  # its examples dangle on purpose
    sources = [p for p in python_sources() if p != here]
    sources += [REPO / "Makefile", REPO / "pyproject.toml"]
    sources.append(REPO / "proto" / "kvtier" / "v1" / "kvtier.proto")
    assert dangling(sources) == []


def test_every_module_and_test_path_cited_in_the_docs_exists() -> None:
    assert dangling(live_documents()) == []


def test_a_dangling_citation_is_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "See `tests/unit/test_pool.py` and `kvtierd.primary.warm.journal.row_checksum`;\n"
        "`tests/unit/core/test_pool.py`, `kvtierd.primary.warm.rowsums.row_checksum`,\n"
        "``python -m kvtierd.tiers.fs.ioworker``, `kvtierd.sock`, vLLM's\n"
        "``tests/v1/kv_offload/cpu/test_manager.py`` and the logger `kvtierd.audit` resolve.\n"
    )
    assert [d.split(": ")[1] for d in dangling([page])] == [
        "kvtierd.primary.warm.journal.row_checksum",
        "tests/unit/test_pool.py",
    ]


def test_a_python_file_cites_in_its_comments_and_strings_only(tmp_path: Path) -> None:
    """``kvtierd.address`` as an attribute of a variable is code, not a citation."""
    source = tmp_path / "source.py"
    source.write_text('kvtierd.address = 1  # kvtierd.nothing\nx = "tests/none.py"\n')
    assert list(citations(prose(source))) == ["tests/none.py", "kvtierd.nothing"]


# Logger names: a module logs as itself (``logging.getLogger(__name__)``), unless its
# logger's name is an interface, listed in the operations docs' table.
LOGGING_PAGE = REPO / "docs" / "operations" / "troubleshooting.md"


@cache
def interface_logger_names() -> frozenset[str]:
    """The names of the "Logger names" table (its rows' first cells); none without it."""
    section = re.search(r"^### Logger names\n(.*?)(?=^#|\Z)", LOGGING_PAGE.read_text(), re.M | re.S)
    rows = section.group(1) if section else ""
    return frozenset(re.findall(r"^\| `([\w.]+)` \|", rows, re.MULTILINE))


def module_name(path: Path) -> str:
    name = dotted(path.with_suffix(""))
    return name.removesuffix(".__init__")


def logger_names(source: str, module: str) -> list[str]:
    """The names of the loggers ``source`` gets (``getLogger(__name__)`` is ``module``; a
    module-level constant is read; anything else is not this project's to name)."""
    tree = ast.parse(source)
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    names = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        function = node.func
        called = function.attr if isinstance(function, ast.Attribute) else None
        if (called or getattr(function, "id", "")) != "getLogger":
            continue
        argument = node.args[0]
        if isinstance(argument, ast.Constant):
            names.append(argument.value)
        elif isinstance(argument, ast.Name) and argument.id == "__name__":
            names.append(module)
        elif isinstance(argument, ast.Name) and argument.id in constants:
            names.append(constants[argument.id])
    return names


def misnamed_loggers(sources: list[Path]) -> list[str]:
    found = []
    for path in sources:
        module = module_name(path)
        for name in logger_names(path.read_text(), module):
            ours = isinstance(name, str) and name.split(".")[0] in ("kvtierd", "kvtierd_client")
            if ours and name != module and name not in interface_logger_names():
                found.append(f"{path.relative_to(REPO)}: {name!r}")
    return found


def project_modules() -> list[Path]:
    return [p for p in python_sources() if p.is_relative_to(REPO / "kvtierd")
            or p.is_relative_to(REPO / "client")]  # fmt: skip


def test_every_logger_is_named_after_its_module_or_is_an_interface() -> None:
    assert misnamed_loggers(project_modules()) == [], (
        "use logging.getLogger(__name__), or list the name in the table of "
        f"{LOGGING_PAGE.relative_to(REPO)}#logger-names if operators depend on it"
    )


def test_every_interface_logger_name_is_used_and_is_no_module() -> None:
    used = {
        name
        for path in project_modules()
        for name in logger_names(path.read_text(), module_name(path))
    }
    assert interface_logger_names(), "the table of logger names is missing"
    for name in interface_logger_names():
        assert name in used, f"{name} is in the table but no module logs under it"
        assert module_file(name.split(".")) is None, f"{name} is a module's own name"


def test_a_logger_named_off_its_module_is_found(tmp_path: Path) -> None:
    source = (
        'import logging\nlog = logging.getLogger("kvtierd.service")\n'
        'GRPC = "grpc"\nlogging.getLogger(GRPC)\naudit = logging.getLogger("kvtierd.audit")\n'
        "mine = logging.getLogger(__name__)\n"
    )
    assert logger_names(source, "kvtierd.api.handlers") == [
        "kvtierd.service", "grpc", "kvtierd.audit", "kvtierd.api.handlers"
    ]  # fmt: skip
    module = REPO / "kvtierd" / "api" / "handlers.py"
    assert module_name(module) == "kvtierd.api.handlers"
    assert module_name(REPO / "client" / "kvtierd_client" / "__init__.py") == "kvtierd_client"
