"""The `http` setting: where the HTTP APIs listen, and whether that address is loopback."""

from __future__ import annotations

import ipaddress

OFF = "off"


def parse_http_setting(value: str) -> str:
    """`off`, or HOST:PORT normalised (IPv6 hosts in brackets); ValueError says what is wrong."""
    text = value.strip()
    if text.lower() in (OFF, "false", "no", "none", ""):
        return OFF
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:52380) or {OFF}")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"port {port_text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{port} is not a TCP port")
    host = host.strip("[]")
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"host {host!r} is not an IP address or localhost") from None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """True for localhost and 127.0.0.0/8 / ::1: only this machine can connect."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url_for(host: str, port: int) -> str:
    """The base URL a client on this machine (or the network, for a public bind) uses."""
    if host in ("0.0.0.0", "::", "localhost"):
        host = "127.0.0.1" if host != "::" else "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
