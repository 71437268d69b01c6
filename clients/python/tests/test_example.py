"""The example service (examples/service.py) against the real agent: a known API key is admitted as
its client and its metered summary settled at the stated cost."""

import asyncio

import httpx
import pytest
from conftest import AGENT_URL, GATEWAY_TOKEN

from allot_client import AsyncAgentClient
from examples.service import create_app

pytestmark = pytest.mark.anyio


async def test_the_example_service_admits_a_known_key_and_settles_what_it_states() -> None:
    async with AsyncAgentClient(AGENT_URL, GATEWAY_TOKEN, call_timeout_s=2.0) as agent:
        app = create_app(agent, "atlas", {"key-one": "py-example-client"})
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://service") as http:
            reports = await http.get("/reports", headers={"x-api-key": "key-one"})
            assert reports.status_code == 200
            assert reports.headers["ratelimit-policy"] == '"reads";q=2;w=60'
            summary = await http.post("/summaries", headers={"x-api-key": "key-one"}, content=b"one two three")
            assert summary.text == "3 words\n"
        for _ in range(250):
            quota = await agent.quota("atlas", "api_key", "py-example-client")
            left = {line["policyId"]: line["remaining"] for line in quota["quotas"]}["summaries"]
            if left == 92:  # estimated 1, stated 8 (the answer's length)
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"the summary was not settled at its stated cost: {left} left")
