"""deploy/grafana/pagedllm.json is what deploy/grafana/dashboard.py generates (edit the code, then regenerate)."""

from __future__ import annotations

import json

from deploy_files import DEPLOY, load_script, require_module

JSON = DEPLOY / "grafana" / "pagedllm.json"


def test_dashboard_json_is_up_to_date():
    require_module("grafana_foundation_sdk", 'pip install -e ".[test]"')
    generator = load_script("grafana/dashboard.py")
    assert JSON.read_text() == generator.render(), "stale: run python deploy/grafana/dashboard.py"


def test_dashboard_panels_have_unique_ids_and_queries():
    board = json.loads(JSON.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
