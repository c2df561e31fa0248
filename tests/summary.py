"""Sum JUnit XML reports (host suite + RDMA suite in the guest) into one closing line.

`make test` runs two pytest sessions; CI reads the last line, so it must count both.
Exits non-zero if any report is missing or holds a failure or error, or if a required
suite did not run:

    python -m tests.summary [--require PREFIX]... REPORT.xml...

``--require tests.rdma.two_hosts`` fails unless tests whose class name starts with that
prefix ran and passed, none of them skipped (a suite that silently did not run is a
failure, not a pass).
"""
from __future__ import annotations

import argparse
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


def count_prefix(paths: list[str], prefix: str) -> dict:
    """passed / failed / skipped of the test cases whose classname starts with ``prefix``."""
    out = {"passed": 0, "failed": 0, "skipped": 0}
    for p in paths:
        for case in ET.parse(p).getroot().iter("testcase"):
            name = case.get("classname", "")
            if not (name == prefix or name.startswith(prefix + ".")):
                continue
            if case.find("failure") is not None or case.find("error") is not None:
                out["failed"] += 1
            elif case.find("skipped") is not None:
                out["skipped"] += 1
            else:
                out["passed"] += 1
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.summary")
    ap.add_argument("--require", action="append", default=[], metavar="PREFIX",
                    help="a suite (test class-name prefix) that must have run and passed")
    ap.add_argument("paths", nargs="+")
    args = ap.parse_args(argv)
    passed = failed = skipped = 0
    for p in args.paths:
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
    missing = []
    for prefix in args.require:
        c = count_prefix(args.paths, prefix)
        print(f"{prefix}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped")
        if c["passed"] == 0 or c["skipped"]:
            missing.append(prefix)
    if missing:
        print(f"required suite did not run (or skipped tests): {', '.join(missing)}")
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed or passed == 0 or missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
