"""The typed clients, sync and async: one method per agent endpoint, every call bounded in time,
size and attempts.

A call that gets no answer (the connection fails, an attempt times out, something between answers
500, 502 or 504, which the agent never sends) is tried again with the same body, so an admission
keeps its ``requestId`` and a rule that says ``idempotent`` answers the retry with the first
admission instead of charging twice. An answer, even a refusal, is never retried."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlencode

import httpx

from .wire import (
    AdmissionRequest,
    Decision,
    FieldError,
    PrincipalType,
    Problem,
    QuotaStatus,
    SettleAnswer,
    SettleRequest,
    SlotRenewal,
    validate_admission,
    validate_quota_query,
    validate_settlement,
)

#: How long one attempt may take unless set otherwise, seconds (the agent answers within its own 2 s).
DEFAULT_CALL_TIMEOUT_S = 0.5
#: Attempts of one call unless set otherwise (the first and one retry).
DEFAULT_MAX_ATTEMPTS = 2
#: Most attempts a client may be set to make: every retry is bounded.
MAX_ATTEMPTS = 5
#: Longest a client may let one attempt take, seconds.
MAX_CALL_TIMEOUT_S = 10.0
#: Pause before the first retry unless set otherwise, seconds; each later one doubles, plus jitter.
DEFAULT_RETRY_BACKOFF_S = 0.02
#: Largest answer read, bytes: an agent's answers are a few kilobytes.
MAX_ANSWER_BYTES = 1 << 20
#: The headers of a ``/v1/check`` answer a caller may be shown.
CALLER_HEADERS = ("retry-after", "ratelimit-policy", "ratelimit", "x-allot-soft-limit-exceeded")

PROBLEM_CONTENT_TYPE = "application/problem+json"


class ClientError(Exception):
    """Why a call has no answer to give.

    ``kind`` is ``invalid`` (not sent: it breaks the contract; ``field`` names the field),
    ``unreachable`` (no answer after ``attempts`` attempts), ``refused`` (the agent answered and
    refused the call: ``status`` and its ``problem``) or ``config`` (the client cannot be built)."""

    def __init__(
        self,
        kind: Literal["invalid", "unreachable", "refused", "config"],
        message: str,
        *,
        field: str | None = None,
        status: int | None = None,
        problem: Problem | None = None,
        attempts: int | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.field = field
        self.status = status
        self.problem = problem
        self.attempts = attempts


@dataclass
class Checked:
    """The answer of ``POST /v1/check``: the decision as a proxy passes it on."""

    #: 200 when admitted, 429 when a limit said no, 503 when a fail-closed rule could not decide.
    status: int
    allowed: bool
    #: The headers the caller may be shown, lower-case names, only those the agent sent.
    caller_headers: dict[str, str] = field(default_factory=dict)
    #: The shadow rules that would have refused, for the service's logs; never for the caller.
    shadow_denied: str | None = None
    #: A metered admission's settle deadline, epoch ms.
    settle_by_ms: int | None = None
    #: A refusal's problem+json, as the caller may read it.
    problem: Problem | None = None

    @property
    def retry_after_seconds(self) -> int | None:
        """The whole seconds a refused caller should wait, when the agent said."""
        return _whole_number(self.caller_headers.get("retry-after"))


@dataclass
class _Answer:
    status: int
    headers: httpx.Headers
    body: bytes

    def is_problem(self) -> bool:
        return self.headers.get("content-type", "").startswith(PROBLEM_CONTENT_TYPE)

    def problem(self) -> Problem:
        try:
            problem = json.loads(self.body)
            if isinstance(problem, dict) and isinstance(problem.get("detail"), str):
                return problem  # type: ignore[return-value]
        except ValueError:
            pass
        return {
            "type": "about:blank",
            "title": httpx.codes.get_reason_phrase(self.status) or "Error",
            "status": self.status,
            "detail": self.body.decode("utf-8", "replace").strip()[:512],
        }

    def refused(self) -> ClientError:
        problem = self.problem()
        return ClientError(
            "refused",
            f"the agent refused the call ({self.status}): {problem['detail']}",
            field=problem.get("field"),
            status=self.status,
            problem=problem,
        )

    def json(self, base_url: str) -> Any:
        try:
            return json.loads(self.body)
        except ValueError as error:
            raise ClientError(
                "unreachable", f"the agent at {base_url} gave an answer that is not the contract's: {error}", attempts=1
            ) from error


def _whole_number(value: str | None) -> int | None:
    """A header's whole number, ASCII digits only (`isdigit` would take "²")."""
    return int(value) if value is not None and re.fullmatch(r"[0-9]{1,18}", value) else None


def is_no_answer(status: int) -> bool:
    """Statuses the agent never sends: a proxy's, a load balancer's or a crash's."""
    return status in (500, 502, 504)


def backoff_s(base_s: float, attempt: int) -> float:
    """The pause before attempt ``attempt`` (2 or more): ``base * 2^(attempt-2)`` plus up to as much again."""
    pause = base_s * 2 ** min(max(attempt - 2, 0), 16)
    return pause + random.uniform(0, pause)


def _guard(validate: Any, *args: Any) -> None:
    try:
        validate(*args)
    except FieldError as error:
        raise ClientError("invalid", f"invalid request: {error}", field=error.field) from error


class _Calls:
    """What both clients share: settings, and how each endpoint's call is made and read."""

    def __init__(
        self,
        base_url: str,
        gateway_token: str,
        *,
        call_timeout_s: float,
        max_attempts: int,
        retry_backoff_s: float,
    ) -> None:
        base_url = base_url.rstrip("/")
        if not base_url.startswith(("http://", "https://")):
            raise ClientError("config", f"client configuration: the agent URL must start with http:// or https://, not {base_url!r}")
        if not gateway_token.strip():
            raise ClientError("config", "client configuration: the gateway token is empty")
        # Never echoed: a token is a secret, and a header that cannot carry it would print it.
        if not all("\x21" <= c <= "\x7e" for c in gateway_token.strip()):
            raise ClientError(
                "config", "client configuration: the gateway token must be visible ASCII characters, without spaces"
            )
        if not (isinstance(max_attempts, int) and 1 <= max_attempts <= MAX_ATTEMPTS):
            raise ClientError("config", f"client configuration: max attempts must be 1 to {MAX_ATTEMPTS}, not {max_attempts}")
        if not 0 < call_timeout_s <= MAX_CALL_TIMEOUT_S:
            raise ClientError("config", f"client configuration: the call timeout must be above 0 and at most {MAX_CALL_TIMEOUT_S} s")
        if not 0 <= retry_backoff_s <= MAX_CALL_TIMEOUT_S:
            raise ClientError("config", f"client configuration: the retry backoff must be 0 to {MAX_CALL_TIMEOUT_S} s")
        self.base_url = base_url
        self.max_attempts = max_attempts
        self.call_timeout_s = call_timeout_s
        self.retry_backoff_s = retry_backoff_s
        self._headers = {"authorization": f"Bearer {gateway_token.strip()}", "accept": "application/json"}
        #: Retries made, for the service's metrics.
        self.retries = 0

    def __repr__(self) -> str:  # never the token
        return f"{type(self).__name__}(base_url={self.base_url!r}, max_attempts={self.max_attempts})"

    def _request(self, http: httpx.Client | httpx.AsyncClient, method: str, path: str, body: Any) -> httpx.Request:
        headers = dict(self._headers)
        content = None
        if body is not None:
            headers["content-type"] = "application/json"
            content = json.dumps(body, separators=(",", ":")).encode()
        return http.build_request(method, f"{self.base_url}{path}", headers=headers, content=content)

    def _unreachable(self, last: str) -> ClientError:
        return ClientError(
            "unreachable",
            f"the agent at {self.base_url} did not answer after {self.max_attempts} attempt(s): {last}",
            attempts=self.max_attempts,
        )

    # How each endpoint's answer is read, the same for both clients.

    def _decision(self, answer: _Answer) -> Decision:
        if answer.status == 200:
            return answer.json(self.base_url)
        raise answer.refused()

    def _checked(self, answer: _Answer) -> Checked:
        decided = answer.status == 200 or (answer.status in (429, 503) and answer.is_problem())
        if not decided:
            raise answer.refused()
        caller_headers = {name: answer.headers[name] for name in CALLER_HEADERS if name in answer.headers}
        allowed = answer.status == 200
        settle_by = answer.headers.get("x-allot-settle-by-ms")
        return Checked(
            status=answer.status,
            allowed=allowed,
            caller_headers=caller_headers,
            shadow_denied=answer.headers.get("x-allot-shadow-denied"),
            settle_by_ms=_whole_number(settle_by),
            problem=None if allowed else answer.problem(),
        )

    def _released(self, answer: _Answer) -> None:
        if answer.status not in (200, 204):
            raise answer.refused()

    @staticmethod
    def _quota_path(tenant_id: str, principal_type: PrincipalType, principal_id: str, route_group: str | None) -> str:
        _guard(validate_quota_query, tenant_id, principal_id, route_group)
        query = {"tenantId": tenant_id, "principalType": principal_type, "principalId": principal_id}
        if route_group is not None:
            query["routeGroup"] = route_group
        return f"/v1/quota?{urlencode(query)}"

    def _text(self, answer: _Answer) -> str:
        if answer.status == 200:
            return answer.body.decode("utf-8", "replace")
        raise answer.refused()


def _limits() -> httpx.Limits:
    return httpx.Limits(max_connections=64, max_keepalive_connections=16)


class AgentClient(_Calls):
    """A client of one region agent's gateway API, for threads. One connection pool; share it.

    ``verify`` is what httpx takes: ``True`` (the system's CAs), a path to a CA bundle, or an
    ``ssl.SSLContext`` (with a client certificate for an agent that asks for one)."""

    def __init__(
        self,
        base_url: str,
        gateway_token: str,
        *,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        retry_backoff_s: float = DEFAULT_RETRY_BACKOFF_S,
        verify: Any = True,
    ) -> None:
        super().__init__(
            base_url, gateway_token, call_timeout_s=call_timeout_s, max_attempts=max_attempts, retry_backoff_s=retry_backoff_s
        )
        self._http = httpx.Client(timeout=call_timeout_s, limits=_limits(), verify=verify, trust_env=False)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def admit(self, request: AdmissionRequest) -> Decision:
        """``POST /v1/admit``: the decision."""
        _guard(validate_admission, request)
        return self._decision(self._send("POST", "/v1/admit", request))

    def check(self, request: AdmissionRequest) -> Checked:
        """``POST /v1/check``: the decision as a proxy passes it on."""
        _guard(validate_admission, request)
        return self._checked(self._send("POST", "/v1/check", request))

    def release(self, request: AdmissionRequest) -> None:
        """``POST /v1/release``: gives back the concurrency slots ``request`` holds (idempotent)."""
        _guard(validate_admission, request)
        self._released(self._send("POST", "/v1/release", request))

    def renew(self, request: AdmissionRequest) -> SlotRenewal:
        """``POST /v1/renew``: extends the concurrency slots ``request`` holds (a heartbeat)."""
        _guard(validate_admission, request)
        return self._decision(self._send("POST", "/v1/renew", request))  # type: ignore[return-value]

    def settle(self, settlement: SettleRequest) -> SettleAnswer:
        """``POST /v1/settle``: the actual cost of a metered admission (404: nothing of that id is
        open; 409: settled before with another cost)."""
        _guard(validate_settlement, settlement)
        return self._decision(self._send("POST", "/v1/settle", settlement))  # type: ignore[return-value]

    def quota(
        self, tenant_id: str, principal_type: PrincipalType, principal_id: str, route_group: str | None = None
    ) -> QuotaStatus:
        """``GET /v1/quota``: the caller's own quotas and what is left of them."""
        path = self._quota_path(tenant_id, principal_type, principal_id, route_group)
        return self._decision(self._send("GET", path))  # type: ignore[return-value]

    def healthz(self) -> bool:
        """``GET /healthz``: whether the agent's process answers."""
        return self._send("GET", "/healthz").status == 200

    def readyz(self) -> tuple[bool, str]:
        """``GET /readyz``: ready (a policy bundle) or not, with what the agent said."""
        answer = self._send("GET", "/readyz")
        ready = answer.status == 200
        return ready, answer.body.decode().strip() if ready else answer.problem()["detail"]

    def metrics(self) -> str:
        """``GET /metrics``: the agent's Prometheus text."""
        return self._text(self._send("GET", "/metrics"))

    def openapi(self) -> dict[str, Any]:
        """``GET /openapi.json``: the agent's OpenAPI document."""
        return self._decision(self._send("GET", "/openapi.json"))  # type: ignore[return-value]

    def _send(self, method: str, path: str, body: Any = None) -> _Answer:
        last = ""
        for attempt in range(1, self.max_attempts + 1):
            if attempt > 1:
                time.sleep(backoff_s(self.retry_backoff_s, attempt))
                self.retries += 1
            try:
                answer = self._attempt(method, path, body)
            except (httpx.HTTPError, OSError) as error:
                last = f"{type(error).__name__}: {error}"
                continue
            if not is_no_answer(answer.status):
                return answer
            last = f"{answer.status} from something between"
        raise self._unreachable(last)

    def _attempt(self, method: str, path: str, body: Any) -> _Answer:
        # httpx bounds each step (connect, write, every read); the deadline bounds the answer as a
        # whole, so one that trickles in is cut off too.
        deadline = time.monotonic() + self.call_timeout_s
        response = self._http.send(self._request(self._http, method, path, body), stream=True)
        try:
            content = bytearray()
            for chunk in response.iter_bytes():
                content += chunk
                if len(content) > MAX_ANSWER_BYTES:
                    raise httpx.DecodingError(f"an answer larger than {MAX_ANSWER_BYTES} bytes")
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout(f"no whole answer within {self.call_timeout_s} s")
            return _Answer(response.status_code, response.headers, bytes(content))
        finally:
            response.close()


class AsyncAgentClient(_Calls):
    """The same client for asyncio: every method a coroutine. Each attempt is bounded as a whole."""

    def __init__(
        self,
        base_url: str,
        gateway_token: str,
        *,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        retry_backoff_s: float = DEFAULT_RETRY_BACKOFF_S,
        verify: Any = True,
    ) -> None:
        super().__init__(
            base_url, gateway_token, call_timeout_s=call_timeout_s, max_attempts=max_attempts, retry_backoff_s=retry_backoff_s
        )
        self._http = httpx.AsyncClient(timeout=call_timeout_s, limits=_limits(), verify=verify, trust_env=False)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncAgentClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def admit(self, request: AdmissionRequest) -> Decision:
        """``POST /v1/admit``: the decision."""
        _guard(validate_admission, request)
        return self._decision(await self._send("POST", "/v1/admit", request))

    async def check(self, request: AdmissionRequest) -> Checked:
        """``POST /v1/check``: the decision as a proxy passes it on."""
        _guard(validate_admission, request)
        return self._checked(await self._send("POST", "/v1/check", request))

    async def release(self, request: AdmissionRequest) -> None:
        """``POST /v1/release``: gives back the concurrency slots ``request`` holds (idempotent)."""
        _guard(validate_admission, request)
        self._released(await self._send("POST", "/v1/release", request))

    async def renew(self, request: AdmissionRequest) -> SlotRenewal:
        """``POST /v1/renew``: extends the concurrency slots ``request`` holds (a heartbeat)."""
        _guard(validate_admission, request)
        return self._decision(await self._send("POST", "/v1/renew", request))  # type: ignore[return-value]

    async def settle(self, settlement: SettleRequest) -> SettleAnswer:
        """``POST /v1/settle``: the actual cost of a metered admission."""
        _guard(validate_settlement, settlement)
        return self._decision(await self._send("POST", "/v1/settle", settlement))  # type: ignore[return-value]

    async def quota(
        self, tenant_id: str, principal_type: PrincipalType, principal_id: str, route_group: str | None = None
    ) -> QuotaStatus:
        """``GET /v1/quota``: the caller's own quotas and what is left of them."""
        path = self._quota_path(tenant_id, principal_type, principal_id, route_group)
        return self._decision(await self._send("GET", path))  # type: ignore[return-value]

    async def healthz(self) -> bool:
        """``GET /healthz``: whether the agent's process answers."""
        return (await self._send("GET", "/healthz")).status == 200

    async def readyz(self) -> tuple[bool, str]:
        """``GET /readyz``: ready (a policy bundle) or not, with what the agent said."""
        answer = await self._send("GET", "/readyz")
        ready = answer.status == 200
        return ready, answer.body.decode().strip() if ready else answer.problem()["detail"]

    async def metrics(self) -> str:
        """``GET /metrics``: the agent's Prometheus text."""
        return self._text(await self._send("GET", "/metrics"))

    async def openapi(self) -> dict[str, Any]:
        """``GET /openapi.json``: the agent's OpenAPI document."""
        return self._decision(await self._send("GET", "/openapi.json"))  # type: ignore[return-value]

    async def _send(self, method: str, path: str, body: Any = None) -> _Answer:
        last = ""
        for attempt in range(1, self.max_attempts + 1):
            if attempt > 1:
                await asyncio.sleep(backoff_s(self.retry_backoff_s, attempt))
                self.retries += 1
            try:
                answer = await asyncio.wait_for(self._attempt(method, path, body), self.call_timeout_s)
            except TimeoutError:
                last = f"no answer within {self.call_timeout_s} s"
                continue
            except (httpx.HTTPError, OSError) as error:
                last = f"{type(error).__name__}: {error}"
                continue
            if not is_no_answer(answer.status):
                return answer
            last = f"{answer.status} from something between"
        raise self._unreachable(last)

    async def _attempt(self, method: str, path: str, body: Any) -> _Answer:
        response = await self._http.send(self._request(self._http, method, path, body), stream=True)
        try:
            content = bytearray()
            async for chunk in response.aiter_bytes():
                content += chunk
                if len(content) > MAX_ANSWER_BYTES:
                    raise httpx.DecodingError(f"an answer larger than {MAX_ANSWER_BYTES} bytes")
            return _Answer(response.status_code, response.headers, bytes(content))
        finally:
            await response.aclose()
