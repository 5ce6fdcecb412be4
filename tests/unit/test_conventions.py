"""Rules of the code base checked by reading its source (``ast``), not by running it.

* **Injected clocks are used.** A class whose ``__init__`` takes a ``clock`` reads
  the time through it only: no ``time.monotonic`` / ``time.time`` /
  ``time.perf_counter`` (or their ``_ns`` forms) anywhere in the class, called or
  passed on, except as ``__init__``'s default for ``clock``. Otherwise a test on a
  fake clock (``tests/fake_clock.py``) moves one clock while the class reads another,
  and a timeout is tested by sleeping. The exceptions, each with its reason, are
  :data:`CLOCK_EXCEPTIONS`.
* **Unit tests never sleep for time.** In ``tests/unit`` no ``time.sleep`` or
  ``asyncio.sleep`` with anything but a literal 0 (a turn of the event loop): a test
  moves a fake clock, or waits for a condition (``daemon_harness.eventually``,
  ``eventually_async``). The exceptions, each with its reason, are
  :data:`SLEEP_EXCEPTIONS`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = (REPO / "kvtierd", REPO / "client" / "kvtierd_client")
GENERATED = REPO / "client" / "kvtierd_client" / "_proto"
UNIT_TESTS = REPO / "tests" / "unit"

CLOCK_READS = frozenset(
    {"monotonic", "monotonic_ns", "time", "time_ns", "perf_counter", "perf_counter_ns"}
)

# (file, class, method, time function) -> why that read is not the class's clock
CLOCK_EXCEPTIONS: dict[tuple[str, str, str, str], str] = {
    ("kvtierd/tiers/redis/link.py", "RedisLink", "pipelined", "perf_counter"): (
        "a round trip measured for the round_trip_us statistic; never compared with the clock"
    ),
    ("kvtierd/tiers/redis/link.py", "RedisLink", "_node_health", "perf_counter"): (
        "a PING's round trip measured for the round_trip_us statistic"
    ),
    ("client/kvtierd_client/sglang/storage.py", "KvtierdStorage", "batch_get_v1", "perf_counter"): (
        "a transfer's duration for the throughput counters"
    ),
    ("client/kvtierd_client/sglang/storage.py", "KvtierdStorage", "batch_set_v1", "perf_counter"): (
        "a transfer's duration for the throughput counters"
    ),
}

SLEEP_MODULES = frozenset({"time", "asyncio"})
# (file, function) -> why that test must let real time pass
SLEEP_EXCEPTIONS: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    scope: tuple[str, str]  # (class, function) or (function, "")
    what: str  # "time.monotonic", "asyncio.sleep"

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what} in {'.'.join(filter(None, self.scope))}"


def python_files(*roots: Path) -> Iterator[Path]:
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if GENERATED not in path.parents:
                yield path


def module_names(
    tree: ast.Module, modules: frozenset[str]
) -> tuple[dict[str, str], dict[str, str]]:
    """The names ``modules`` are bound to in ``tree`` (``import time as t``: t ->
    time), and the names of functions imported from them (``from time import
    sleep``: sleep -> time.sleep)."""
    aliases: dict[str, str] = {}
    functions: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module in modules and node.level == 0:
            for alias in node.names:
                functions[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases, functions


def named(node: ast.AST, aliases: dict[str, str], functions: dict[str, str]) -> str | None:
    """``"time.monotonic"`` when ``node`` names a function of the modules looked for."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        module = aliases.get(node.value.id)
        return f"{module}.{node.attr}" if module is not None else None
    if isinstance(node, ast.Name):
        return functions.get(node.id)
    return None


def takes_clock(cls: ast.ClassDef) -> ast.FunctionDef | None:
    """The class's ``__init__`` when it has a parameter named ``clock``."""
    for item in cls.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            params = item.args.posonlyargs + item.args.args + item.args.kwonlyargs
            if any(param.arg == "clock" for param in params):
                return item
    return None


def clock_bypasses(path: Path, root: Path = REPO) -> list[Finding]:
    """Every read of the time module's clocks inside a class that takes a clock,
    outside ``__init__``'s defaults (paths relative to ``root``)."""
    tree = ast.parse(path.read_text(), str(path))
    aliases, functions = module_names(tree, frozenset({"time"}))
    rel = path.relative_to(root).as_posix()
    findings = []
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        init = takes_clock(cls)
        if init is None:
            continue
        defaults = {
            id(node)
            for default in (*init.args.defaults, *init.args.kw_defaults)
            if default is not None
            for node in ast.walk(default)
        }
        for method in cls.body:
            for node in ast.walk(method):
                what = named(node, aliases, functions)
                if what is None or what.split(".")[1] not in CLOCK_READS or id(node) in defaults:
                    continue
                scope = method.name if isinstance(method, ast.FunctionDef) else ""
                findings.append(Finding(rel, node.lineno, (cls.name, scope), what))
    return findings


def sleeps_for_time(path: Path, root: Path = REPO) -> list[Finding]:
    """Every ``time.sleep`` / ``asyncio.sleep`` in ``path`` whose argument is not a
    literal 0, with the function it is in (paths relative to ``root``)."""
    tree = ast.parse(path.read_text(), str(path))
    aliases, functions = module_names(tree, SLEEP_MODULES)
    rel = path.relative_to(root).as_posix()
    findings = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function = function or node.name  # the test (or helper), not a nested def
        if isinstance(node, ast.Call) and named(node.func, aliases, functions) in {
            "time.sleep",
            "asyncio.sleep",
        }:
            first = node.args[0] if node.args else None
            if not (isinstance(first, ast.Constant) and first.value == 0):
                what = named(node.func, aliases, functions) or "sleep"
                findings.append(Finding(rel, node.lineno, (function, ""), what))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "")
    return findings


def test_classes_that_take_a_clock_read_no_other():
    findings = [f for path in python_files(*SOURCES) for f in clock_bypasses(path)]
    allowed = {f for f in findings if (f.path, *f.scope, f.what.split(".")[1]) in CLOCK_EXCEPTIONS}
    bypasses = [str(f) for f in findings if f not in allowed]
    assert not bypasses, (
        "classes that take clock= read another clock (use self._clock(), or list the read "
        "in CLOCK_EXCEPTIONS with its reason):\n" + "\n".join(bypasses)
    )
    stale = set(CLOCK_EXCEPTIONS) - {(f.path, *f.scope, f.what.split(".")[1]) for f in allowed}
    assert not stale, f"CLOCK_EXCEPTIONS that no longer match any read: {sorted(stale)}"


def test_unit_tests_do_not_sleep_for_time():
    findings = [f for path in python_files(UNIT_TESTS) for f in sleeps_for_time(path)]
    sleeps = [str(f) for f in findings if (f.path, f.scope[0]) not in SLEEP_EXCEPTIONS]
    assert not sleeps, (
        "unit tests sleep for time (move a FakeClock, or wait for a condition with "
        "daemon_harness.eventually / eventually_async):\n" + "\n".join(sleeps)
    )
    stale = set(SLEEP_EXCEPTIONS) - {(f.path, f.scope[0]) for f in findings}
    assert not stale, f"SLEEP_EXCEPTIONS that no longer match any sleep: {sorted(stale)}"


def test_the_checks_find_what_they_look_for(tmp_path):
    """Each check, on a sample: a bypassed clock and a sleep are found; the default,
    the injected clock, a sleep of 0 are not."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import asyncio\n"
        "import time as t\n"
        "from time import monotonic, sleep\n"
        "class Timed:\n"
        "    def __init__(self, clock=t.monotonic):\n"
        "        self._clock = clock\n"
        "        self._wall = t.time\n"  # passed on: a bypass too
        "    def due(self):\n"
        "        return self._clock() > monotonic()\n"
        "class Plain:\n"
        "    def now(self):\n"
        "        return t.monotonic()\n"  # no clock taken: not this rule's
        "async def test_waits():\n"
        "    sleep(0.1)\n"
        "    await asyncio.sleep(0)\n"
        "    await asyncio.sleep(0.5)\n"
    )
    clocks = [(f.line, f.scope, f.what) for f in clock_bypasses(sample, tmp_path)]
    sleeps = [(f.line, f.scope[0], f.what) for f in sleeps_for_time(sample, tmp_path)]
    assert clocks == [
        (7, ("Timed", "__init__"), "time.time"),
        (9, ("Timed", "due"), "time.monotonic"),
    ]
    assert sleeps == [(14, "test_waits", "time.sleep"), (16, "test_waits", "asyncio.sleep")]
