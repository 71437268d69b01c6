"""Allot's region agent, from Python services: typed clients of every gateway endpoint, sync
(:class:`AgentClient`) and async (:class:`AsyncAgentClient`), and ASGI middleware
(:class:`AllotMiddleware`) that admits each request, answers refusals as the agent words them, and
gives slots back and settles metered costs when the response ends."""

from .asgi import Admission, Admitted, AllotMiddleware, FailMode, MeteredCost
from .client import (
    CALLER_HEADERS,
    DEFAULT_CALL_TIMEOUT_S,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_RETRY_BACKOFF_S,
    MAX_ANSWER_BYTES,
    MAX_ATTEMPTS,
    MAX_CALL_TIMEOUT_S,
    AgentClient,
    AsyncAgentClient,
    Checked,
    ClientError,
)
from .wire import (
    FIELD_RULES,
    AdmissionRequest,
    Decision,
    FieldError,
    Principal,
    Problem,
    QuotaLine,
    QuotaStatus,
    SettleAnswer,
    SettleRequest,
    SlotRenewal,
)

__all__ = [
    "CALLER_HEADERS",
    "DEFAULT_CALL_TIMEOUT_S",
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_RETRY_BACKOFF_S",
    "FIELD_RULES",
    "MAX_ANSWER_BYTES",
    "MAX_ATTEMPTS",
    "MAX_CALL_TIMEOUT_S",
    "Admission",
    "AdmissionRequest",
    "Admitted",
    "AgentClient",
    "AllotMiddleware",
    "AsyncAgentClient",
    "Checked",
    "ClientError",
    "Decision",
    "FailMode",
    "FieldError",
    "MeteredCost",
    "Principal",
    "Problem",
    "QuotaLine",
    "QuotaStatus",
    "SettleAnswer",
    "SettleRequest",
    "SlotRenewal",
]
