"""Network addresses given on a command line, in an environment variable or in a setting:
one parser, so every flag and field accepts the same forms and refuses with the same words.

    HOST:PORT  [IPv6]:PORT           parse_address (fleet rendezvous, fleet-store)
    [http(s)://]HOST[:PORT][/PATH]   parse_address(url=True, default_port=...) (ctl, top)
    HOST  (a name, IPv4 or IPv6)     parse_host (metrics.host)
    PORT                             parse_port (metrics.port)

A port is 1-65535; 0 only where the caller names what it means (``zero="off"``). Errors are
:class:`AddressError`, saying what was given and why it is refused; the caller adds the
flag or field (:func:`named`, or argparse for the ``*_type`` functions). Standard library
only: `harvest ctl` and `harvest top` run without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import re
from typing import Callable

MAX_PORT = 65535
# A host name or IPv4 address, as the fleet's rendezvous pattern always allowed.
NAME_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
NAME_CHARACTERS = "letters, digits, '.', '-' and '_'"
URL_SCHEMES = ("http", "https")
HOST_PORT = "HOST:PORT"


class AddressError(ValueError):
    """``value`` is not ``form`` (``HOST:PORT``, ...) because of ``reason``."""

    def __init__(self, value: object, form: str, reason: str):
        super().__init__(f"{value!r} is not {form} ({reason})")
        self.value, self.form, self.reason = value, form, reason


@dataclasses.dataclass(frozen=True)
class Address:
    """A parsed address: ``host`` without brackets; ``scheme`` and ``path`` only from a URL
    (``path`` starts with ``/`` or is empty)."""

    host: str
    port: int
    scheme: str = ""
    path: str = ""

    @property
    def netloc(self) -> str:
        """``host:port``, an IPv6 host in brackets."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return self.netloc


def port_rule(zero: str | None = None) -> str:
    """The accepted ports in words: ``port must be 1-65535`` (``, or 0: off``)."""
    return f"port must be 1-{MAX_PORT}" + (f", or 0: {zero}" if zero else "")


def parse_port(value: object, *, zero: str | None = None, form: str = "a port") -> int:
    """A port number from text (digits, no leading zero) or an int; 0 only when ``zero``
    says what it means. Raises AddressError."""
    if isinstance(value, str):
        if re.fullmatch(r"0|[1-9][0-9]{0,4}", value) is None:
            raise AddressError(value, form, port_rule(zero))
        port = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        port = value
    else:
        raise AddressError(value, form, port_rule(zero))
    if not (1 <= port <= MAX_PORT or (port == 0 and zero)):
        raise AddressError(value, form, port_rule(zero))
    return port


def _host(text: str, value: str, form: str, *, bracketed: bool) -> str:
    if bracketed or ":" in text:
        try:
            ipaddress.IPv6Address(text)
        except ValueError:
            raise AddressError(value, form, f"{text!r} is not an IPv6 address") from None
        return text
    if not text:
        raise AddressError(value, form, "no host")
    if re.fullmatch(NAME_PATTERN, text) is None:
        raise AddressError(value, form, f"a host name is {NAME_CHARACTERS}, not starting with '.' or '-'")
    return text


def parse_host(value: object, *, form: str = "a HOST") -> str:
    """A host to listen on or connect to: a name, an IPv4 address or an IPv6 address (in
    brackets or not; returned without). Raises AddressError."""
    if not isinstance(value, str):
        raise AddressError(value, form, "not text")
    if "/" in value:
        raise AddressError(value, form, "a host name or IP address, not a URL")
    if value.startswith("["):
        if not value.endswith("]"):
            raise AddressError(value, form, "an IPv6 host is [ADDRESS], without a port")
        return _host(value[1:-1], value, form, bracketed=True)
    if ":" not in value:
        return _host(value, value, form, bracketed=False)
    if value.count(":") == 1:  # a name or IPv4 with a port: not a host
        raise AddressError(value, form, "a host alone, without ':PORT'")
    return _host(value, value, form, bracketed=False)


def parse_address(value: object, *, url: bool = False, default_port: int | None = None,
                  zero: str | None = None) -> Address:
    """``HOST:PORT`` or ``[IPv6]:PORT``; with ``url`` also ``http(s)://`` before it and a
    path after it. ``default_port``: the port when none is given (None: a port is
    required); ``zero``: what port 0 means where it is allowed. Raises AddressError."""
    form = address_form(url=url, default_port=default_port)
    if not isinstance(value, str):
        raise AddressError(value, form, "not text")
    netloc, scheme, path = value, "", ""
    if not url and "/" in value:
        raise AddressError(value, form, "a URL or path; give HOST:PORT alone")
    if url and "://" in value:
        scheme, rest = value.split("://", 1)
        if scheme.lower() not in URL_SCHEMES:
            raise AddressError(value, form, "the scheme must be http or https")
        scheme = scheme.lower()
        # A query or fragment names nothing on a harvest endpoint: dropped, as urlsplit would.
        match = re.fullmatch(r"([^/?#]*)(/[^?#]*)?(?:[?#].*)?", rest, re.DOTALL)
        netloc, path = match.group(1), match.group(2) or ""
    if not netloc:
        raise AddressError(value, form, "no host")
    if any(ch.isspace() for ch in netloc):
        raise AddressError(value, form, "a space in it")
    if netloc.startswith("["):
        end = netloc.find("]")
        if end < 0:
            raise AddressError(value, form, "no ']' after the IPv6 address")
        host = _host(netloc[1:end], value, form, bracketed=True)
        after = netloc[end + 1:]
        if after and not after.startswith(":"):
            raise AddressError(value, form, "expected ':PORT' after ']'")
        port_text = after[1:] if after else None
    elif netloc.count(":") > 1:
        raise AddressError(value, form, "an IPv6 address takes brackets: [ADDRESS]:PORT")
    else:
        host_text, colon, port_text = netloc.partition(":")
        host = _host(host_text, value, form, bracketed=False)
        port_text = port_text if colon else None
    if port_text is None:
        if default_port is None:
            raise AddressError(value, form, "no port")
        port = default_port
    elif not port_text:
        raise AddressError(value, form, f"no port after ':'; {port_rule(zero)}")
    else:
        try:
            port = parse_port(port_text, zero=zero)
        except AddressError as error:
            raise AddressError(value, form, error.reason) from None
    return Address(host, port, scheme, path)


def address_form(*, url: bool = False, default_port: int | None = None) -> str:
    """How the accepted form reads in messages and help."""
    port = ":PORT" if default_port is None else "[:PORT]"
    return f"[http(s)://]HOST{port}" if url else f"HOST{port}"


def named(name: str, error: AddressError) -> str:
    """The one-line message naming where the value came from: ``--server: 'h:x' is not ...``."""
    return f"{name}: {error}"


# -- argparse type= functions (a bad value: exit 2, 'argument --flag: <the error>') ----------
def _argparse(parse: Callable[[str], object]) -> Callable[[str], object]:
    def convert(text: str):
        try:
            return parse(text)
        except AddressError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return convert


def address_type(**options) -> Callable[[str], Address]:
    """An argparse ``type=`` for a flag taking an address (:func:`parse_address`'s options)."""
    return _argparse(lambda text: parse_address(text, **options))


def port_type(*, zero: str | None = None) -> Callable[[str], int]:
    """An argparse ``type=`` for a flag taking a port."""
    return _argparse(lambda text: parse_port(text, zero=zero))


def host_type() -> Callable[[str], str]:
    """An argparse ``type=`` for a flag taking a host (returned without brackets)."""
    return _argparse(parse_host)
