"""The Grafana dashboard imports as is, only queries metrics harvest exports, and never
merges servers: every query is filtered by the dashboard's variables, windows follow
Grafana's ``$__rate_interval``, and every quantile is computed per instance.

(tests/metrics/test_prometheus.py runs every query against a real Prometheus.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.metrics.populated import populated

DASHBOARD = Path(__file__).resolve().parents[2] / "harvest" / "metrics" / "dashboards" / "harvest.json"
REQUIRED_PANELS = ("latency vs tpot target", "sm split", "memory lent", "trainer throughput", "loss")
FILTERS = ('instance=~"$instance"', 'job=~"$job"', 'model_name=~"$model_name"')
SELECTOR = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}")
JOB_PANELS = ("job progress", "job eta", "training loss (per job)", "job tokens/s", "share of trainer time",
              "fair-share deficit", "job state")
# Jobs one fleet of servers trains together (harvest.fleet): one line per server and job.
FLEET_JOB_PANELS = ("fleet job members", "fleet job rounds/s", "fleet job staleness", "fleet job tokens contributed/s",
                    "fleet job committed steps")


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expression) of every query."""
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]


def exported_sample_names() -> set[str]:
    names = set()
    for family in text_string_to_metric_families(populated().exposition().decode()):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def test_dashboard_is_importable_json_with_the_required_panels():
    dashboard = load()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    titles = [p["title"].lower() for p in dashboard["panels"]]
    for required in REQUIRED_PANELS + JOB_PANELS + FLEET_JOB_PANELS:
        assert any(required in t for t in titles), required
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert list(variables) == ["datasource", "job", "model_name", "instance", "job_name"]
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("job", "model_name", "instance", "job_name"):
        variable = variables[name]
        # All must be ".*", not Grafana's alternation of the values it knows: a series
        # without the label (model_name before it was set) still matches.
        assert variable["multi"] and variable["includeAll"] and variable["allValue"] == ".*", name
        assert f", {name})" in variable["query"], (name, variable["query"])
    assert variables["instance"]["query"].startswith("label_values(harvest_build_info")


def test_every_query_uses_an_exported_metric():
    exported = exported_sample_names()
    for title, expr in queries(load()):
        used = set(re.findall(r"\b(harvest_[a-z_]+)", expr))
        assert used, expr
        assert used <= exported, (title, used - exported)


def test_every_selector_is_filtered_by_the_dashboard_variables():
    for title, expr in queries(load()):
        selectors = SELECTOR.findall(expr)
        assert selectors and len(selectors) == len(re.findall(r"\b(?:harvest_[a-z_]+|up)\b", expr)), (title, expr)
        for metric, matchers in selectors:
            # up carries no model_name: the fleet row joins it to harvest_build_info, which does.
            needed = FILTERS[:2] if metric == "up" else FILTERS
            assert all(f in matchers for f in needed), (title, metric, matchers)
        if any(job_panel in title.lower() for job_panel in JOB_PANELS + FLEET_JOB_PANELS):
            assert 'job_name=~"$job_name"' in expr, (title, expr)


def test_no_fixed_windows():
    for title, expr in queries(load()):
        for window in re.findall(r"\[([^\]]*)\]", expr):
            assert window in ("$__rate_interval", "$__range"), (title, expr)


def test_every_quantile_is_computed_per_instance():
    found = 0
    for title, expr in queries(load()):
        for call in re.finditer(r"histogram_quantile\(", expr):
            found += 1
            assert re.match(r"histogram_quantile\([0-9.]+, sum by \(le, instance\) \(rate\(harvest_[a-z_]+_bucket\{",
                            expr[call.start():]), (title, expr)
    assert found >= 4


def test_the_fleet_row_comes_first():
    panels = load()["panels"]
    assert panels[0]["type"] == "row" and panels[0]["title"].lower().startswith("fleet")
    rows = [i for i, p in enumerate(panels) if p["type"] == "row"]
    fleet = [p["title"].lower() for p in panels[1:rows[1]]]
    assert fleet == ["fleet: trainer tokens/s", "fleet: worst tpot p99 vs target", "fleet: servers over target",
                     "fleet: servers up"]


def test_the_fleet_job_row_shows_each_server_and_job():
    panels = load()["panels"]
    rows = [i for i, p in enumerate(panels) if p["type"] == "row"]
    start = next(i for i in rows if "fleet" in panels[i]["title"].lower() and panels[i]["title"].lower().startswith("jobs"))
    end = next((i for i in rows if i > start), len(panels))
    titles = [p["title"].lower() for p in panels[start + 1:end]]
    assert len(titles) == len(FLEET_JOB_PANELS) and all(t.startswith(f) for t, f in zip(titles, FLEET_JOB_PANELS)), titles
    for panel in panels[start + 1:end]:
        for target in panel["targets"]:
            expr, legend = target["expr"], target["legendFormat"]
            assert "harvest_fleet_" in expr, (panel["title"], expr)
            # Never merged across servers or jobs: no aggregation, or one that keeps both.
            assert not re.search(r"\b(sum|max|min|avg|count)\b(?! by \(instance, job_name\))", expr), expr
            assert "{{instance}}" in legend and "{{job_name}}" in legend, legend
