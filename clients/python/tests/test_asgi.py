"""The ASGI middleware against the real agent: refusals worded as the agent words them, slots given
back when responses end or are abandoned, metered costs settled, and the fail modes without an
agent. Requests go through httpx's ASGI transport, as a server would call the application."""

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable

import httpx
import pytest
from conftest import AGENT_URL, GATEWAY_TOKEN, TENANT, dead_url

from allot_client import Admission, AllotMiddleware, AsyncAgentClient

pytestmark = pytest.mark.anyio


class Service:
    """``/read``; ``/export``, whose body waits for the next gate; ``/summarize``, which states a cost of 30."""

    def __init__(self) -> None:
        self.served = 0
        self.gates: deque[asyncio.Event] = deque()

    def hold_next_export(self) -> asyncio.Event:
        gate = asyncio.Event()
        self.gates.append(gate)
        return gate

    async def __call__(self, scope: dict, receive: Callable, send: Callable[[dict], Awaitable[None]]) -> None:
        self.served += 1
        path = scope["path"]
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        if path == "/export":
            if self.gates:
                await self.gates.popleft().wait()
            await send({"type": "http.response.body", "body": b"export done\n"})
            return
        if path == "/summarize":
            scope["allot"].meter.set(30)
        await send({"type": "http.response.body", "body": path.lstrip("/").encode() + b"\n"})


def identify(scope: dict) -> Admission | None:
    user = dict(scope["headers"]).get(b"x-test-user")
    if user is None:
        return None
    route = scope["path"].lstrip("/")
    return Admission(
        tenant_id=TENANT,
        principal={"type": "user", "id": user.decode()},
        route_group=route,
        releases_slots=route == "export",
        metered=route == "summarize",
    )


def service_behind(client: AsyncAgentClient, mode: str = "closed") -> tuple[Service, AllotMiddleware, httpx.AsyncClient]:
    service = Service()
    app = AllotMiddleware(service, client=client, identify=identify, when_undecided=mode)  # type: ignore[arg-type]
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://service")
    return service, app, http


async def eventually(what: str, condition: Callable[[], Awaitable[bool]]) -> None:
    for _ in range(250):
        if await condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within 5 s: {what}")


async def remaining(agent: AsyncAgentClient, who: str, rule: str) -> int | None:
    quota = await agent.quota(TENANT, "user", who)
    return next((line["remaining"] for line in quota["quotas"] if line["policyId"] == rule), None)


async def test_admits_and_answers_refusals_as_the_agent_words_them() -> None:
    async with AsyncAgentClient(AGENT_URL, GATEWAY_TOKEN, call_timeout_s=2.0) as agent:
        service, _, http = service_behind(agent)
        for _ in range(2):
            admitted = await http.get("/read", headers={"x-test-user": "asgi-U-2"})
            assert admitted.status_code == 200
            assert admitted.headers["ratelimit-policy"] == '"reads";q=2;w=60'
            assert "retry-after" not in admitted.headers
        refused = await http.get("/read", headers={"x-test-user": "asgi-U-2"})
        assert refused.status_code == 429
        assert refused.headers["content-type"] == "application/problem+json"
        assert refused.headers["retry-after"].isdigit() and 1 <= int(refused.headers["retry-after"]) <= 61  # the window, plus up to 1 s of jitter
        assert "ratelimit" in refused.headers
        assert refused.json()["status"] == 429
        assert service.served == 2, "the service saw only admissions"
        assert (await http.get("/read")).status_code == 200, "identify let it through unlimited"
        assert service.served == 3


async def test_gives_slots_back_when_responses_end_or_are_abandoned() -> None:
    who = {"x-test-user": "asgi-U-3"}
    async with AsyncAgentClient(AGENT_URL, GATEWAY_TOKEN, call_timeout_s=2.0) as agent:
        service, app, http = service_behind(agent)
        gate = service.hold_next_export()
        first = asyncio.create_task(http.get("/export", headers=who))
        await eventually("the first export served", lambda: asyncio.sleep(0, service.served == 1))
        second = await http.get("/export", headers=who)
        assert second.status_code == 429, "one at a time"
        gate.set()
        assert (await first).text == "export done\n"

        async def admitted() -> bool:
            return (await http.get("/export", headers=who)).status_code == 200

        await eventually("the slot given back when the body ended", admitted)

        # Abandoned: the caller goes away while the body is being sent (the server's send fails).
        async def gone(message: dict) -> None:
            if message["type"] == "http.response.body":
                raise OSError("the caller went away")

        async def receive() -> dict:
            return {"type": "http.disconnect"}

        scope = {
            "type": "http",
            "method": "GET",
            "path": "/export",
            "headers": [(b"x-test-user", b"asgi-U-3")],
        }
        with pytest.raises(OSError):
            await app(scope, receive, gone)
        await eventually("the slot given back when the caller went away", admitted)


async def test_settles_the_cost_a_service_states() -> None:
    async with AsyncAgentClient(AGENT_URL, GATEWAY_TOKEN, call_timeout_s=2.0) as agent:
        _, _, http = service_behind(agent)
        answer = await http.get("/summarize", headers={"x-test-user": "asgi-U-4"})
        assert (answer.status_code, answer.text) == (200, "summarize\n")

        async def settled() -> bool:
            return await remaining(agent, "asgi-U-4", "summaries") == 70  # estimated 1, stated 30

        await eventually("the stated cost settled", settled)


async def test_without_an_agent_fails_as_told() -> None:
    async with AsyncAgentClient(dead_url(), GATEWAY_TOKEN, call_timeout_s=0.3) as unreachable:
        service, _, http = service_behind(unreachable, "closed")
        refused = await http.get("/read", headers={"x-test-user": "asgi-U-5"})
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["content-type"] == "application/problem+json"
        assert service.served == 0
        service, _, http = service_behind(unreachable, "open")
        assert (await http.get("/read", headers={"x-test-user": "asgi-U-5"})).status_code == 200
        assert service.served == 1
