"""The client held equal to the agent's own OpenAPI document (``GET /openapi.json`` of the real
agent): every message's fields and required fields, the rules checked before sending, and a method
for every path a service calls."""

import typing

import pytest

from allot_client import FIELD_RULES, AgentClient, AsyncAgentClient
from allot_client.wire import MESSAGES


@pytest.fixture(scope="module")
def document() -> dict:
    from conftest import AGENT_URL, GATEWAY_TOKEN

    with AgentClient(AGENT_URL, GATEWAY_TOKEN, call_timeout_s=2.0) as agent:
        return agent.openapi()


def resolve(document: dict, schema: dict) -> dict:
    """A schema with its ``$ref`` followed and a ``oneOf`` with null unwrapped."""
    if "$ref" in schema:
        return resolve(document, document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]])
    variants = [variant for variant in schema.get("oneOf", schema.get("anyOf", [])) if variant.get("type") != "null"]
    if len(variants) == 1:
        return resolve(document, variants[0])
    return schema


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_every_message_has_the_documents_fields(document: dict, name: str) -> None:
    schema = document["components"]["schemas"][name]
    message = MESSAGES[name]
    documented = set(schema["properties"])
    # Problem is open (extension members); every other message is closed.
    assert set(typing.get_type_hints(message)) == documented, name
    assert set(message.__required_keys__) == set(schema.get("required", [])), name


@pytest.mark.parametrize("key", sorted(FIELD_RULES))
def test_the_rules_checked_before_sending_are_the_documents(document: dict, key: str) -> None:
    schema_name, field = key.split(".")
    schema = resolve(document, document["components"]["schemas"][schema_name]["properties"][field])
    for constraint in ("pattern", "minLength", "maxLength", "minimum", "maximum"):
        assert FIELD_RULES[key].get(constraint) == schema.get(constraint), f"{key}.{constraint}"


#: What services call: every path but nginx's subrequest (``/v1/auth-request``, which nginx reads).
CLIENT_METHOD = {
    "POST /v1/admit": "admit",
    "POST /v1/check": "check",
    "POST /v1/release": "release",
    "POST /v1/renew": "renew",
    "POST /v1/settle": "settle",
    "GET /v1/quota": "quota",
    "GET /healthz": "healthz",
    "GET /readyz": "readyz",
    "GET /metrics": "metrics",
    "GET /openapi.json": "openapi",
}


def test_every_endpoint_of_the_document_has_a_method_on_both_clients(document: dict) -> None:
    operations = {
        f"{method.upper()} {path}" for path, item in document["paths"].items() for method in item
    } - {"GET /v1/auth-request"}
    assert operations == set(CLIENT_METHOD)
    for name in CLIENT_METHOD.values():
        assert callable(getattr(AgentClient, name)) and callable(getattr(AsyncAgentClient, name)), name
