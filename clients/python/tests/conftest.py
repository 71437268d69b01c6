"""What the tests share: the real agent the harness started (clients/rust/tests/integration/other_languages.rs
starts it on a real Redis), and small tools.

The agent's bundle: ``read`` 2 a minute per user; ``export`` one at a time per user; ``summarize``
a bucket of 100 units per user refilled in an hour; ``orders`` 10 an hour per user, idempotent by
request id."""

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from allot_client import AdmissionRequest, AgentClient


def _required(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise RuntimeError(
            f"{name} is not set: these tests run against a real agent; run them through "
            "`cargo nextest run -p allot-client -E 'test(/^other_languages::/)'`"
        )
    return value


AGENT_URL = _required("ALLOT_AGENT_URL")
GATEWAY_TOKEN = _required("ALLOT_GATEWAY_TOKEN")
TENANT = "atlas"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def agent() -> Iterator[AgentClient]:
    with AgentClient(AGENT_URL, GATEWAY_TOKEN, call_timeout_s=2.0) as client:
        yield client


def request(request_id: str, who: str, route_group: str) -> AdmissionRequest:
    return {
        "requestId": request_id,
        "tenantId": TENANT,
        "principal": {"type": "user", "id": who},
        "routeGroup": route_group,
        "method": "GET",
        "costHint": 1,
    }


def remaining(agent: AgentClient, who: str, rule: str) -> int | None:
    """What is left of ``who``'s quota under ``rule``, as the agent says."""
    status = agent.quota(TENANT, "user", who)
    return next((line["remaining"] for line in status["quotas"] if line["policyId"] == rule), None)


def eventually(what: str, condition: Callable[[], bool]) -> None:
    """Polls ``condition`` every 20 ms for up to 5 s (completions run after the response ends)."""
    for _ in range(250):
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"not within 5 s: {what}")


class Server:
    """An HTTP server on a free loopback port, in a thread."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def dead_url() -> str:
    """A URL nothing listens on."""
    server = Server(BaseHTTPRequestHandler)
    server.close()
    return server.url


@pytest.fixture
def lossy_front() -> Iterator[tuple[str, list[str]]]:
    """Between a client and the agent: passes every call on, and answers the first with 502 after
    the agent has decided it (an answer lost on the way back). Records each body's requestId."""
    seen: list[str] = []
    lock = threading.Lock()

    class Forward(BaseHTTPRequestHandler):
        def log_message(self, *_: object) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            answer = httpx.post(
                f"{AGENT_URL}{self.path}",
                content=body,
                headers={"authorization": self.headers.get("authorization", ""), "content-type": "application/json"},
            )
            with lock:
                seen.append(json.loads(body).get("requestId", ""))
                first = len(seen) == 1
            if first:
                self.send_response(502)
                self.send_header("content-length", "0")
                self.end_headers()
                return
            self.send_response(answer.status_code)
            self.send_header("content-type", answer.headers.get("content-type", ""))
            self.send_header("content-length", str(len(answer.content)))
            self.end_headers()
            self.wfile.write(answer.content)

    server = Server(Forward)
    yield server.url, seen
    server.close()


@pytest.fixture
def silent_url() -> Iterator[str]:
    """A server that accepts and never answers."""

    class Silent(BaseHTTPRequestHandler):
        def log_message(self, *_: object) -> None:
            pass

        def do_POST(self) -> None:
            time.sleep(3)

    server = Server(Silent)
    yield server.url
    server.close()
