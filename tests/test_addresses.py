"""One HOST:PORT parser (harvest.addresses) for every flag and field taking an address: the
forms it accepts and refuses, and each place a user gives one refusing a bad value with
one line naming the flag or field and the value (exit status 2, no traceback)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harvest import addresses, cli, config_env
from harvest.addresses import Address, AddressError, parse_address, parse_host, parse_port
from harvest.fleet.options import FleetOptions
from harvest.settings import SettingError

PROJECT = Path(__file__).resolve().parents[1]
PORTS = "port must be 1-65535"

# value -> the Address it is, or the reason it is refused (HOST:PORT, no default port, no 0)
HOST_PORT_TABLE = {
    "gpu1:29500": Address("gpu1", 29500),
    "127.0.0.1:1": Address("127.0.0.1", 1),
    "trainer-store.internal:65535": Address("trainer-store.internal", 65535),
    "[::1]:80": Address("::1", 80),
    "[fe80::1%eth0]:80": Address("fe80::1%eth0", 80),
    "h:0": PORTS,
    "h:65536": PORTS,
    "h:99999": PORTS,
    "h:123456": PORTS,
    "h:abc": PORTS,
    "h:-1": PORTS,
    "h:+80": PORTS,
    "h:080": PORTS,
    "h: 80": "a space in it",
    "h:": "no port after ':'",
    "h": "no port",
    ":80": "no host",
    "": "no host",
    "[::1": "no ']' after the IPv6 address",
    "[::1]": "no port",
    "[::1]80": "expected ':PORT' after ']'",
    "[nope]:80": "'nope' is not an IPv6 address",
    "::1:80": "an IPv6 address takes brackets",
    "fe80::1": "an IPv6 address takes brackets",
    "user@h:80": "a host name is letters",
    "-h:80": "a host name is letters",
    "http://h:80": "a URL or path",  # a URL only where the flag takes one
}


@pytest.mark.parametrize("value, expected", list(HOST_PORT_TABLE.items()))
def test_host_port_table(value, expected):
    if isinstance(expected, Address):
        assert parse_address(value) == expected
        assert str(parse_address(value)) == value  # written back as given
        return
    with pytest.raises(AddressError) as refused:
        parse_address(value)
    assert str(refused.value).startswith(f"{value!r} is not HOST:PORT (") and expected in refused.value.reason


# URL flags (ctl --server, top): an http(s):// scheme and a path are allowed, the port has a default
URL_TABLE = {
    "gpu1": Address("gpu1", 18400),
    "gpu1:9000": Address("gpu1", 9000),
    "http://gpu1:1/harvest/status": Address("gpu1", 1, "http", "/harvest/status"),
    "HTTPS://gpu1": Address("gpu1", 18400, "https"),
    "https://[::1]:443/x?q#f": Address("::1", 443, "https", "/x"),
    "[::1]": Address("::1", 18400),
    "ftp://gpu1:1": "the scheme must be http or https",
    "http://": "no host",
    "http://[::1": "no ']' after the IPv6 address",
    "http://gpu1:0": PORTS,
    "localhost:abc": PORTS,
    "::1": "an IPv6 address takes brackets",
}


@pytest.mark.parametrize("value, expected", list(URL_TABLE.items()))
def test_url_table(value, expected):
    if isinstance(expected, Address):
        assert parse_address(value, url=True, default_port=18400) == expected
        return
    with pytest.raises(AddressError, match=r"is not \[http\(s\)://\]HOST\[:PORT\] \(") as refused:
        parse_address(value, url=True, default_port=18400)
    assert expected in refused.value.reason


def test_port_zero_only_where_it_means_something():
    assert parse_address("0.0.0.0:0", zero="any free port").port == 0
    assert parse_port("0", zero="off") == 0 and parse_port(0, zero="off") == 0 and parse_port("65535") == 65535
    for value in ("0", 0, 65536, -1, True, 80.0, "8O"):
        with pytest.raises(AddressError, match=PORTS):
            parse_port(value)
    with pytest.raises(AddressError, match=r"port must be 1-65535, or 0: off\)"):
        parse_port("70000", zero="off")


@pytest.mark.parametrize("value, host", [("gpu1", "gpu1"), ("0.0.0.0", "0.0.0.0"), ("::", "::"), ("::1", "::1"),
                                         ("[::1]", "::1")])
def test_good_hosts(value, host):
    assert parse_host(value) == host


@pytest.mark.parametrize("value, reason", [("h:80", "without ':PORT'"), ("[::1]:80", "without a port"),
                                           ("http://x", "not a URL"), ("a b", "a host name is"), ("", "no host"),
                                           ("[x]", "'x' is not an IPv6 address"), ("::g", "'::g' is not an IPv6")])
def test_bad_hosts(value, reason):
    with pytest.raises(AddressError, match=r"is not a HOST \(") as refused:
        parse_host(value)
    assert reason in refused.value.reason


# -- each place a user gives an address ----------------------------------------------------------
def _last_line(text: str) -> str:
    assert "Traceback" not in text, text
    return text.strip().splitlines()[-1]


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse: usage, then the one error line
        code = exc.code
    return code, _last_line(capsys.readouterr().err)


def test_fleet_rendezvous_is_refused_when_the_job_loads(tmp_path):
    with pytest.raises(SettingError, match=r"rendezvous='host:99999': expected HOST:PORT \(port must be 1-65535\)"):
        FleetOptions(rendezvous="host:99999")
    assert FleetOptions(rendezvous="[::1]:29500").host_port == ("::1", 29500)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"model_name_or_path": "unused", "harvest": {"fleet": {"rendezvous": "host:99999"}}}))
    result = subprocess.run([sys.executable, "-m", "harvest.cli", "train", str(job), "--check"], cwd=PROJECT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert _last_line(result.stderr).startswith(
        f"harvest train: job file '{job}': harvest.fleet.rendezvous='host:99999': expected HOST:PORT "
        "(port must be 1-65535); HOST:PORT of the fleet's c10d TCPStore")


def test_fleet_store_refuses_a_bad_endpoint_before_torch():
    result = subprocess.run([sys.executable, "-m", "harvest.cli", "fleet-store", "127.0.0.1:99999"], cwd=PROJECT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert _last_line(result.stderr) == ("harvest fleet-store: error: argument endpoint: '127.0.0.1:99999' is not "
                                         "HOST:PORT (port must be 1-65535, or 0: any free port)")


@pytest.mark.parametrize("server, reason", [("localhost:abc", PORTS), ("[::1", "no ']' after the IPv6 address"),
                                            ("gpu1:0", PORTS),
                                            ("::1", "an IPv6 address takes brackets: [ADDRESS]:PORT")])
def test_ctl_server(server, reason, capsys):
    code, line = _cli(["ctl", "--server", server, "jobs"], capsys)
    assert code == 2
    assert line == f"harvest ctl: error: argument --server: {server!r} is not [http(s)://]HOST[:PORT] ({reason})"


def test_top_servers(capsys):
    code, line = _cli(["top", "--once", "gpu1:99999"], capsys)
    assert code == 2
    assert line == "harvest top: error: argument URL: 'gpu1:99999' is not [http(s)://]HOST[:PORT] (port must be 1-65535)"


@pytest.mark.parametrize("metrics, message", [
    ({"port": 99999}, "metrics.port=99999: expected a port (port must be 1-65535, or 0: off); "),
    ({"port": -1}, "metrics.port=-1: expected a port (port must be 1-65535, or 0: off); "),
    ({"host": "gpu1:80"}, "metrics.host='gpu1:80': expected a host name or IP address (a host alone, without ':PORT'); "),
])
def test_metrics_fields_in_harvest_yaml(metrics, message, tmp_path, capsys, monkeypatch):
    config = tmp_path / "harvest.yaml"
    config.write_text(yaml.safe_dump({"metrics": metrics}))
    monkeypatch.setattr("harvest.sglang.launch.os.execv", lambda *args: pytest.fail("exec'd a bad setup"))
    code, line = _cli(["launch", "--config", str(config), "--", "--model-path", "unused"], capsys)
    assert code == 2 and line.startswith(f"harvest launch: harvest config {config}: {message}"), line


@pytest.mark.parametrize("flag, value, message", [
    ("--harvest-metrics-port", "99999", "'99999' is not a port (port must be 1-65535, or 0: off)"),
    ("--harvest-metrics-port", "http", "'http' is not a port (port must be 1-65535, or 0: off)"),
    ("--harvest-metrics-host", "gpu1:80", "'gpu1:80' is not a HOST (a host alone, without ':PORT')"),
])
def test_metrics_flags(flag, value, message, capsys, monkeypatch):
    from harvest.sglang import plugin

    monkeypatch.delenv(config_env.METRICS_PORT_VAR, raising=False)
    monkeypatch.delenv(config_env.METRICS_HOST_VAR, raising=False)
    monkeypatch.setattr("harvest.sglang.launch.os.execv", lambda *args: pytest.fail("exec'd a bad setup"))
    # harvest launch -- ... FLAG VALUE: checked before the pre-flight check, naming the flag
    code, line = _cli(["launch", "--", "--model-path", "unused", flag, value], capsys)
    assert code == 2 and line == f"harvest launch: {flag}: {message}"
    # SGLang's own parser with the plugin's flags (python -m sglang.launch_server ... FLAG VALUE)
    parser = argparse.ArgumentParser(prog="launch_server")
    plugin._add_cli_args(None, parser)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args([flag, value])
    assert exited.value.code == 2
    assert _last_line(capsys.readouterr().err) == f"launch_server: error: argument {flag}: {message}"


@pytest.mark.parametrize("var, value, message", [
    ("HARVEST_METRICS_PORT", "70000", "HARVEST_METRICS_PORT: '70000' is not a port (port must be 1-65535, or 0: off)"),
    ("HARVEST_METRICS_HOST", "http://x", "HARVEST_METRICS_HOST: 'http://x' is not a HOST (a host name or IP address, "
                                         "not a URL)"),
])
def test_metrics_variables(var, value, message, monkeypatch):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError) as refused:
        config_env.metrics_port() if var.endswith("PORT") else config_env.metrics_host()
    assert str(refused.value) == message


def test_the_forms_read_alike_in_help():
    assert addresses.address_form() == "HOST:PORT"
    assert addresses.address_form(url=True, default_port=1) == "[http(s)://]HOST[:PORT]"
