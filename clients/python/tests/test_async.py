"""The async client against a real agent: every endpoint, a retry that keeps its request id, and
each attempt bounded as a whole."""

import time

import pytest
from conftest import AGENT_URL, GATEWAY_TOKEN, request

from allot_client import AsyncAgentClient, ClientError

pytestmark = pytest.mark.anyio


async def test_the_async_client_speaks_every_endpoint() -> None:
    async with AsyncAgentClient(AGENT_URL, GATEWAY_TOKEN, call_timeout_s=2.0) as agent:
        assert await agent.healthz()
        assert (await agent.readyz())[0]
        assert (await agent.admit(request("pa-a-1", "pa-U-1", "read")))["remaining"] == 1
        assert (await agent.check(request("pa-a-2", "pa-U-1", "read"))).allowed
        assert not (await agent.check(request("pa-a-3", "pa-U-1", "read"))).allowed
        exporting = request("pa-e-1", "pa-U-1", "export")
        assert (await agent.check(exporting)).allowed
        assert (await agent.renew(exporting))["renewed"] == 1
        await agent.release(exporting)
        assert (await agent.check(request("pa-e-2", "pa-U-1", "export"))).allowed
        assert (await agent.check({**request("pa-s-1", "pa-U-1", "summarize"), "metered": True})).allowed
        settled = await agent.settle({"decisionId": "pa-s-1", "tenantId": "atlas", "actualCost": 40})
        assert settled["extra"] == 39
        quota = await agent.quota("atlas", "user", "pa-U-1")
        assert {line["policyId"]: line["remaining"] for line in quota["quotas"]}["summaries"] == 60
        assert "allot_" in await agent.metrics()
        assert (await agent.openapi())["openapi"] == "3.1.0"


async def test_an_async_retry_keeps_its_request_id(lossy_front: tuple[str, list[str]]) -> None:
    url, seen = lossy_front
    async with AsyncAgentClient(url, GATEWAY_TOKEN, call_timeout_s=2.0) as retried:
        assert (await retried.admit(request("pa-o-1", "pa-U-6", "orders")))["allowed"]
        assert retried.retries == 1
    async with AsyncAgentClient(AGENT_URL, GATEWAY_TOKEN) as agent:
        quota = await agent.quota("atlas", "user", "pa-U-6")
    assert seen == ["pa-o-1", "pa-o-1"]
    assert {line["policyId"]: line["remaining"] for line in quota["quotas"]}["orders"] == 9, "charged once"


async def test_each_async_attempt_is_bounded_as_a_whole(silent_url: str) -> None:
    async with AsyncAgentClient(silent_url, GATEWAY_TOKEN, call_timeout_s=0.1, max_attempts=2) as slow:
        started = time.monotonic()
        with pytest.raises(ClientError, match="no answer within 0.1 s") as unreachable:
            await slow.check(request("pa-d-1", "pa-U-4", "read"))
        elapsed = time.monotonic() - started
    assert unreachable.value.attempts == 2
    assert 0.2 <= elapsed < 2.5, f"two attempts of 100 ms, not {elapsed:.2f} s"
