"""The Grafana dashboard imports as is and only queries metrics harvest exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from harvest.metrics.registry import HarvestMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "harvest" / "metrics" / "dashboards" / "harvest.json"
REQUIRED_PANELS = ("latency vs tpot target", "sm split", "memory lent", "trainer throughput", "loss")


def exported_sample_names() -> set[str]:
    names = set()
    for family in text_string_to_metric_families(HarvestMetrics().exposition().decode()):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    # Histogram buckets appear only once observed; they are still exported names.
    names.update(n + "_bucket" for n in list(names) if n + "_count" in names)
    return names


def test_dashboard_is_importable_json_with_the_required_panels():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    titles = [p["title"].lower() for p in dashboard["panels"]]
    for required in REQUIRED_PANELS:
        assert any(required in t for t in titles), required
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    datasource_vars = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert datasource_vars and datasource_vars[0]["query"] == "prometheus"


def test_every_query_uses_an_exported_metric():
    exported = exported_sample_names()
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used = set(re.findall(r"\b(harvest_[a-z_]+)", target["expr"]))
            assert used, target["expr"]
            assert used <= exported, (panel["title"], used - exported)
