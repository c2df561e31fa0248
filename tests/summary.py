"""Sum JUnit XML reports (host suite + RDMA suite in the guest) into one closing line.

`make test` runs two pytest sessions; CI reads the last line, so it must count both.
Exits non-zero if any report is missing or holds a failure or error.
"""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def count(path: str) -> dict:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for k in totals:
            totals[k] += int(s.get(k, 0))
    return totals


def main(paths: list[str]) -> int:
    passed = failed = skipped = 0
    for p in paths:
        try:
            t = count(p)
        except (OSError, ET.ParseError) as e:
            print(f"missing or unreadable test report {p}: {e}")
            return 1
        f = t["failures"] + t["errors"]
        passed += t["tests"] - f - t["skipped"]
        failed += f
        skipped += t["skipped"]
        print(f"{p}: {t['tests'] - f - t['skipped']} passed, {f} failed, {t['skipped']} skipped")
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed or passed == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
