"""What a check finds: a :class:`Problem` naming the field and the fix, and the :class:`Report`
that holds every problem of one pairing at once (with the target and drafter facts it read)."""

from __future__ import annotations

from dataclasses import dataclass, field

from speculant.core.types import DrafterInfo, TargetInfo


@dataclass(frozen=True)
class Problem:
    field: str
    message: str
    fix: str = ""
    severity: str = "error"  # error | warning

    def __str__(self) -> str:
        text = f"{self.field}: {self.message}"
        return f"{text} (fix: {self.fix})" if self.fix else text


@dataclass
class Report:
    problems: list[Problem] = field(default_factory=list)
    target: TargetInfo | None = None
    drafter: DrafterInfo | None = None

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors
