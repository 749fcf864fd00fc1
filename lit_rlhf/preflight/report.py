"""The preflight's report: sections of lines, and findings that block the run or warn, each naming its setting."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Level = Literal["block", "warn"]


@dataclass(frozen=True)
class Finding:
    """One problem: `block` stops the run (exit status 1), `warn` lets it start; `setting` is what to change."""

    level: Level
    section: str
    message: str
    setting: str


@dataclass
class Section:
    """One family of checks: what it saw (lines) and what it found."""

    name: str
    lines: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    def line(self, text: str) -> None:
        self.lines.append(text)

    def block(self, message: str, setting: str) -> None:
        self.findings.append(Finding("block", self.name, message, setting))

    def warn(self, message: str, setting: str) -> None:
        self.findings.append(Finding("warn", self.name, message, setting))

    def refused(self, error: Exception, default: str = "the config") -> None:
        """Block on an error whose message starts with the setting it names (`ConfigError`'s 'field: ...')."""
        text = str(error).split("\n", 1)[0]
        head = text.split(":", 1)[0]
        named = head.split(" ")[0].startswith(("model.", "data.", "trainer.", "sampling.", "algorithm."))
        self.block(text, head if named and " " not in head.strip() else default)


@dataclass
class Report:
    """Every section's lines and findings; `blocked` when any finding blocks the run."""

    title: str
    sections: list[Section] = field(default_factory=list)

    def section(self, name: str) -> Section:
        made = Section(name)
        self.sections.append(made)
        return made

    @property
    def findings(self) -> list[Finding]:
        return [f for s in self.sections for f in s.findings]

    @property
    def blocks(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "block"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "warn"]

    @property
    def blocked(self) -> bool:
        return bool(self.blocks)

    def exit_status(self, strict: bool = False) -> int:
        """0 when nothing blocks the run (and, with `strict`, nothing warns); else 1."""
        return int(self.blocked or (strict and bool(self.warnings)))

    def render(self) -> str:
        out = [self.title]
        for section in self.sections:
            marks = {f.level for f in section.findings}
            state = "BLOCKED" if "block" in marks else "warning" if "warn" in marks else "ok"
            out.append(f"[{section.name}] {state}")
            out += [f"  {line}" for line in section.lines]
        for label, found in (("blocks the run", self.blocks), ("warnings", self.warnings)):
            if found:
                out.append(f"{label} ({len(found)}):")
                out += [f"  - [{f.section}] {f.message} -> change {f.setting}" for f in found]
        verdict = "BLOCKED: fix the findings above before submitting (exit status 1)" if self.blocked else "ok to run"
        out.append(f"result: {verdict}")
        return "\n".join(out)
