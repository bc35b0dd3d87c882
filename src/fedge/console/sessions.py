"""Login sessions and CSRF tokens, held in the console process's memory.

The cookie carries only a random session id (HttpOnly, SameSite=Strict); the account
name, role and CSRF token stay on the server. Sessions die with the process: a restarted
console asks everyone to log in again, which is the safe side. Each session has its own
CSRF token, put in every form and checked on every POST (SameSite alone does not cover
old browsers or a same-site page).
"""

import secrets
import threading
import time
from dataclasses import dataclass, field

COOKIE = "fedge_console"
IDLE_TIMEOUT_S = 8 * 3600.0  # a working shift


@dataclass
class Session:
    session_id: str = field(repr=False)
    name: str
    csrf: str = field(repr=False)
    last_used: float
    flash: list[str] = field(default_factory=list)  # messages for the next page shown
    certificate_serial: int | None = None  # logged in with this operator certificate


class Sessions:
    def __init__(self, idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        self.idle_timeout_s = idle_timeout_s
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def create(self, name: str, certificate_serial: int | None = None) -> Session:
        session = Session(
            secrets.token_urlsafe(32),
            name,
            secrets.token_urlsafe(32),
            time.time(),
            certificate_serial=certificate_serial,
        )
        with self._lock:
            self._sessions[session.session_id] = session
        return session

    def get(self, session_id: str | None) -> Session | None:
        if not session_id:
            return None
        now = time.time()
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                return None
            if now - session.last_used > self.idle_timeout_s:
                del self._sessions[session_id]
                return None
            session.last_used = now
            return session

    def end(self, session_id: str | None) -> None:
        with self._lock:
            self._sessions.pop(session_id or "", None)


def csrf_ok(session: Session, submitted: object) -> bool:
    return isinstance(submitted, str) and secrets.compare_digest(session.csrf, submitted)
