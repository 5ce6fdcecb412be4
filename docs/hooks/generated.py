"""MkDocs hook (mkdocs.yml ``hooks:``): replaces each ``<!-- generated: ... -->`` marker
of a page with the table the code declares (``tools/docs_reference.py``), so the
configuration reference is generated from the option tables at every build and never
copied by hand. An unknown marker stops the build."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.docs_reference import render  # noqa: E402


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return render(markdown)
