"""Where the console listens: this machine only, unless the operator says otherwise."""

import ipaddress

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8470


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
