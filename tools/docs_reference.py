"""The generated parts of the docs site: the configuration reference's tables, made
from the option declarations in the code, never copied by hand.

A page asks for a table with a marker line of its own::

    <!-- generated: options server -->      the [server] keys of kvtierd.config.OPTIONS
    <!-- generated: tier fs -->             a tier type's options (kvtierd.tiers.registry)
    <!-- generated: principals -->          the keys of [[security.principals]]
    <!-- generated: alerts -->              the rules of deploy/prometheus/alerts.yml
    <!-- generated: packages kvtierd -->     each package's docstring, first paragraph
    <!-- generated: contracts -->           pyproject.toml's import-linter contracts

``render(markdown)`` replaces every marker with its table; an unknown marker raises
``ValueError`` (the docs build stops). The MkDocs hook ``docs/hooks/generated.py`` runs
it on every page; the tests read the pages through it (``tests/unit/tools/test_docs.py``).

The sources: ``kvtierd.config.OPTIONS`` (every scalar key: section, key, parser, default,
help, flag; the ``[security]`` file keys come from ``kvtierd.security.config``), each
tier type's table of options in ``kvtierd.tiers.registry`` (``TierType.options``: the
fields of its settings dataclass), ``kvtierd.security.principals.PRINCIPAL_HELP`` and the
shipped alerting rules (``deploy/prometheus/alerts.yml``), the packages' own docstrings and
``pyproject.toml``'s ``[tool.importlinter]`` contracts.

Importing this module imports the daemon's configuration modules only (they need the
standard library and ``grpc``), so the docs toolchain's small venv can run it.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO / "client", REPO):  # a checkout, importable without an install
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from kvtierd import config  # noqa: E402
from kvtierd.security import principals  # noqa: E402
from kvtierd.tiers import registry  # noqa: E402
from kvtierd.util.units import format_size  # noqa: E402

MARKER = re.compile(r"^<!-- generated: ([a-z]+)(?: ([a-z_]+))? -->$", re.MULTILINE)

# Defaults that depend on the machine the daemon runs on, as the reference words them.
MACHINE_DEFAULTS = {
    ("server", "listen"): '`["unix://<default socket>"]` (see [Getting started]'
    "(../getting-started.md#what-make-run-serves))",
}


def toml_default(option: config.Option) -> str:
    """The default of a scalar option as it is written in a TOML file: ``"1GiB"``,
    ``"10s"``, ``true``, ``64``, ``"/dev/shm"``, ``""``, ``"auto"``."""
    value = option.default()
    if value is None:  # decided at start: the option's "auto"
        if option.parse("auto") is not None:
            raise ValueError(f"{option.dotted}: a default of None must be what 'auto' parses to")
        return '"auto"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):  # every float option is a duration in seconds
        return f'"{value:g}s"'
    if isinstance(value, int) and _takes_units(option, value):
        return f'"{format_size(value)}"'
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return "[" + ", ".join(f'"{item}"' for item in value) + "]"
    return str(value)


def _takes_units(option: config.Option, value: int) -> bool:
    """Whether the option's parser reads a size with a unit (``"1GiB"``), not a count."""
    try:
        return bool(option.parse(format_size(value)) == value) and format_size(value) != str(value)
    except ValueError:
        return False


def options_table(section: str) -> str:
    """The keys of one section of ``kvtierd.config.OPTIONS``: its name in the section
    and in full (``sessions.lease``, as messages and ``--help`` write it, and as a
    search finds it), default, flag and environment variable, meaning."""
    rows = ["| key | default | flag / environment | meaning |", "|---|---|---|---|"]
    chosen = [o for o in config.OPTIONS if o.section == section]
    if not chosen:
        raise ValueError(f"no options in section {section!r}; sections: {config.SECTIONS}")
    for option in chosen:
        default = MACHINE_DEFAULTS.get((option.section, option.key)) or (
            f"`{toml_default(option)}`"
        )
        flag = f"`{option.flag}`" if option.flag else "–"
        if option.repeatable:
            flag += " (repeatable)"
        rows.append(
            f"| `{option.key}`<br>`{option.dotted}` | {default} | {flag}<br>`{option.env}` "
            f"| {_cell(option.help)} |"
        )
    return "\n".join(rows) + "\n"


def tier_table(tier_type: str) -> str:
    """A tier type's options (besides ``type`` and ``name``): default, meaning. An
    unknown type raises UnknownTierType naming the supported ones."""
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for option in registry.lookup(tier_type).options:
        shown = option.default_text()
        default = f"`{shown}`" if shown else "required"
        rows.append(f"| `{option.key}` | {default} | {_cell(option.help)} |")
    return "\n".join(rows) + "\n"


def principals_table() -> str:
    """The keys of one ``[[security.principals]]`` table."""
    rows = ["| key | meaning |", "|---|---|"]
    for key, text in principals.PRINCIPAL_HELP.items():
        rows.append(f"| `{key}` | {_cell(text)} |")
    return "\n".join(rows) + "\n"


def alerts_table() -> str:
    """The shipped Prometheus alerting rules: name, severity, how long the condition
    must hold, and what the rule's description tells the operator."""
    import yaml  # PyYAML: a dependency of MkDocs, and of the dev extra

    document = yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())
    rows = ["| alert | severity | for | what it means |", "|---|---|---|---|"]
    for group in document["groups"]:
        for rule in group["rules"]:
            notes = rule.get("annotations", {})
            text = " ".join(str(notes.get("description") or notes.get("summary", "")).split())
            severity = rule.get("labels", {}).get("severity", "")
            rows.append(
                f"| `{rule['alert']}` | {severity} | {rule.get('for', '–')} | {_cell(text)} |"
            )
    return "\n".join(rows) + "\n"


def packages_table(root: str) -> str:
    """Every package under ``root`` (``kvtierd`` or ``kvtierd_client``) with the first
    paragraph of its ``__init__.py`` docstring, read without importing it."""
    base = REPO / ("client" if root == "kvtierd_client" else "") / root
    if not (base / "__init__.py").is_file():
        raise ValueError(f"no package {root!r} at {base}")
    rows = ["| package | what it owns |", "|---|---|"]
    for init in sorted(base.rglob("__init__.py")):
        package = ".".join(init.parent.relative_to(base.parent).parts)
        if "_proto" in package.split("."):
            continue  # generated stubs
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        first = " ".join(doc.split("\n\n")[0].split())
        if not first:
            raise ValueError(f"package {package} has no docstring ({init})")
        rows.append(f"| `{package}` | {_cell(first)} |")
    return "\n".join(rows) + "\n"


def contracts_table() -> str:
    """``pyproject.toml``'s import-linter contracts, as ``make lint`` checks them."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib

    linter = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    rows = ["| contract | kind | what it says |", "|---|---|---|"]
    for contract in linter["contracts"]:
        kind = contract["type"]
        if kind == "layers":
            said = "top to bottom, each may import only the ones below it: " + " > ".join(
                f"`{layer}`" for layer in contract["layers"]
            )
            if contract.get("containers"):
                every = " (every one placed)" if contract.get("exhaustive") else ""
                inside = ", ".join(f"`{c}`" for c in contract["containers"])
                said = f"the modules of {inside}{every}, " + said
        elif kind == "forbidden":
            said = (
                ", ".join(f"`{m}`" for m in contract["source_modules"])
                + " may not import "
                + ", ".join(f"`{m}`" for m in contract["forbidden_modules"])
            )
            if contract.get("ignore_imports"):
                said += " (except " + ", ".join(f"`{i}`" for i in contract["ignore_imports"]) + ")"
        elif kind == "independence":
            said = (
                ", ".join(f"`{m}`" for m in contract["modules"]) + " import nothing of each other"
            )
        elif kind == "acyclic_siblings":
            said = "no import cycle between the sibling modules and packages below " + ", ".join(
                f"`{a}`" for a in contract["ancestors"]
            )
        else:
            said = f"an import-linter contract of type `{kind}`"
        rows.append(f"| {_cell(contract['name'])} | `{kind}` | {said} |")
    return "\n".join(rows) + "\n"


def _cell(text: str) -> str:
    """Help text as one Markdown table cell: its pipes escaped, and ``<`` / ``>`` shown
    as written (``'<socket>.lane'`` is text, not an HTML tag)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")


GENERATORS: dict[str, Callable[..., str]] = {
    "options": options_table,
    "tier": tier_table,
    "principals": principals_table,
    "alerts": alerts_table,
    "packages": packages_table,
    "contracts": contracts_table,
}


def render(markdown: str) -> str:
    """``markdown`` with every ``<!-- generated: ... -->`` marker replaced by its table."""

    def table(match: re.Match[str]) -> str:
        name, argument = match.group(1), match.group(2)
        generator = GENERATORS.get(name)
        if generator is None:
            raise ValueError(f"unknown generated table {match.group(0)}; known: {list(GENERATORS)}")
        arguments: list[Any] = [argument] if argument else []
        return generator(*arguments).rstrip("\n")

    return MARKER.sub(table, markdown)


def markers(markdown: str) -> list[tuple[str, str | None]]:
    """The (name, argument) of every marker in ``markdown``, in order."""
    return [(m.group(1), m.group(2)) for m in MARKER.finditer(markdown)]


if __name__ == "__main__":  # python tools/docs_reference.py docs/reference/configuration.md
    for name in sys.argv[1:]:
        print(render(Path(name).read_text()))
