"""Where harvest's endpoint listens: the per-instance override (command line, environment)
over harvest.yaml's metrics section; the host defaults to SGLang's --host; bad override
values are refused naming the variable."""

from __future__ import annotations

import pytest

from harvest import config_env
from harvest.config import DEFAULT_METRICS_PORT, MetricsConfig
from harvest.sglang.control_endpoint import endpoint_settings


@pytest.fixture(autouse=True)
def no_overrides(monkeypatch):
    monkeypatch.delenv(config_env.METRICS_PORT_VAR, raising=False)
    monkeypatch.delenv(config_env.METRICS_HOST_VAR, raising=False)


def test_the_file_then_sglang_host():
    settings, where = endpoint_settings(MetricsConfig(), "10.1.2.3", "/etc/harvest.yaml")
    assert (settings.host, settings.port) == ("10.1.2.3", DEFAULT_METRICS_PORT)
    assert where == "metrics.port in /etc/harvest.yaml"
    settings, _ = endpoint_settings(MetricsConfig(port=9500, host="0.0.0.0"), "127.0.0.1")
    assert (settings.host, settings.port) == ("0.0.0.0", 9500)
    assert endpoint_settings(MetricsConfig(), None)[0].host == "127.0.0.1"
    assert endpoint_settings(MetricsConfig(port=0), "127.0.0.1") is None  # off


def test_the_instance_override_wins(monkeypatch):
    monkeypatch.setenv(config_env.METRICS_PORT_VAR, "18401")
    monkeypatch.setenv(config_env.METRICS_HOST_VAR, "::1")
    settings, where = endpoint_settings(MetricsConfig(port=9500, host="0.0.0.0"), "127.0.0.1", "h.yaml")
    assert (settings.host, settings.port) == ("::1", 18401)
    assert "HARVEST_METRICS_PORT" in where and "--harvest-metrics-port" in where
    monkeypatch.setenv(config_env.METRICS_PORT_VAR, "0")
    assert endpoint_settings(MetricsConfig(), "127.0.0.1") is None


@pytest.mark.parametrize("var, value", [("HARVEST_METRICS_PORT", "70000"), ("HARVEST_METRICS_PORT", "-1"),
                                        ("HARVEST_METRICS_PORT", "http"), ("HARVEST_METRICS_HOST", "a b"),
                                        ("HARVEST_METRICS_HOST", "http://x")])
def test_bad_overrides_are_refused_naming_the_variable(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        endpoint_settings(MetricsConfig(), "127.0.0.1")


def test_the_default_port_keeps_clear_of_known_neighbours():
    # Prometheus's exporter range (dcgm-exporter: 9400), SGLang's 30000 and the ports it
    # derives, the kernel's ephemeral range.
    assert not 9100 <= DEFAULT_METRICS_PORT <= 9999
    assert DEFAULT_METRICS_PORT < 22000  # below SGLang's own free-port picks (22000-29999) and 30000
