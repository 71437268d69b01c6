"""The sync client against a real agent: every endpoint, refusals, bad input refused before it is
sent, retries that keep their request id, and calls bounded when no agent answers."""

import time

import pytest
from conftest import AGENT_URL, GATEWAY_TOKEN, dead_url, remaining, request

from allot_client import MAX_ATTEMPTS, AgentClient, ClientError


def test_the_client_speaks_every_endpoint(agent: AgentClient) -> None:
    assert agent.healthz()
    ready, detail = agent.readyz()
    assert ready, detail

    decision = agent.admit(request("py-a-1", "py-U-1", "read"))
    assert decision["allowed"] and decision["decisionId"] == "py-a-1" and decision["remaining"] == 1

    checked = agent.check(request("py-a-2", "py-U-1", "read"))
    assert checked.status == 200
    assert checked.caller_headers["ratelimit-policy"] == '"reads";q=2;w=60'
    refused = agent.check(request("py-a-3", "py-U-1", "read"))
    assert (refused.allowed, refused.status) == (False, 429)
    assert refused.problem is not None and refused.problem["status"] == 429
    assert refused.retry_after_seconds is not None and 1 <= refused.retry_after_seconds <= 61  # the window, plus up to 1 s of jitter

    # A slot held, renewed and given back.
    exporting = request("py-e-1", "py-U-1", "export")
    assert agent.check(exporting).allowed
    assert not agent.check(request("py-e-2", "py-U-1", "export")).allowed, "one at a time"
    assert agent.renew(exporting)["renewed"] == 1
    agent.release(exporting)
    agent.release(exporting)  # idempotent
    assert agent.check(request("py-e-3", "py-U-1", "export")).allowed

    # A metered admission: estimated 1, settled at 30.
    metered = agent.check({**request("py-s-1", "py-U-1", "summarize"), "metered": True})
    assert metered.allowed and (metered.settle_by_ms or 0) > time.time() * 1000
    settled = agent.settle({"decisionId": "py-s-1", "tenantId": "atlas", "actualCost": 30})
    assert (settled["estimate"], settled["actualCost"], settled["extra"]) == (1, 30, 29)
    assert remaining(agent, "py-U-1", "summaries") == 70
    with pytest.raises(ClientError) as conflict:
        agent.settle({"decisionId": "py-s-1", "tenantId": "atlas", "actualCost": 31})
    assert (conflict.value.kind, conflict.value.status) == ("refused", 409)
    with pytest.raises(ClientError) as unknown:
        agent.settle({"decisionId": "py-none", "tenantId": "atlas", "actualCost": 3})
    assert unknown.value.status == 404

    quota = agent.quota("atlas", "user", "py-U-1", route_group="read")
    assert [(line["policyId"], line["remaining"]) for line in quota["quotas"]] == [("reads", 0)]
    assert "allot_" in agent.metrics()
    assert agent.openapi()["openapi"] == "3.1.0"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"requestId": "has space"}, "requestId"),
        ({"requestId": ""}, "requestId"),
        ({"requestId": "req-1\n"}, "requestId"),
        ({"tenantId": "Atlas"}, "tenantId"),
        ({"routeGroup": "a" * 33}, "routeGroup"),
        ({"costHint": 0}, "costHint"),
        ({"costHint": 2**30 + 1}, "costHint"),
        ({"costHint": 1.5}, "costHint"),
        ({"costHint": True}, "costHint"),
        ({"principal": {"type": "user", "id": ""}}, "principal.id"),
        ({"dryRun": True, "metered": True}, "metered"),
    ],
)
def test_bad_input_is_refused_before_it_is_sent(lossy_front: tuple[str, list[str]], change: dict, field: str) -> None:
    url, seen = lossy_front
    with AgentClient(url, GATEWAY_TOKEN) as watched:
        with pytest.raises(ClientError) as refused:
            watched.admit({**request("py-b-1", "py-U-2", "read"), **change})
    assert (refused.value.kind, refused.value.field) == ("invalid", field)
    assert seen == [], "nothing was sent"


def test_a_refusal_of_the_call_itself_is_an_answer_never_retried() -> None:
    with AgentClient(AGENT_URL, "not-a-gateway-token", max_attempts=3) as wrong_token:
        with pytest.raises(ClientError) as refused:
            wrong_token.admit(request("py-t-1", "py-U-3", "read"))
        assert (refused.value.kind, refused.value.status) == ("refused", 401)
        assert refused.value.problem is not None and refused.value.problem["status"] == 401
        assert wrong_token.retries == 0
        assert "not-a-gateway-token" not in repr(wrong_token)


def test_a_retry_keeps_its_request_id_so_an_idempotent_rule_charges_once(
    agent: AgentClient, lossy_front: tuple[str, list[str]]
) -> None:
    url, seen = lossy_front
    with AgentClient(url, GATEWAY_TOKEN, call_timeout_s=2.0, max_attempts=2) as retried:
        assert retried.admit(request("py-o-1", "py-U-6", "orders"))["allowed"]
        assert seen == ["py-o-1", "py-o-1"], "the retry kept the request id"
        assert retried.retries == 1
    assert remaining(agent, "py-U-6", "orders") == 9, "charged once"


def test_without_an_answer_a_call_is_bounded_in_attempts_and_time(silent_url: str) -> None:
    with AgentClient(dead_url(), GATEWAY_TOKEN, max_attempts=3, retry_backoff_s=0.001) as dead:
        with pytest.raises(ClientError) as unreachable:
            dead.admit(request("py-d-1", "py-U-4", "read"))
        assert (unreachable.value.kind, unreachable.value.attempts) == ("unreachable", 3)
        assert dead.retries == 2

    with AgentClient(silent_url, GATEWAY_TOKEN, call_timeout_s=0.1, max_attempts=2, retry_backoff_s=0.001) as slow:
        started = time.monotonic()
        with pytest.raises(ClientError, match="did not answer after 2 attempt"):
            slow.check(request("py-d-2", "py-U-4", "read"))
        elapsed = time.monotonic() - started
        assert 0.2 <= elapsed < 2.0, f"two attempts of 100 ms, not {elapsed:.2f} s"


@pytest.mark.parametrize(
    ("args", "kwargs", "why"),
    [
        (("agent:7701", "t"), {}, "http://"),
        (("http://agent", " "), {}, "token"),
        (("http://agent", "t"), {"max_attempts": 0}, "attempts"),
        (("http://agent", "t"), {"max_attempts": MAX_ATTEMPTS + 1}, "attempts"),
        (("http://agent", "t"), {"call_timeout_s": 0}, "timeout"),
        (("http://agent", "t"), {"call_timeout_s": 60}, "timeout"),
        (("http://agent", "first\nsecond"), {}, "visible ASCII"),
    ],
)
def test_a_client_that_cannot_be_bounded_is_not_built(args: tuple, kwargs: dict, why: str) -> None:
    with pytest.raises(ClientError, match=why) as refused:
        AgentClient(*args, **kwargs)
    assert refused.value.kind == "config"
    assert "first" not in str(refused.value), "a token is never echoed"
