"""The headers every console response carries (an ASGI middleware)."""

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Pages load nothing from elsewhere (plants are offline) and run no inline script. blob:
# images are a station's image the page fetched itself (labels.js, issue 30).
SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
        b"frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
]
# Served over TLS, a browser that has seen the console once does not fall back to plain
# HTTP for it (RFC 6797); a year, the common value.
HSTS = (b"strict-transport-security", b"max-age=31536000")


class SecurityHeaders:
    def __init__(self, app: ASGIApp, *, hsts: bool = False) -> None:
        self.app = app
        self.headers = [*SECURITY_HEADERS, *([HSTS] if hsts else [])]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *self.headers]
            await send(message)

        await self.app(scope, receive, with_headers)
