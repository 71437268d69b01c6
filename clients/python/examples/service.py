"""An ASGI service whose every request the region agent admits first, through AllotMiddleware.

    ALLOT_AGENT_URL=https://agent.eu.internal:7701 ALLOT_AGENT_CA=/etc/allot/ca.pem \\
    ALLOT_GATEWAY_TOKEN_FILE=/run/secrets/allot-gateway-token \\
    ALLOT_API_KEYS='key-one=client-1,key-two=client-2' ALLOT_TENANT=atlas \\
      uvicorn examples.service:app --host 127.0.0.1 --port 3000

Callers present ``X-Api-Key``; a listed key is the verified client (principal ``api_key``), any
other caller is anonymous (principal ``ip``, its address). ``GET /reports`` is a ``read``,
``POST /exports`` holds a concurrency slot until its response ends, and ``POST /summaries`` is
metered: it charges 1 up front and states its actual cost (the length of its answer) at the end.
Any ASGI server runs it (uvicorn, hypercorn); the framework behind the middleware may be any too.
"""

import os
import ssl

from allot_client import Admission, AllotMiddleware, AsyncAgentClient


def create_app(client: AsyncAgentClient, tenant_id: str, api_keys: dict[str, str]) -> AllotMiddleware:
    """The service, behind the agent ``client``, for ``tenant_id``, accepting ``api_keys`` (key -> client id)."""

    def identify(scope: dict) -> Admission:
        key = dict(scope["headers"]).get(b"x-api-key", b"").decode("latin-1")
        known = api_keys.get(key)
        principal = (
            {"type": "api_key", "id": known}
            if known
            else {"type": "ip", "id": (scope.get("client") or ("unknown", 0))[0]}
        )
        route = {"/exports": "export", "/summaries": "summarize"}.get(scope["path"], "read")
        return Admission(
            tenant_id=tenant_id,
            principal=principal,  # type: ignore[arg-type]
            route_group=route,
            releases_slots=route == "export",
            metered=route == "summarize",
        )

    async def service(scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def]
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/summaries":
            answer = f"{len(body.split())} words\n".encode()
            # The actual cost, settled when the response ends.
            scope["allot"].meter.set(len(answer))
        elif scope["path"] == "/exports":
            answer = b"export started\n"
        else:
            answer = b"reports\n"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": answer})

    return AllotMiddleware(service, client=client, identify=identify, when_undecided="closed")


def _from_environment() -> AllotMiddleware:
    def setting(name: str) -> str:
        value = os.environ.get(name)
        if not value:
            raise SystemExit(f"set {name}")
        return value

    with open(setting("ALLOT_GATEWAY_TOKEN_FILE"), encoding="utf-8") as token_file:
        token = token_file.read().strip()
    ca = os.environ.get("ALLOT_AGENT_CA")
    client = AsyncAgentClient(setting("ALLOT_AGENT_URL"), token, verify=ssl.create_default_context(cafile=ca) if ca else True)
    keys = dict(pair.split("=", 1) for pair in setting("ALLOT_API_KEYS").split(",") if "=" in pair)
    return create_app(client, setting("ALLOT_TENANT"), keys)


if os.environ.get("ALLOT_AGENT_URL") and os.environ.get("ALLOT_GATEWAY_TOKEN_FILE"):
    app = _from_environment()
