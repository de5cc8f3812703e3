"""The GPU check's summary table from pytest's junit XML: check, GPUs used, result, figure.

``python -m tests.gpu.report RESULTS.xml`` prints the table and exits 1 when a check failed;
``... RESULTS.xml --passed TEST`` prints the parameters of the passed cases of ``TEST``
(``module::test``), one per line.
A skipped check is shown as ``skipped: <reason>`` and counted as skipped, never as passed. A
run stopped before its end (Ctrl-C, ``timeout -s INT``) leaves a nameless test case where the
check in progress was: ``interrupted``, counted apart, never as passed, and the exit is 1.
The XML is the file pytest wrote in the same run (parsed with the standard library).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET  # noqa: N817 - the usual name
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Check", "passed_params", "read_checks", "summary"]


@dataclass(frozen=True)
class Check:
    name: str  # module::test[params]
    gpus: str  # GPUs the check used ("-" when it did not run)
    result: str  # passed | failed: <msg> | error: <msg> | skipped: <reason> | interrupted: <why>
    figure: str

    @property
    def outcome(self) -> str:
        return self.result.split(":", 1)[0]


def _one_line(text: str | None, limit: int = 160) -> str:
    line = " ".join((text or "").split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def read_checks(xml_path: str | Path) -> list[Check]:
    """One :class:`Check` per test case of the junit XML, in run order."""
    checks = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        if case.get("name") is None:  # pytest's record of a run stopped in this check
            checks.append(Check("(the check running when the run stopped)", "-",
                                "interrupted: the run stopped before this check finished", ""))
            continue
        module = (case.get("classname") or "").rsplit(".", 1)[-1]
        name = f"{module}::{case.get('name')}" if module else str(case.get("name"))
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        skipped, failure, error = (case.find(tag) for tag in ("skipped", "failure", "error"))
        if failure is not None:
            result = f"failed: {_one_line(failure.get('message'))}"
        elif error is not None:
            result = f"error: {_one_line(error.get('message'))}"
        elif skipped is not None:
            result = f"skipped: {_one_line(skipped.get('message'))}"
        else:
            result = "passed"
        ran = skipped is None
        checks.append(Check(name, props.get("gpus", "-") if ran else "-", result,
                            props.get("figure", "") if ran else ""))
    return checks


def summary(checks: list[Check]) -> str:
    """The table and a count line (passed / failed / skipped: skipped checks did not run)."""
    rows = [("check", "GPUs used", "result", "figure")]
    rows += [(c.name, c.gpus, c.result, c.figure) for c in checks]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [" | ".join(r[i].ljust(widths[i]) for i in range(3)) + " | " + r[3] for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths) + "-+-" + "-" * 6)
    counts = {k: sum(c.outcome == k for c in checks)
              for k in ("passed", "failed", "error", "skipped", "interrupted")}
    lines.append(f"{counts['passed']} passed, {counts['failed']} failed, {counts['error']} "
                 f"errors, {counts['skipped']} skipped (a skipped check did not run and is not "
                 "counted as passed)"
                 + (", the run was interrupted before its end" if counts["interrupted"] else ""))
    return "\n".join(lines)


def passed_params(checks: list[Check], test: str) -> list[str]:
    """The parameters of ``test``'s cases that passed (``module::test[param]``)."""
    prefix = test + "["
    return [c.name[len(prefix):-1] for c in checks
            if c.outcome == "passed" and c.name.startswith(prefix) and c.name.endswith("]")]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 3) or (len(args) == 3 and args[1] != "--passed"):
        print("usage: python -m tests.gpu.report RESULTS.xml [--passed MODULE::TEST]",
              file=sys.stderr)
        return 2
    checks = read_checks(args[0])
    if len(args) == 3:
        print("\n".join(passed_params(checks, args[2])))
        return 0
    print(summary(checks))
    return 1 if any(c.outcome in ("failed", "error", "interrupted") for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
