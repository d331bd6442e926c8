"""deploy/grafana/ and deploy/prometheus/: the dashboard is valid JSON, the alerting rules pass
Prometheus's own checker and unit tests (promtool), and every series either of them names is one a
real reaper exports (read from its /metrics during a drain)."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

from harvester.postgres.schema.identifiers import TableName
from tests.reaper.test_e2e import outbox_count, wait_for
from tests.reaper.test_http_port import Process, goharvest_yaml
from tests.support.kafka import delete_topics
from tests.support.names import unique
from tests.support.paths import ROOT
from tests.support.reaper import run_reaper
from tests.support.services import Services

DASHBOARD = ROOT / "deploy" / "grafana" / "reaper-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "reaper-alerts.yaml"
RULE_TESTS = ROOT / "tests" / "reaper" / "data" / "reaper-alerts-test.yaml"
BACKLOG = 20_000

# PromQL words that are not series names (functions are recognised by the "(" that follows them).
_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}


def series_in(expr: str) -> set[str]:
    """The series names a PromQL expression reads (labels, ranges, strings and grouping lists removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\w+", "", text)  # Grafana variables
    names = re.findall(r"(?<![\w.:])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()", text)
    return {n for n in names if n not in _KEYWORDS}


def dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    exprs += [
        v["definition"].removeprefix("label_values(").split(",")[0]
        for v in doc["templating"]["list"]
        if v.get("definition")
    ]
    return exprs


def rule_exprs() -> list[str]:
    doc = yaml.safe_load(RULES.read_text())
    return [str(rule["expr"]) for group in doc["groups"] for rule in group["rules"]]


@pytest.mark.unit
def test_series_names_are_read_from_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (job, le) (rate(a_bucket{job=~"$job"}[$__rate_interval]))) / b unless on (x) c'
    )
    assert series_in(expr) == {"a_bucket", "b", "c"}
    assert series_in('max by (job) (g) > 0 and sum by (job) (increase(h_total{reason="x y"}[10m])) == 0') == {
        "g",
        "h_total",
    }


@pytest.mark.unit
def test_the_dashboard_is_valid_grafana_json() -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] and doc["title"] and isinstance(doc["schemaVersion"], int)
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in doc["templating"]["list"]}
    assert variables == {"datasource", "job"}
    for panel in doc["panels"]:
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys() and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            assert 'job=~"$job"' in target["expr"], target["expr"]  # every panel follows the group picked


@pytest.fixture(scope="module")
def promtool() -> str:
    """Prometheus's promtool, found or unpacked from Debian's package by deploy/local/promtool.sh."""
    done = subprocess.run(
        ["bash", str(ROOT / "deploy" / "local" / "promtool.sh")],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return done.stdout.strip()


@pytest.mark.integration
def test_the_rules_pass_promtool_check(promtool: str) -> None:
    done = subprocess.run([promtool, "check", "rules", str(RULES)], check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rule_exprs())} rules found" in done.stdout


@pytest.mark.integration
def test_each_alert_fires_when_it_should_and_only_then(promtool: str) -> None:
    # tests/reaper/data/reaper-alerts-test.yaml: series of a healthy group and of sick ones, and the
    # alerts expected at given times (promtool evaluates the rules over them).
    done = subprocess.run(
        [promtool, "test", "rules", RULE_TESTS.name], check=False, capture_output=True, text=True, cwd=RULE_TESTS.parent
    )
    assert done.returncode == 0, done.stdout + done.stderr
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    alerts = {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]}
    assert tested == alerts, "every alert has a case in the rule tests"


@pytest.fixture
def scrape_during_drain(
    services: Services,
    pg: psycopg.Connection[tuple[object, ...]],
    schema: str,
    topics: Callable[..., str],
    tmp_path: Path,
) -> Iterator[dict[str, Any]]:
    """A real reaper's /metrics, scraped while it drains a backlog: {sample name: family type}."""
    table = TableName(schema, "outbox")
    topic = topics()
    group = unique("reaper-metrics")
    config = tmp_path / "reaper.yaml"
    config.write_text(goharvest_yaml(services, table, group))
    assert run_reaper("migrate", "-f", str(config)).returncode == 0
    # One statement (the drain is what is scraped, not how the rows were written): 20,000 INSERTs
    # took seconds.
    pg.execute(
        sql.SQL(
            "INSERT INTO {} (create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values)"
            " SELECT NOW(), %s, 'key-' || (i %% 8), 'value-' || i, ARRAY['seq'], ARRAY[i::text]"
            " FROM generate_series(0, %s - 1) AS i"
        ).format(table.ident),
        (topic, BACKLOG),
    )
    reaper = Process(config, "metrics", tmp_path)
    try:
        wait_for("the reaper to lead", lambda: bool(reaper.events("reaper_started")) and reaper.leads(), 90)
        body = ""

        def draining() -> bool:
            nonlocal body
            status, text = reaper.get("/metrics")
            assert status == 200 and isinstance(text, str)
            body = text
            return 0 < outbox_count(pg, table) < BACKLOG

        wait_for("a scrape in the middle of the drain", draining, 60)
        samples: dict[str, Any] = {}
        for family in text_string_to_metric_families(body):
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
            samples.update({family.name + s: family.type for s in suffixes})
            samples.update({s.name: family.type for s in family.samples})
        yield samples
    finally:
        reaper.kill()
        delete_topics(services.bootstrap, [f"{group}.neli"])


@pytest.mark.integration
def test_every_series_of_the_dashboard_and_the_rules_is_exported(scrape_during_drain: dict[str, Any]) -> None:
    exported = scrape_during_drain
    assert exported.get("harvester_records_published_total") == "counter"
    for where, exprs in (("dashboard", dashboard_exprs()), ("rules", rule_exprs())):
        used = set().union(*(series_in(e) for e in exprs))
        assert used, where
        missing = sorted(used - exported.keys())
        assert not missing, f"{where} reads series no reaper exports: {missing}"
    # The dashboard shows every series the reaper exports (the rules need not).
    shown = set().union(*(series_in(e) for e in dashboard_exprs()))
    families = {re.sub(r"_(total|bucket|sum|count|created)$", "", n) for n in exported}
    unshown = sorted(f for f in families if not any(s.startswith(f) for s in shown))
    assert not unshown, f"exported but on no panel: {unshown}"
