"""The console's web application: routes, access checks and live updates (Starlette).

Every store access opens its own connection (``opened``) in a worker thread: SQLite
connections belong to the thread that made them, and a short-lived connection always
reads the latest commit of ``fedge manager serve``. Routes hold no SQL: pages come from
``views``, changes from ``actions``, access from ``accounts`` and ``sessions``.
"""

import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from fedge.console import accounts, actions, audit, health, images, pages, teams, views
from fedge.console.accounts import Account, Role
from fedge.console.audit import Outcome
from fedge.console.cert_login import (
    PresentedOperator,
    Revocations,
    operator_of,
    presented_chain,
)
from fedge.console.conditions import readable
from fedge.console.errors import BadInput
from fedge.console.headers import SecurityHeaders
from fedge.console.live import LiveFeed
from fedge.console.security import security_page
from fedge.console.sessions import COOKIE, Session, Sessions, csrf_ok
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet.operations import Fleet, opened
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.ingest import thumbnail_store

HERE = Path(__file__).parent
LOGIN_CSRF_COOKIE = "fedge_console_login"
ADMIN_PAGES = {"audit": "audit log", "security": "security page"}  # kind -> what it is
T = TypeVar("T")


class Console:
    def __init__(self, home: ManagerHome, poll_s: float = 0.5, *, https: bool = False) -> None:
        self.home = home
        self.https = https  # served over TLS: cookies are Secure (never sent over plain HTTP)
        self.sessions = Sessions()
        self.crl = Revocations(home.pki().crl_path)  # certificate logins (cert_login.py)
        self.images = images.ImageViews(images.manager_files(home))  # stations' images
        self.live = LiveFeed(self.run, self.sessions, poll_s, lambda: health.notice(home.root))
        env = Environment(
            loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape()
        )
        env.filters["when"] = views.when
        env.filters["readable"] = readable
        self.templates = Jinja2Templates(env=env)

    # -- store access, always in a worker thread

    def _run(self, work: Callable[[Fleet], T]) -> T:
        with opened(self.home) as fleet:
            return work(fleet)

    async def run(self, work: Callable[[Fleet], T]) -> T:
        return await run_in_threadpool(self._run, work)

    async def _audit(self, *args: Any) -> None:
        await self.run(lambda fleet: audit.record(fleet.store, audit.entry(*args)))

    # -- who is asking

    async def user(self, request: Request) -> tuple[Session, Account] | None:
        session = self.sessions.get(request.cookies.get(COOKIE))
        if session is None:
            return None
        account = await self.run(lambda fleet: self.allowed(fleet, session))
        if account is None:
            self.sessions.end(session.session_id)
            return None
        return session, account

    def allowed(self, fleet: Fleet, session: Session) -> Account | None:
        """The session's account, or None when its token was removed or the operator
        certificate it logged in with was revoked: its sessions end now."""
        serial = session.certificate_serial
        if serial is not None and self.crl.revoked(serial):
            return None
        return accounts.account(fleet.store, session.name)

    def render(
        self,
        request: Request,
        page: str,
        who: tuple[Session, Account] | None,
        status: int = 200,
        **context: Any,
    ) -> Response:
        if who is not None:
            session, account = who
            context.update(user=account, csrf=session.csrf, flash=session.flash[:])
            session.flash.clear()
        return self.templates.TemplateResponse(request, page, context, status_code=status)

    def refuse(self, request: Request, who: Any, message: str, status: int = 403) -> Response:
        return self.render(request, "message.html", who, status, title="Refused", error=message)

    # -- login

    async def certificate_of(self, request: Request) -> PresentedOperator | None:
        """The operator whose certificate this connection presented (cert_login.py)."""
        chain = presented_chain(request.scope)
        if not chain:
            return None
        return await run_in_threadpool(operator_of, chain, self.home.pki().ca_path, self.crl)

    async def login_page(self, request: Request) -> Response:
        token = secrets.token_urlsafe(32)
        operator = await self.certificate_of(request)
        name = None if operator is None else operator.name
        response = self.render(request, "login.html", None, login_csrf=token, operator=name)
        response.set_cookie(
            LOGIN_CSRF_COOKIE, token, httponly=True, samesite="strict", secure=self.https
        )
        return response

    async def login(self, request: Request) -> Response:
        form = await request.form()
        submitted, cookie = form.get("csrf"), request.cookies.get(LOGIN_CSRF_COOKIE)
        fresh = isinstance(submitted, str) and cookie and secrets.compare_digest(submitted, cookie)
        if not fresh:
            return self.refuse(request, None, "the login form is stale or forged; reload it")
        token, account, how, serial = form.get("token"), None, "token", None
        if form.get("certificate") == "1":
            how, operator = "certificate", await self.certificate_of(request)
            if operator is not None:
                serial = operator.serial
                account = await self.run(lambda fleet: accounts.account(fleet.store, operator.name))
        elif isinstance(token, str):
            account = await self.run(lambda fleet: accounts.authenticate(fleet.store, token))
        if account is None:
            await self._audit("-", "-", "login", "", f"unknown {how}", Outcome.REFUSED)
            error = (
                "no console account for this connection's operator certificate"
                if how == "certificate"
                else "unknown token; ask an admin for one (`fedge console token add`)"
            )
            return self.render(request, "login.html", None, 403, login_csrf=cookie, error=error)
        await self._audit(account.name, account.role.value, "login", "", how, Outcome.DONE)
        session = self.sessions.create(account.name, certificate_serial=serial)
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(
            COOKIE, session.session_id, httponly=True, samesite="strict", secure=self.https
        )
        response.delete_cookie(LOGIN_CSRF_COOKIE)
        return response

    async def logout(self, request: Request) -> Response:
        who = await self.user(request)
        form = await request.form()
        if who is None or not csrf_ok(who[0], form.get("csrf")):
            return self.refuse(request, who, "no session or a missing CSRF token")
        self.sessions.end(who[0].session_id)
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(COOKIE)
        return response

    # -- pages

    async def page(self, request: Request, name: str, status: int = 200, **extra: Any) -> Response:
        """Page ``name`` ('fleet', 'labels', 'audit', 'models', 'rollouts', 'edge:<id>' or
        'rollout:<id>') for the user, or the login page."""
        who = await self.user(request)
        if who is None:
            return RedirectResponse("/login", status_code=303)
        kind, _, edge = name.partition(":")
        if kind in ADMIN_PAGES and who[1].role is not Role.ADMIN:
            return self.refuse(request, who, f"only an admin can read the {ADMIN_PAGES[kind]}")
        try:
            started = time.perf_counter()
            params = dict(request.query_params)
            notice = await run_in_threadpool(health.notice, self.home.root)
            context: dict[str, Any]
            if kind == "security":  # the home's files and keys, not the store alone
                context = {"security": await run_in_threadpool(security_page, self.home)}
            else:
                context = await self.run(
                    lambda fleet: pages.context(fleet, kind, edge, params, notice, who[1])
                )
            context["serve_notice"] = notice
        except ManagerError as exc:  # an edge that is not enrolled, an unknown rollout
            return self.render(request, "message.html", who, 404, title="Not found", error=str(exc))
        read = time.perf_counter()
        response = self.render(request, f"{kind}.html", who, status, **context, **extra)
        # What the page cost, split as browsers' developer tools show it (Server-Timing,
        # W3C): reading the store vs rendering the rows (issue 25: measured apart).
        response.headers["Server-Timing"] = (
            f"data;dur={(read - started) * 1000:.2f}, "
            f"render;dur={(time.perf_counter() - read) * 1000:.2f}"
        )
        return response

    async def fleet_page(self, request: Request) -> Response:
        return await self.page(request, "fleet")

    async def edge_page(self, request: Request) -> Response:
        return await self.page(request, f"edge:{request.path_params['edge']}")

    async def labels_page(self, request: Request) -> Response:
        return await self.page(request, "labels")

    async def audit_page(self, request: Request) -> Response:
        return await self.page(request, "audit")

    async def security_view(self, request: Request) -> Response:
        return await self.page(request, "security")

    async def models_page(self, request: Request) -> Response:
        return await self.page(request, "models")

    async def rollouts_page(self, request: Request) -> Response:
        return await self.page(request, "rollouts")

    async def jobs_page(self, request: Request) -> Response:
        return await self.page(request, "jobs")

    async def job_page(self, request: Request) -> Response:
        return await self.page(request, f"job:{request.path_params['job_id']}")

    async def alerts_page(self, request: Request) -> Response:
        return await self.page(request, "alerts")

    async def teams_page(self, request: Request) -> Response:
        """The console's admins and teams' admins only (console/teams.py)."""
        who = await self.user(request)
        if (
            who is not None
            and who[1].role is not Role.ADMIN
            and not await self.run(lambda f: teams.administered(f, who[1]))
        ):
            return self.refuse(request, who, "only an admin or a team's admin can read teams")
        return await self.page(request, "teams")

    async def alert_page(self, request: Request) -> Response:
        return await self.page(request, f"alert:{str(request.path_params['alert_id'])[:64]}")

    async def model_page(self, request: Request) -> Response:
        name, version = request.path_params["name"], request.path_params["version"]
        return await self.page(request, f"model:{str(name)[:128]}:{str(version)[:12]}")

    async def rollout_page(self, request: Request) -> Response:
        return await self.page(request, f"rollout:{request.path_params['rollout_id']}")

    # -- actions: session, CSRF, role, then the library call; every attempt is audited

    async def act(
        self,
        request: Request,
        action: str,
        target: str,
        do: Callable[[Fleet, Account, dict[str, str]], str],
        error_page: Callable[[dict[str, str]], str],
        done_url: Callable[[dict[str, str]], str],
        *,
        admin_only: bool = False,
    ) -> Response:
        who = await self.user(request)
        if who is None:
            await self._audit("-", "-", action, target, "no session", Outcome.REFUSED)
            return self.refuse(request, None, "log in first: this action needs a session")
        session, account = who
        raw = await request.form()
        form = {key: value for key, value in raw.items() if isinstance(value, str)}
        if not csrf_ok(session, form.get("csrf")):
            await self._audit(account.name, account.role, action, target, "CSRF", Outcome.REFUSED)
            return self.refuse(request, who, "missing or wrong CSRF token; reload the page")
        if not account.role.can_act:
            await self._audit(account.name, account.role, action, target, "role", Outcome.REFUSED)
            return self.refuse(request, who, f"{account.name} is a viewer: viewers cannot act")
        if admin_only and not account.role.can_share_images:
            await self._audit(account.name, account.role, action, target, "role", Outcome.REFUSED)
            return self.refuse(request, who, f"only an admin can {action.replace('-', ' ')}")
        if len(form) != len(raw):
            await self._audit(account.name, account.role, action, target, "file", Outcome.INVALID)
            return self.refuse(request, who, "the form sent a file it does not have", 400)

        def attempt(fleet: Fleet) -> tuple[str, Outcome]:
            try:
                done, outcome = do(fleet, account, form), Outcome.DONE
            except (BadInput, ManagerError) as exc:
                done, outcome = str(exc), Outcome.INVALID
            entry = audit.entry(account.name, account.role, action, target, done, outcome)
            audit.record(fleet.store, entry)
            return done, outcome

        message, outcome = await self.run(attempt)
        if request.headers.get("x-fedge-fetch") == "1":
            # The label queue's page posts without reloading (labels.js): the outcome as
            # JSON, the same message the page would have flashed.
            done = outcome is Outcome.DONE
            return JSONResponse({"ok": done, "message": message}, status_code=200 if done else 400)
        if outcome is Outcome.INVALID:
            return await self.page(request, error_page(form), 400, error=message)
        session.flash.append(message)
        return RedirectResponse(done_url(form), status_code=303)

    async def threshold(self, request: Request) -> Response:
        edge = str(request.path_params["edge"])

        def do(fleet: Fleet, account: Account, form: dict[str, str]) -> str:
            return actions.set_threshold(fleet, actions.parse_threshold(edge, form))

        def back(form: dict[str, str]) -> str:
            # An unknown edge's page is a 404 that names it: the same message the action had.
            return f"edge:{edge}" if form.get("back") == "edge" else "fleet"

        def done(form: dict[str, str]) -> str:
            return f"/edges/{edge}" if form.get("back") == "edge" else "/"

        return await self.act(request, "set-threshold", edge, do, back, done)

    async def thumbnails(self, request: Request) -> Response:
        edge = str(request.path_params["edge"])

        def do(fleet: Fleet, account: Account, form: dict[str, str]) -> str:
            return actions.set_thumbnails(fleet, actions.parse_thumbnails(edge, form))

        return await self.act(
            request,
            "set-thumbnails",
            edge,
            do,
            lambda _: f"edge:{edge}",
            lambda _: f"/edges/{edge}",
            admin_only=True,
        )

    async def label(self, request: Request) -> Response:
        def do(fleet: Fleet, account: Account, form: dict[str, str]) -> str:
            return actions.add_label(fleet, actions.parse_label(form), account.name)

        form = await request.form()
        target = str(form.get("prediction_id", ""))[:128]
        return await self.act(request, "label", target, do, lambda _: "labels", lambda _: "/labels")

    async def withdraw(self, request: Request) -> Response:
        """Undo a label: withdrawn at the manager and, through the labels document, at
        the station."""

        def do(fleet: Fleet, account: Account, form: dict[str, str]) -> str:
            return actions.withdraw_label(fleet, form, account.name)

        form = await request.form()
        target = str(form.get("prediction_id", ""))[:128]
        return await self.act(
            request, "withdraw-label", target, do, lambda _: "labels", lambda _: "/labels"
        )

    async def rollout_action(self, request: Request) -> Response:
        rollout_id = str(request.path_params["rollout_id"])[:64]
        operation = str(request.path_params["operation"])[:16]

        def do(fleet: Fleet, account: Account, form: dict[str, str]) -> str:
            return actions.operate_rollout(fleet, rollout_id, operation, form)

        return await self.act(
            request,
            f"rollout-{operation}",
            rollout_id,
            do,
            lambda _: f"rollout:{rollout_id}",
            lambda _: f"/rollouts/{rollout_id}",
        )

    async def team_action(self, request: Request) -> Response:
        """Grant or revoke a role in a team: its admins' and the console's admins'."""
        team, operation = str(request.path_params["team"])[:128], request.path_params["op"]
        operators = self.home.operator_accounts  # names only (operators.py)

        def do(fleet: Fleet, account: Account, form: dict[str, str]) -> str:
            if operation == "grant":
                return teams.grant(fleet, account, team, form, operators())
            return teams.revoke(fleet, account, team, form)

        return await self.act(
            request, f"team-{operation}", team, do, lambda _: "teams", lambda _: "/teams"
        )

    async def clear_alert(self, request: Request) -> Response:
        alert_id = str(request.path_params["alert_id"])[:64]

        def do(fleet: Fleet, account: Account, form: dict[str, str]) -> str:
            return actions.acknowledge_alert(fleet, alert_id, form, account.name)

        return await self.act(
            request, "clear-alert", alert_id, do, lambda _: "alerts", lambda _: "/alerts"
        )

    async def act_on_alerts(self, request: Request) -> Response:
        """Acknowledge or clear the incidents ticked on the alerts page, with a note."""
        raw = await request.form()
        picked = ",".join(str(v) for k, v in raw.items() if k.startswith("pick-"))
        action = f"{str(raw.get('operation', ''))[:16]}-alerts"

        def do(fleet: Fleet, account: Account, form: dict[str, str]) -> str:
            return actions.act_on_alerts(fleet, actions.parse_alerts(form), account.name)

        return await self.act(request, action, picked, do, lambda _: "alerts", lambda _: "/alerts")

    async def viewing(self, request: Request) -> Response:
        """Allow or stop operator viewing of a station's images: an admin's decision."""
        edge = str(request.path_params["edge"])

        def do(fleet: Fleet, account: Account, form: dict[str, str]) -> str:
            return images.set_viewing(fleet, edge, images.parse_viewing(form))

        return await self.act(
            request,
            "set-viewing",
            edge,
            do,
            lambda _: f"edge:{edge}",
            lambda _: f"/edges/{edge}",
            admin_only=True,
        )

    async def station_image(self, request: Request) -> Response:
        """A prediction's image asked of its station now, relayed, never stored; every
        attempt is in the audit log (images.py)."""
        edge = str(request.path_params["edge"])[:64]
        prediction_id = str(request.path_params["prediction_id"])[:128]
        action, target = "view-image", f"{edge}/{prediction_id}"
        who = await self.user(request)
        if who is None:
            await self._audit("-", "-", action, target, "no session", Outcome.REFUSED)
            return JSONResponse({"error": "log in first", "reason": "session"}, 403)
        account = who[1]
        if not account.role.can_act:
            await self._audit(account.name, account.role, action, target, "role", Outcome.REFUSED)
            message = f"{account.name} is a viewer: only operators view stations' images"
            return JSONResponse({"error": message, "reason": "role"}, 403)
        bad = self.images.check(edge, prediction_id)
        if bad is not None:
            await self._audit(account.name, account.role, action, target, bad, Outcome.INVALID)
            return JSONResponse({"error": bad, "reason": "bad_request"}, 400)
        asked = await self.run(lambda fleet: images.ask(fleet, edge, prediction_id))
        outcome = await images.fetch(self.images, edge, prediction_id, asked)
        result = images.audit_outcome(outcome)
        # Written before the bytes go out: no view without its audit entry.
        await self._audit(account.name, account.role, action, target, outcome.detail, result)
        return images.reply(outcome)

    async def thumbnail(self, request: Request) -> Response:
        """A thumbnail a station shared (its config said so), for any logged-in user."""
        if await self.user(request) is None:
            return Response("log in first", status_code=403)
        edge, name = str(request.path_params["edge"]), str(request.path_params["name"])
        prediction_id = name.removesuffix(".png")
        found = await self.run(lambda fleet: thumbnail_store.get(fleet.store, edge, prediction_id))
        if found is None:
            return Response("no such thumbnail", status_code=404)
        # The store holds only PNGs checked at ingest (protocols.thumbnails.check_png).
        return Response(found.png, media_type="image/png")

    # -- live updates (live.py)

    async def events(self, request: Request) -> Response:
        who = await self.user(request)
        if who is None:
            return Response("log in first", status_code=403)
        session = who[0]
        return StreamingResponse(
            self.live.stream(session.session_id, lambda fleet: self.allowed(fleet, session)),
            media_type="text/event-stream",
            headers={"x-accel-buffering": "no"},
        )


def create_app(
    home: ManagerHome, poll_s: float = 0.5, *, https: bool = False, hsts: bool = False
) -> Starlette:
    """The console over ``home``'s store; its own tables are created here if missing.
    ``https``: it is served over TLS (its cookies are marked Secure); ``hsts``: tell
    browsers to use nothing but HTTPS for this host."""
    with opened(home) as fleet:
        accounts.ensure_tables(fleet.store)
    console = Console(home, poll_s, https=https)
    routes = [
        Route("/", console.fleet_page),
        Route("/login", console.login_page, methods=["GET"]),
        Route("/login", console.login, methods=["POST"]),
        Route("/logout", console.logout, methods=["POST"]),
        Route("/edges/{edge}", console.edge_page),
        Route("/edges/{edge}/threshold", console.threshold, methods=["POST"]),
        Route("/edges/{edge}/thumbnails", console.thumbnails, methods=["POST"]),
        Route("/edges/{edge}/thumbnails/{name}", console.thumbnail),
        Route("/edges/{edge}/viewing", console.viewing, methods=["POST"]),
        Route("/edges/{edge}/images/{prediction_id}", console.station_image),
        Route("/labels", console.labels_page, methods=["GET"]),
        Route("/labels", console.label, methods=["POST"]),
        Route("/labels/withdraw", console.withdraw, methods=["POST"]),
        Route("/audit", console.audit_page),
        Route("/security", console.security_view),
        Route("/models", console.models_page),
        Route("/alerts", console.alerts_page, methods=["GET"]),
        Route("/jobs", console.jobs_page),
        Route("/teams", console.teams_page),
        Route("/teams/{team}/{op:str}", console.team_action, methods=["POST"]),
        Route("/jobs/{job_id}", console.job_page),
        Route("/alerts", console.act_on_alerts, methods=["POST"]),
        Route("/alerts/{alert_id}", console.alert_page),
        Route("/alerts/{alert_id}/clear", console.clear_alert, methods=["POST"]),
        Route("/models/{name}/{version}", console.model_page),
        Route("/rollouts", console.rollouts_page),
        Route("/rollouts/{rollout_id}", console.rollout_page),
        Route("/rollouts/{rollout_id}/{operation}", console.rollout_action, methods=["POST"]),
        Route("/events", console.events),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    app = Starlette(routes=routes)
    app.add_middleware(SecurityHeaders, hsts=hsts)
    app.state.console = console
    return app
