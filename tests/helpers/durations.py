"""Refresh ``tests/durations.json`` (seconds per test module, which only orders the modules: tests/conftest.py) from
a pytest JUnit XML report: ``python -m tests.helpers.durations JUNIT_XML`` after a run of the fast tier with
``--junitxml=JUNIT_XML``. Modules of the report are replaced; modules it does not hold keep their recorded figure."""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "durations.json"


def module_seconds(junit_xml: Path) -> dict[str, float]:
    """Setup, call and teardown of every test case, summed per module (``tests/e2e/test_x.py``)."""
    totals: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        # classname is the dotted module path, plus the class for tests in a class
        while module and not module[-1].startswith("test_"):
            module.pop()
        if module:
            totals["/".join(module) + ".py"] += float(case.get("time") or 0.0)
    return {k: round(v, 1) for k, v in totals.items()}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        return 2
    recorded = json.loads(OUT.read_text()) if OUT.is_file() else {}
    recorded.update(module_seconds(Path(argv[0])))
    OUT.write_text(json.dumps(dict(sorted(recorded.items(), key=lambda kv: -kv[1])), indent=1) + "\n")
    print(f"{OUT}: {len(recorded)} modules")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
