"""Why a connection failed, named from the error itself: the network, or TLS (issue 27).

Pure. A link cut, a stopped broker and a certificate the far side refused all end a
connection; only the last is an operator's certificate problem, and telling them a
network cut "is a certificate problem" sends them the wrong way. :func:`classify` turns
what the socket layer raised (an exception, or its text as paho's or Flower's logs carry
it) into a :class:`LinkCause`; :func:`explain` says what that means and what to do.

The order of the checks matters: ``ssl.SSLCertVerificationError`` is also a
``ValueError`` and an ``OSError``, and an SSL alert's text can mention "connection"; TLS
is recognised first, then errno values, then exception types, then text.
"""

from __future__ import annotations

import enum
import errno
import re
import socket
import ssl


class LinkCause(enum.Enum):
    SERVER_UNTRUSTED = "server-untrusted"  # the far side's certificate did not verify
    CERTIFICATE_REFUSED = "certificate-refused"  # the far side refused ours (TLS alert)
    CERTIFICATE_REVOKED = "certificate-revoked"  # ... because it is revoked
    TLS_FAILED = "tls-failed"  # another TLS failure (protocol, cipher)
    PORT_CLOSED = "port-closed"  # the host answered: nothing listens on the port
    UNREACHABLE = "unreachable"  # no route: link down, wrong network
    TIMED_OUT = "timed-out"  # no answer at all: a cut link or a dropping firewall
    NAME_UNRESOLVED = "name-unresolved"  # DNS
    CLOSED = "closed"  # an established connection ended: reset, EOF, broken pipe
    UNKNOWN = "unknown"

    @property
    def is_tls(self) -> bool:
        return self in _TLS


_TLS = frozenset(
    {
        LinkCause.SERVER_UNTRUSTED,
        LinkCause.CERTIFICATE_REFUSED,
        LinkCause.CERTIFICATE_REVOKED,
        LinkCause.TLS_FAILED,
    }
)
_ERRNO = {
    errno.ECONNREFUSED: LinkCause.PORT_CLOSED,
    errno.ENETUNREACH: LinkCause.UNREACHABLE,
    errno.EHOSTUNREACH: LinkCause.UNREACHABLE,
    errno.ENETDOWN: LinkCause.UNREACHABLE,
    errno.EHOSTDOWN: LinkCause.UNREACHABLE,
    errno.ETIMEDOUT: LinkCause.TIMED_OUT,
    errno.ECONNRESET: LinkCause.CLOSED,
    errno.EPIPE: LinkCause.CLOSED,
    errno.ECONNABORTED: LinkCause.CLOSED,
}
# The same causes as text (paho logs "failed to receive on socket: <error>", Flower's
# SuperNode "[SSL: CERTIFICATE_VERIFY_FAILED] ..." or "[Errno 111] Connection refused").
_TEXT: tuple[tuple[re.Pattern[str], LinkCause], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), cause)
    for pattern, cause in (
        (r"certificate[_ ]verify[_ ]failed|certificate verify failed", LinkCause.SERVER_UNTRUSTED),
        (r"alert[_ ]certificate[_ ]revoked|certificate revoked", LinkCause.CERTIFICATE_REVOKED),
        (
            r"alert[_ ](bad|unknown|unsupported|expired)[_ ]?(certificate|ca)|"
            r"alert[_ ]certificate[_ ](required|expired|unknown)|alert[_ ]access[_ ]denied|"
            r"alert[_ ]unknown[_ ]ca|alert[_ ]decrypt[_ ]error",
            LinkCause.CERTIFICATE_REFUSED,
        ),
        (r"eof occurred in violation of protocol|unexpected eof", LinkCause.CLOSED),
        (r"\[SSL|\bssl\b|\btls\b|handshake", LinkCause.TLS_FAILED),
        (r"errno 111\b|connection refused", LinkCause.PORT_CLOSED),
        (
            r"errno (101|113|100|112)\b|network is unreachable|no route to host|network is down",
            LinkCause.UNREACHABLE,
        ),
        (
            r"name or service not known|name resolution|nodename nor servname",
            LinkCause.NAME_UNRESOLVED,
        ),
        (r"timed? ?out|errno 110\b", LinkCause.TIMED_OUT),
        (
            r"reset by peer|broken pipe|errno (104|32)\b|\beof\b|connection aborted",
            LinkCause.CLOSED,
        ),
    )
)


def classify(error: BaseException | str | None) -> LinkCause:
    """The cause of a failed or ended connection, from what was raised (or its text)."""
    if error is None:
        return LinkCause.UNKNOWN
    if isinstance(error, BaseException):
        if isinstance(error, ssl.SSLCertVerificationError):
            return LinkCause.SERVER_UNTRUSTED
        if isinstance(error, ssl.SSLEOFError | ssl.SSLZeroReturnError):
            return LinkCause.CLOSED  # closed without an alert: nothing TLS said no
        if isinstance(error, ssl.SSLError):
            # An alert from the far side names the refusal in its reason.
            by_text = _by_text(f"{error.reason or ''} {error}")
            return by_text if by_text.is_tls else LinkCause.TLS_FAILED
        if isinstance(error, socket.gaierror):
            return LinkCause.NAME_UNRESOLVED
        if isinstance(error, OSError) and error.errno in _ERRNO:
            return _ERRNO[error.errno]
        if isinstance(error, TimeoutError):
            return LinkCause.TIMED_OUT
        if isinstance(error, ConnectionError | EOFError):
            return LinkCause.CLOSED
        # A wrapper (httpx.ConnectError, ...) carries the cause in its chain or its text.
        cause = error.__cause__ or error.__context__
        if cause is not None and cause is not error:
            inner = classify(cause)
            if inner is not LinkCause.UNKNOWN:
                return inner
        return _by_text(str(error))
    return _by_text(error)


def _by_text(text: str) -> LinkCause:
    for pattern, cause in _TEXT:
        if pattern.search(text):
            return cause
    return LinkCause.UNKNOWN


def explain(cause: LinkCause, peer: str, address: str) -> str:
    """What ``cause`` means for the connection to ``peer`` ("the broker") at ``address``,
    and what to do about it; one sentence for a log line."""
    return _EXPLAIN[cause].format(peer=peer, address=address)


_EXPLAIN = {
    LinkCause.SERVER_UNTRUSTED: (
        "TLS: {peer}'s certificate at {address} does not verify against this station's "
        "fleet CA (a CA file from another fleet, or an address the certificate does not "
        "name); check the CA in the configuration is this fleet's"
    ),
    LinkCause.CERTIFICATE_REFUSED: (
        "TLS: {peer} at {address} refused this station's certificate in the handshake "
        "(not from the fleet CA, or expired); renew it or enroll the station again"
    ),
    LinkCause.CERTIFICATE_REVOKED: (
        "TLS: {peer} at {address} refused this station's certificate as revoked; the "
        "station must be enrolled again (`fedge edge enroll`) before it can connect"
    ),
    LinkCause.TLS_FAILED: (
        "TLS handshake with {peer} at {address} failed (protocol or cipher mismatch?)"
    ),
    LinkCause.PORT_CLOSED: (
        "network: the host at {address} answered but nothing listens on the port; is "
        "{peer} running there?"
    ),
    LinkCause.UNREACHABLE: (
        "network: no route to {address}; check this station's network link and routes "
        "(not a certificate problem)"
    ),
    LinkCause.TIMED_OUT: (
        "network: {address} did not answer in time; a cut link or a firewall dropping "
        "packets (not a certificate problem)"
    ),
    LinkCause.NAME_UNRESOLVED: (
        "network: the name in {address} does not resolve; check DNS or use an IP address"
    ),
    LinkCause.CLOSED: (
        "network: the connection to {address} was closed (reset, broken or ended) "
        "without a TLS alert; a network cut or {peer} restarting (not a certificate problem)"
    ),
    LinkCause.UNKNOWN: "the connection to {peer} at {address} failed for an unrecognised reason",
}
