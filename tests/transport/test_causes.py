"""Which cause a failed connection names (issue 27): pure, from the error or its text."""

import errno
import socket
import ssl

import pytest

from fedge.transport.causes import LinkCause, classify, explain


def _ssl_error(reason: str, text: str) -> ssl.SSLError:
    error = ssl.SSLError(1, text)
    error.reason = reason
    return error


@pytest.mark.parametrize(
    ("error", "cause"),
    [
        (ssl.SSLCertVerificationError(1, "certificate verify failed"), LinkCause.SERVER_UNTRUSTED),
        (
            _ssl_error("SSLV3_ALERT_CERTIFICATE_REVOKED", "sslv3 alert certificate revoked"),
            LinkCause.CERTIFICATE_REVOKED,
        ),
        (
            _ssl_error("TLSV1_ALERT_UNKNOWN_CA", "tlsv1 alert unknown ca"),
            LinkCause.CERTIFICATE_REFUSED,
        ),
        (
            _ssl_error("TLSV13_ALERT_CERTIFICATE_REQUIRED", "alert certificate required"),
            LinkCause.CERTIFICATE_REFUSED,
        ),
        (_ssl_error("WRONG_VERSION_NUMBER", "wrong version number"), LinkCause.TLS_FAILED),
        (ssl.SSLEOFError(8, "EOF occurred in violation of protocol"), LinkCause.CLOSED),
        (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), LinkCause.PORT_CLOSED),
        (OSError(errno.ENETUNREACH, "Network is unreachable"), LinkCause.UNREACHABLE),
        (OSError(errno.EHOSTUNREACH, "No route to host"), LinkCause.UNREACHABLE),
        (TimeoutError("timed out"), LinkCause.TIMED_OUT),
        (socket.gaierror(-2, "Name or service not known"), LinkCause.NAME_UNRESOLVED),
        (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), LinkCause.CLOSED),
        (BrokenPipeError(errno.EPIPE, "Broken pipe"), LinkCause.CLOSED),
        (RuntimeError("something else"), LinkCause.UNKNOWN),
        (None, LinkCause.UNKNOWN),
    ],
)
def test_an_exception_names_its_cause(error: BaseException | None, cause: LinkCause) -> None:
    assert classify(error) is cause


@pytest.mark.parametrize(
    ("text", "cause"),
    [
        # paho's log of a socket that failed under it
        (
            "failed to receive on socket: [SSL: SSLV3_ALERT_CERTIFICATE_REVOKED] sslv3 alert "
            "certificate revoked (_ssl.c:2580)",
            LinkCause.CERTIFICATE_REVOKED,
        ),
        (
            "failed to receive on socket: [SSL: TLSV1_ALERT_UNKNOWN_CA] tlsv1 alert unknown ca",
            LinkCause.CERTIFICATE_REFUSED,
        ),
        ("failed to receive on socket: [Errno 104] Connection reset by peer", LinkCause.CLOSED),
        ("timeout on socket: timed out", LinkCause.TIMED_OUT),
        # Flower's SuperNode (httpx) as its log carries it
        (
            "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get local "
            "issuer certificate (_ssl.c:1006)",
            LinkCause.SERVER_UNTRUSTED,
        ),
        ("[Errno 111] Connection refused", LinkCause.PORT_CLOSED),
        ("[Errno 101] Network is unreachable", LinkCause.UNREACHABLE),
        ("[Errno 113] No route to host", LinkCause.UNREACHABLE),
        ("EOF occurred in violation of protocol (_ssl.c:992)", LinkCause.CLOSED),
        ("", LinkCause.UNKNOWN),
    ],
)
def test_a_logged_error_names_its_cause(text: str, cause: LinkCause) -> None:
    assert classify(text) is cause


def test_a_wrapped_error_is_classified_by_what_it_wraps() -> None:
    try:
        try:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        except OSError as inner:
            raise RuntimeError("All connection attempts failed") from inner
    except RuntimeError as outer:
        assert classify(outer) is LinkCause.PORT_CLOSED


def test_only_tls_causes_suggest_certificates() -> None:
    for cause in LinkCause:
        text = explain(cause, "the broker", "10.0.0.5:8883")
        assert "10.0.0.5:8883" in text
        if cause.is_tls:
            assert text.startswith("TLS")
        else:
            assert "certificate" not in text.replace("not a certificate problem", "")
