"""tests/summary.py: the closing line CI reads, and a required suite that did not run."""
from __future__ import annotations

from tests import summary


def _report(path, cases):
    body = []
    for cls, name, kind in cases:
        inner = {"pass": "", "fail": "<failure message='x'/>", "skip": "<skipped message='y'/>"}[kind]
        body.append(f'<testcase classname="{cls}" name="{name}">{inner}</testcase>')
    n = len(cases)
    f = sum(k == "fail" for *_, k in cases)
    s = sum(k == "skip" for *_, k in cases)
    path.write_text(f'<testsuites><testsuite tests="{n}" failures="{f}" errors="0" skipped="{s}">'
                    + "".join(body) + "</testsuite></testsuites>")
    return str(path)


def test_a_required_suite_that_passed_is_counted_and_the_run_passes(tmp_path, capsys):
    host = _report(tmp_path / "h.xml", [("tests.test_x", "t1", "pass")])
    guest = _report(tmp_path / "g.xml", [("tests.rdma.test_y", "t", "pass"),
                                         ("tests.rdma.two_hosts.test_link", "t", "pass")])
    assert summary.main(["--require", "tests.rdma.two_hosts", host, guest]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "tests.rdma.two_hosts: 1 passed, 0 failed, 0 skipped" in out
    assert out[-1] == "3 passed, 0 failed, 0 skipped"


def test_a_required_suite_missing_or_skipped_fails_the_run(tmp_path, capsys):
    host = _report(tmp_path / "h.xml", [("tests.test_x", "t1", "pass")])
    # a sibling whose name merely starts the same way does not count
    guest = _report(tmp_path / "g.xml", [("tests.rdma.two_hosts_old", "t", "pass")])
    assert summary.main(["--require", "tests.rdma.two_hosts", host, guest]) == 1
    assert "required suite did not run" in capsys.readouterr().out
    skipped = _report(tmp_path / "s.xml", [("tests.rdma.two_hosts.test_link", "a", "pass"),
                                           ("tests.rdma.two_hosts.test_link", "b", "skip")])
    assert summary.main(["--require", "tests.rdma.two_hosts", host, skipped]) == 1
    assert summary.main([host, guest]) == 0  # nothing required: as before


def test_a_missing_report_or_a_failure_fails(tmp_path):
    bad = _report(tmp_path / "b.xml", [("tests.test_x", "t1", "fail")])
    assert summary.main([bad]) == 1
    assert summary.main([str(tmp_path / "nope.xml")]) == 1
