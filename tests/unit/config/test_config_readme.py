"""The README's configuration example (README "Configuration", the first ``toml``
block) documents every option of ``kvtierd.config.OPTIONS`` in its section, and
loads as it is written (the tables of the fs and redis options are checked by
their own tests)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from kvtierd.config import OPTIONS, load_config

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

README = Path(__file__).resolve().parents[3] / "README.md"


def example() -> str:
    text = README.read_text()
    section = text[text.index("## Configuration") :]
    found = re.search(r"```toml\n(.*?)```", section, re.S)
    assert found is not None
    return found.group(1)


def test_the_readme_example_sets_every_option_in_its_section():
    document = tomllib.loads(example())
    missing = [o.dotted for o in OPTIONS if o.key not in document.get(o.section, {})]
    assert missing == [], f"README's configuration example lacks {missing}"


def test_the_readme_example_loads(tmp_path):
    path = tmp_path / "example.toml"
    path.write_text(example())
    config = load_config(str(path), env={})
    assert config.server.metrics_pool_labels is None  # "auto", as the example says
