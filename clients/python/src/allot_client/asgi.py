"""ASGI middleware: admits each HTTP request before the application sees it.

Admitted, the request goes on and its response carries the ``RateLimit`` fields the caller may see;
refused, the caller gets the agent's 429 or 503 problem+json with ``Retry-After``; without a
decision, the fail mode says which. When the response ends (sent whole, the caller gone, or the
application failed) the request's concurrency slots are given back and its metered cost settled.

Who the request is from is the application's business: ``identify`` reads the ASGI scope (where
the application's own authentication left the verified identity) and says how to admit it, or
``None`` to let it through unlimited."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

from .client import AsyncAgentClient, Checked
from .wire import AdmissionRequest, Principal, Problem

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

#: What to do with a request the agent gave no decision for: ``closed`` (the default) refuses it
#: with 503 and ``Retry-After: 1``; ``open`` lets it through unlimited.
FailMode = Literal["closed", "open"]

log = logging.getLogger("allot_client")

_UNAVAILABLE: Problem = {
    "type": "about:blank",
    "title": "Rate limiter unavailable",
    "status": 503,
    "detail": "The request could not be checked against its quota. Retry later.",
}


@dataclass
class Admission:
    """How one request is to be admitted: from the verified identity only."""

    tenant_id: str
    principal: Principal
    route_group: str
    #: Units the request costs (1 to 2^30). For a metered request, the estimate.
    cost: int = 1
    #: Charge ``cost`` now and the actual cost when the response ends, as the application states it
    #: on the request's meter (``scope["allot"].meter``); unstated, the estimate stands.
    metered: bool = False
    #: The route's rules hold concurrency slots: give them back when the response ends.
    releases_slots: bool = False
    #: Renew the slots every this many seconds while the response runs; implies ``releases_slots``.
    renew_every_s: float | None = None
    #: The request's id, when the application has one stable across the caller's retries.
    request_id: str | None = None
    #: This request's fail mode, instead of the middleware's.
    when_undecided: FailMode | None = None

    def to_wire(self, method: str) -> AdmissionRequest:
        wire: AdmissionRequest = {
            "requestId": self.request_id or str(uuid.uuid4()),
            "tenantId": self.tenant_id,
            "principal": self.principal,
            "routeGroup": self.route_group,
            "method": method.upper(),
            "costHint": self.cost,
        }
        if self.metered:
            wire["metered"] = True
        return wire


class MeteredCost:
    """A metered request's actual cost, for the application to state; settled when the response ends."""

    def __init__(self) -> None:
        self._units: int | None = None

    def set(self, units: int) -> None:
        """States the actual cost, whole units (the last statement counts)."""
        self._units = _whole(units)

    def add(self, units: int) -> None:
        """Adds to the actual cost (for a response that counts as it streams)."""
        self._units = _whole((self._units or 0) + units)

    def get(self) -> int | None:
        """The stated cost, if any."""
        return self._units


def _whole(units: int) -> int:
    if isinstance(units, bool) or not isinstance(units, int) or units < 0:
        raise ValueError(f"a cost must be a whole number of units, not {units!r}")
    return units


@dataclass
class Admitted:
    """What the middleware puts in ``scope["allot"]`` for an admitted request."""

    checked: Checked
    request_id: str
    meter: MeteredCost | None = None


class AllotMiddleware:
    """``app = AllotMiddleware(app, client=AsyncAgentClient(...), identify=...)``."""

    def __init__(
        self,
        app: App,
        *,
        client: AsyncAgentClient,
        identify: Callable[[Scope], Admission | None | Awaitable[Admission | None]],
        when_undecided: FailMode = "closed",
    ) -> None:
        self.app = app
        self.client = client
        self.identify = identify
        self.when_undecided = when_undecided
        #: Completions under way, kept referenced until they end (asyncio holds tasks weakly).
        self._pending: set[asyncio.Future[None]] = set()

    async def aclose(self, timeout_s: float = 5.0) -> None:
        """Waits, at most `timeout_s`, for the completions under way (at shutdown)."""
        if self._pending:
            await asyncio.wait(self._pending, timeout=timeout_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            admission = self.identify(scope)
            if asyncio.iscoroutine(admission) or isinstance(admission, Awaitable):
                admission = await admission
        except Exception:
            log.exception("identify raised: the request is refused")
            await _problem(send, 503, {"retry-after": "1"}, _UNAVAILABLE)
            return
        if admission is None:
            await self.app(scope, receive, send)
            return
        mode = admission.when_undecided or self.when_undecided
        wire = admission.to_wire(scope.get("method", "GET"))
        try:
            checked = await self.client.check(wire)
        except Exception as error:  # noqa: BLE001 - whatever kept the decision away, the fail mode answers
            await self._undecided(mode, error, scope, receive, send)
            return
        if not checked.allowed:
            # A refusal always carries the agent's problem (`check`).
            assert checked.problem is not None
            await _problem(send, checked.status, checked.caller_headers, checked.problem)
            return
        await self._admitted(admission, wire, checked, scope, receive, send)

    async def _admitted(
        self, admission: Admission, wire: AdmissionRequest, checked: Checked, scope: Scope, receive: Receive, send: Send
    ) -> None:
        meter = MeteredCost() if admission.metered else None
        scope["allot"] = Admitted(checked=checked, request_id=wire["requestId"], meter=meter)
        shown = [
            (name.encode("latin-1"), value.encode("latin-1"))
            for name, value in checked.caller_headers.items()
            if name != "retry-after"
        ]
        replaced = {name for name, _ in shown}

        async def send_with_fields(message: Message) -> None:
            # The agent's fields replace any of the same name the application set.
            if message["type"] == "http.response.start" and shown:
                message = dict(message)
                kept = [(n, v) for n, v in message.get("headers", []) if bytes(n).lower() not in replaced]
                message["headers"] = [*kept, *shown]
            await send(message)

        releases_slots = admission.releases_slots or admission.renew_every_s is not None
        heartbeat = (
            asyncio.create_task(self._heartbeat(wire, admission.renew_every_s))
            if releases_slots and admission.renew_every_s
            else None
        )
        try:
            await self.app(scope, receive, send_with_fields)
        finally:
            # The response ended, the caller went away, or the application failed: complete once.
            if heartbeat is not None:
                heartbeat.cancel()
            completion = asyncio.ensure_future(self._complete(wire, releases_slots, meter))
            self._pending.add(completion)
            completion.add_done_callback(self._pending.discard)

    async def _heartbeat(self, wire: AdmissionRequest, period_s: float | None) -> None:
        while period_s:
            await asyncio.sleep(period_s)
            try:
                await self.client.renew(wire)
            except Exception as error:  # noqa: BLE001 - a heartbeat that fails tries again next period
                log.warning("could not renew a request's concurrency slots: %s", error)

    async def _complete(self, wire: AdmissionRequest, releases_slots: bool, meter: MeteredCost | None) -> None:
        if releases_slots:
            try:
                await self.client.release(wire)
            except Exception as error:  # noqa: BLE001 - the slot lapses with its lease
                log.warning("could not release a request's concurrency slots; they lapse with their lease: %s", error)
        actual = meter.get() if meter is not None else None
        if actual is not None:
            try:
                await self.client.settle(
                    {"decisionId": wire["requestId"], "tenantId": wire["tenantId"], "actualCost": actual}
                )
            except Exception as error:  # noqa: BLE001 - the estimate stands
                log.warning("could not settle a metered request; its estimate stands: %s", error)

    async def _undecided(self, mode: FailMode, error: Exception, scope: Scope, receive: Receive, send: Send) -> None:
        if mode == "open":
            log.warning("no decision from the agent: let through unlimited (fail open): %s", error)
            await self.app(scope, receive, send)
            return
        log.warning("no decision from the agent: refused (fail closed): %s", error)
        await _problem(send, 503, {"retry-after": "1"}, _UNAVAILABLE)


async def _problem(send: Send, status: int, headers: dict[str, str], problem: Problem) -> None:
    body = json.dumps(problem).encode()
    raw = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]
    raw += [(b"content-type", b"application/problem+json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
