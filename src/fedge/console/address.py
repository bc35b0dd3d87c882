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


def wants_tls(host: str, flag: bool | None, has_fleet_ca: bool) -> bool:
    """Whether the console serves HTTPS: as asked (``flag``), else when other machines
    can reach ``host`` and the home has a fleet CA to issue its certificate."""
    if flag is not None:
        return flag
    return has_fleet_ca and not is_loopback(host)
