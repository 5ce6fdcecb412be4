"""The check's report: rows and notes per section, printed and written as markdown."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from benchmarks.common import Row, format_table


@dataclass
class SectionResult:
    """What one section measured: table rows, free-text notes, and its error if it failed."""

    name: str
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return bool(self.error)


class CheckFailed(AssertionError):
    """A section found the product wrong (bytes differ, a test failed): not a crash
    of the check itself, and reported as such."""


@dataclass
class Report:
    """The whole run, rewritten to ``path`` after every section."""

    path: str
    header: list[str]
    sections: list[SectionResult] = field(default_factory=list)

    def add(self, section: SectionResult) -> None:
        self.sections.append(section)
        self.write()

    @property
    def failed(self) -> list[SectionResult]:
        return [s for s in self.sections if s.failed]

    def rows(self) -> list[Row]:
        rows: list[Row] = []
        for section in self.sections:
            rows.extend(section.rows)
            if section.failed:
                rows.append(
                    Row(section.name, "FAILED", 0, "", section.error[:160].replace("|", "/"))
                )
        return rows

    def markdown(self) -> str:
        lines = [*self.header, ""]
        if self.sections:
            lines += [format_table(self.rows()), ""]
        for section in self.sections:
            status = f"FAILED: {section.error}" if section.failed else "ok"
            lines.append(f"- **{section.name}** ({section.seconds:.1f} s): {status}")
            lines += [f"  - {note}" for note in section.notes]
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        temporary = self.path + ".tmp"
        with open(temporary, "w") as handle:
            handle.write(self.markdown())
        os.replace(temporary, self.path)
