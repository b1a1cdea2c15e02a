"""deploy/prometheus/alerts.yaml: promtool accepts the rules, every alert has a firing and a quiet unit test and they
pass, and the generated unit-test file is up to date with its cases and the rules' annotations."""

from __future__ import annotations

import subprocess

from deploy_files import DEPLOY, load_script, promtool

RULES = DEPLOY / "prometheus" / "alerts.yaml"
TESTS = DEPLOY / "prometheus" / "alerts_test.yaml"


def test_promtool_checks_the_rules():
    result = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_pass():
    result = subprocess.run([promtool(), "test", "rules", str(TESTS)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_fires_and_stays_quiet_in_a_case():
    make = load_script("prometheus/make_alert_tests.py")
    alerts = make.rules_by_alert()
    assert len(alerts) >= 8
    assert {a: make.covered().get(a) for a in alerts} == {a: (True, True) for a in alerts}


def test_unit_test_file_is_up_to_date():
    make = load_script("prometheus/make_alert_tests.py")
    assert TESTS.read_text() == make.render_file(), "run python deploy/prometheus/make_alert_tests.py"


def test_prometheusrule_is_up_to_date():
    make = load_script("prometheus/make_prometheusrule.py")
    assert make.OUTPUT.read_text() == make.render(), "run python deploy/prometheus/make_prometheusrule.py"
