"""The OpenAPI document, made to tell the truth about every /v1 route.

FastAPI documents what it can infer: the routes here answer with hand-built
JSON documents and problem+json errors it cannot see. This module completes
the generated document once, when it is first asked for:

- every /v1 operation is secured by a bearer token (`securitySchemes`);
- its success answers carry the schema of what it returns, with the statuses
  it really uses (202/200 for a payment, 201/202/200 for a synchronous write);
- every error it can answer is documented as `application/problem+json` with
  the RFC 9457 shape, including the edge's (400, 401, 404, 408, 413, 415), an
  oversized request head's 431 (http_server.py) and a database outage's 503;
- `Idempotency-Key` is a required header of every mutation, and path ids have
  the pattern the edge enforces.

`tests/test_openapi.py` runs schemathesis, with all its checks, against it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from intentledger.domain.mandates import MandateStatus
from intentledger.web.problems import PROBLEM_JSON, TITLES

ID_PATTERN = "^[A-Za-z0-9_-]{1,40}$"
NO_NUL = "^[^\\x00]*$"
KEY_SCHEMA = {
    "type": "string",
    "minLength": 1,
    "maxLength": 257,
    "pattern": '^[!-~]{1,255}$|^"[!#-\\[\\]-~]{1,255}"$',
    "description": '1-255 visible ASCII characters, bare or quoted ("abc" is abc); a retry '
    "sends the same one.",
}
NULLABLE_STRING = {"type": ["string", "null"]}
TIMESTAMP = {"type": "string", "format": "date-time"}

PROBLEM = {
    "type": "object",
    "description": "RFC 9457 problem details",
    "required": ["type", "title", "status", "detail"],
    "properties": {
        "type": {"type": "string", "format": "uri"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "instance": {"type": "string"},
        "errors": {"type": "array", "items": {"type": "object"}},
    },
}
ATTEMPT = {
    "type": "object",
    "required": ["number", "provider_idempotency_key", "submitted_at", "relation"],
    "properties": {
        "number": {"type": "integer"},
        "provider_idempotency_key": {"type": "string"},
        "submitted_at": TIMESTAMP,
        "relation": {"type": "string", "enum": ["original", "resubmission"]},
        "resubmission_of": {"type": ["integer", "null"]},
        "decision_id": {"type": ["integer", "null"]},
        "transport_result": NULLABLE_STRING,
        "http_status": {"type": ["integer", "null"]},
        "verdict": NULLABLE_STRING,
        "provider_reference": NULLABLE_STRING,
    },
}
VERSION = {
    "type": "integer",
    "minimum": 1,
    "description": "Rises with every change of this object's own record (a payment's "
    "refund totals are read from its refunds, each versioned itself); a receiver of events "
    "drops one whose version is not above the last it applied (docs/webhooks.md)",
}
OPERATION = {
    "type": "object",
    "description": "The ledger record of an operation.",
    "required": ["id", "operation_id", "state", "next_action", "kind", "attempts", "version"],
    "properties": {
        "id": {"type": "string"},
        "version": VERSION,
        "operation_id": {"type": "string"},
        "idempotency_key": {"type": "string"},
        "state": {
            "type": "string",
            "enum": [
                "ACCEPTED",
                "SUBMITTING",
                "UNKNOWN",
                "RECONCILIATION_DUE",
                "SAFETY_REVIEW",
                "MANUAL_REVIEW",
                "OUTCOME_KNOWN",
                "CANCELLED",
            ],
        },
        "next_action": {
            "type": "string",
            "enum": [
                "submit",
                "wait",
                "reconcile",
                "review_safety",
                "resubmit",
                "operator",
                "none",
            ],
        },
        "outcome": {"type": ["string", "null"], "enum": ["succeeded", "failed", None]},
        "kind": {"type": "string"},
        "amount": {"type": ["integer", "null"]},
        "currency": NULLABLE_STRING,
        "provider_reference": NULLABLE_STRING,
        "executed_references": {"type": "array", "items": {"type": "string"}},
        "duplicate_detected": {"type": "boolean"},
        "outcome_contradicted": {"type": "boolean"},
        "retry_after_at": {"type": ["string", "null"], "format": "date-time"},
        "key_age_at_decision": {"type": ["number", "null"]},
        "attempts": {"type": "array", "items": ATTEMPT},
        "amount_refunded": {"type": "integer", "description": "payments only"},
        "amount_refundable": {"type": "integer", "description": "payments only"},
        "payment_id": {"type": ["string", "null"], "description": "refunds only"},
        "refunded_charge": {"type": ["string", "null"], "description": "refunds only"},
    },
}
EVENTS = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "at"],
                "properties": {
                    "type": {"type": "string", "enum": ["transition", "observation", "decision"]},
                    "at": TIMESTAMP,
                },
            },
        }
    },
}
MANDATE = {
    "type": "object",
    "required": [
        *("id", "status", "currency", "max_amount", "total_limit", "reserved", "spent"),
        "version",
    ],
    "properties": {
        "id": {"type": "string"},
        "version": VERSION,
        "status": {"type": "string", "enum": [status.value for status in MandateStatus]},
        "currency": {"type": "string"},
        "max_amount": {"type": "integer"},
        "total_limit": {"type": "integer"},
        "reserved": {"type": "integer"},
        "spent": {"type": "integer"},
        "created_at": TIMESTAMP,
        "updated_at": TIMESTAMP,
    },
}
CARD = {
    "type": "object",
    "required": ["id", "status", "indeterminate", "version"],
    "properties": {
        "id": {"type": "string"},
        "version": VERSION,
        "label": NULLABLE_STRING,
        "status": {"type": "string", "enum": ["pending", "active", "frozen", "not_issued"]},
        "indeterminate": {"type": "boolean"},
        "pending_operation_id": NULLABLE_STRING,
        "provider_card_id": NULLABLE_STRING,
        "operation": OPERATION,
    },
}
OPERATIONS_LIST = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "actor", "state", "next_action"],
                "properties": {
                    "id": {"type": "string"},
                    "actor": {"type": "string"},
                    "state": {"type": "string"},
                    "next_action": {"type": "string"},
                    "age_seconds": {"type": "number"},
                },
            },
        }
    },
}


def _ref_to(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


WEBHOOK_RECEIPT = {
    "type": "object",
    "required": ["event_id", "disposition", "duplicate", "operation_id"],
    "properties": {
        "event_id": {"type": "string"},
        "disposition": {
            "type": "string",
            "enum": [
                "applied",
                "recorded",
                "flagged",
                "unknown_reference",
                "unmapped_type",
                "wrong_kind",
            ],
        },
        "duplicate": {"type": "boolean"},
        "operation_id": {"type": ["string", "null"]},
    },
}
WEBHOOK_ENDPOINT = {
    "type": "object",
    "required": ["id", "url", "events", "created_at"],
    "properties": {
        "id": {"type": "string"},
        "url": {"type": "string"},
        "events": {"type": ["array", "null"], "items": {"type": "string"}},
        "created_at": TIMESTAMP,
        "deleted_at": TIMESTAMP,
        "secret": {
            "type": "string",
            "pattern": "^whsec_",
            "description": "Only in the creation's answer (and its idempotent replays)",
        },
    },
}
WEBHOOK_ATTEMPT = {
    "type": "object",
    "required": ["at", "duration_ms", "http_status", "error", "delivered", "next_attempt_at"],
    "properties": {
        "at": TIMESTAMP,
        "duration_ms": {"type": "integer"},
        "http_status": {"type": ["integer", "null"]},
        "error": NULLABLE_STRING,
        "delivered": {"type": "boolean"},
        "next_attempt_at": {"type": ["string", "null"], "format": "date-time"},
    },
}
WEBHOOK_DELIVERIES = {
    "type": "object",
    "required": ["data", "has_more"],
    "properties": {
        "has_more": {"type": "boolean"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "event_id", "type", "object_id", "status", "attempts"],
                "properties": {
                    "id": {"type": "integer"},
                    "event_id": {"type": "string"},
                    "type": {"type": "string"},
                    "object_id": {"type": "string"},
                    "status": {
                        "type": "string",
                        "enum": ["pending", "delivered", "failed", "cancelled"],
                    },
                    "in_flight": {"type": "boolean"},
                    "next_attempt_at": {"type": ["string", "null"], "format": "date-time"},
                    "created_at": TIMESTAMP,
                    "finished_at": {"type": ["string", "null"], "format": "date-time"},
                    "attempts": {"type": "array", "items": WEBHOOK_ATTEMPT},
                },
            },
        },
    },
}
SCHEMAS = {
    "Problem": PROBLEM,
    "OperationsPage": {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"type": "array", "items": OPERATION}},
    },
    "WebhookEndpoint": WEBHOOK_ENDPOINT,
    "WebhookEndpointList": {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"type": "array", "items": _ref_to("WebhookEndpoint")}},
    },
    "WebhookEndpointDeleted": {
        "type": "object",
        "required": ["id", "deleted"],
        "properties": {"id": {"type": "string"}, "deleted": {"const": True}},
    },
    "WebhookDeliveries": WEBHOOK_DELIVERIES,
    "Operation": OPERATION,
    "Events": EVENTS,
    "Mandate": MANDATE,
    "Card": CARD,
    "OperationList": OPERATIONS_LIST,
    "WebhookReceipt": WEBHOOK_RECEIPT,
    # Any JSON without a NUL in any text (the edge refuses one anywhere).
    "NulFreeJson": {
        "anyOf": [
            {"type": "string", "pattern": NO_NUL},
            {"type": ["number", "boolean", "null"]},
            {"type": "array", "items": {"$ref": "#/components/schemas/NulFreeJson"}},
            {
                "type": "object",
                "propertyNames": {"type": "string", "pattern": NO_NUL},
                "additionalProperties": {"$ref": "#/components/schemas/NulFreeJson"},
            },
        ]
    },
}

# What each /v1 operation answers on success: {status: (schema, description)}.
SYNC_WRITE = {
    201: "Operation",
    202: "Operation",
    200: "Operation",
}
SUCCESS: dict[tuple[str, str], dict[int, str]] = {
    ("post", "/v1/payments"): {202: "Operation", 200: "Operation"},
    ("get", "/v1/operations/{operation_id}"): {200: "Operation"},
    ("get", "/v1/operations/{operation_id}/events"): {200: "Events"},
    ("post", "/v1/mandates"): {201: "Mandate", 200: "Mandate"},
    ("get", "/v1/mandates/{mandate_id}"): {200: "Mandate"},
    ("post", "/v1/mandates/{mandate_id}/suspend"): {200: "Mandate"},
    ("post", "/v1/mandates/{mandate_id}/resume"): {200: "Mandate"},
    ("post", "/v1/mandates/{mandate_id}/revoke"): {200: "Mandate"},
    ("post", "/v1/beneficiaries"): SYNC_WRITE,
    ("post", "/v1/cards"): {201: "Card", 202: "Card", 200: "Card"},
    ("get", "/v1/cards/{card_id}"): {200: "Card"},
    ("post", "/v1/cards/{card_id}/freeze"): {201: "Card", 202: "Card", 200: "Card"},
    ("post", "/v1/cards/{card_id}/unfreeze"): {201: "Card", 202: "Card", 200: "Card"},
    ("get", "/v1/ops/operations"): {200: "OperationList"},
    ("get", "/v1/ops/operations/{operation_id}"): {200: "Operation"},
    ("post", "/v1/ops/operations/{operation_id}/resolve"): {200: "Operation"},
    ("post", "/v1/ops/operations/{operation_id}/approve-resubmission"): {200: "Operation"},
    ("post", "/v1/ops/operations/{operation_id}/escalate"): {200: "Operation"},
    ("post", "/v1/ops/operations/{operation_id}/refund-duplicate"): {200: "Operation"},
    ("post", "/v1/payments/{payment_id}/refunds"): {202: "Operation", 200: "Operation"},
    ("get", "/v1/payments/{payment_id}/refunds"): {200: "OperationsPage"},
    ("post", "/v1/webhook-endpoints"): {201: "WebhookEndpoint", 200: "WebhookEndpoint"},
    ("get", "/v1/webhook-endpoints"): {200: "WebhookEndpointList"},
    ("get", "/v1/webhook-endpoints/{endpoint_id}"): {200: "WebhookEndpoint"},
    ("delete", "/v1/webhook-endpoints/{endpoint_id}"): {200: "WebhookEndpointDeleted"},
    ("get", "/v1/webhook-endpoints/{endpoint_id}/deliveries"): {200: "WebhookDeliveries"},
}
SUCCESS_WORDS = {
    200: "OK (for a mutation: an equal retry, replayed, with Idempotent-Replayed: true)",
    201: "Created: the provider's answer was definite",
    202: "Accepted: durable; for a synchronous write, the provider's answer was lost (UNKNOWN)",
}
# Errors every /v1 route can answer (the edge's, an oversized request head,
# authentication, an outage).
COMMON_ERRORS = (400, 401, 404, 422, 431, 503)
# Errors of routes that take a body and an Idempotency-Key.
MUTATION_ERRORS = (408, 409, 413, 415)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _problem(status: int) -> dict[str, Any]:
    return {
        "description": TITLES.get(status, "Error"),
        "content": {PROBLEM_JSON: {"schema": _ref("Problem")}},
    }


# A provider's webhook: signed, not authenticated by a token, no Idempotency-Key
# (the event's id is its idempotency).
WEBHOOK_ERRORS = (400, 404, 408, 413, 415, 431, 503)


def _complete_webhook(operation: dict[str, Any]) -> None:
    operation["security"] = []
    responses: dict[str, Any] = {
        "200": {
            "description": (
                "Stored (or stored before: duplicate) and judged. A provider that posts "
                "a batch (Adyen) is answered only with the acknowledgement it waits for"
            ),
            "content": {
                "application/json": {"schema": _ref("WebhookReceipt")},
                "text/plain": {"schema": {"type": "string", "enum": ["[accepted]"]}},
            },
        }
    }
    for status in WEBHOOK_ERRORS:
        responses[str(status)] = _problem(status)
    operation["responses"] = responses
    for parameter in operation.get("parameters", []):
        if parameter["in"] == "path":
            parameter["schema"] = {"type": "string", "pattern": ID_PATTERN}


def _complete(path: str, method: str, operation: dict[str, Any]) -> None:
    if path.startswith("/v1/provider-webhooks/"):
        _complete_webhook(operation)
        return
    operation["security"] = [{"bearer": []}]
    responses: dict[str, Any] = {
        str(status): {
            "description": SUCCESS_WORDS[status],
            "content": {"application/json": {"schema": _ref(schema)}},
        }
        for status, schema in SUCCESS[(method, path)].items()
    }
    errors = list(COMMON_ERRORS)
    if method == "post":
        errors += MUTATION_ERRORS
    if path.startswith("/v1/ops/"):
        errors.append(403)
    for status in sorted(errors):
        responses[str(status)] = _problem(status)
    operation["responses"] = responses
    parameters = [p for p in operation.get("parameters", []) if p["name"] != "Idempotency-Key"]
    for parameter in parameters:
        if parameter["in"] == "path":
            parameter["schema"] = {"type": "string", "pattern": ID_PATTERN}
    if method == "post":
        parameters.append(
            {"name": "Idempotency-Key", "in": "header", "required": True, "schema": KEY_SCHEMA}
        )
    operation["parameters"] = parameters


def _no_nul(schema: Any) -> None:
    """Every text field of a request refuses NUL (the edge answers 400): say so."""
    if isinstance(schema, dict):
        if schema.get("type") == "string" and "pattern" not in schema and "enum" not in schema:
            schema["pattern"] = NO_NUL
        names = schema.get("propertyNames")  # an object's keys are text too
        if isinstance(names, dict) and "pattern" not in names:
            names["pattern"] = NO_NUL
        for value in schema.values():
            _no_nul(value)
    elif isinstance(schema, list):
        for value in schema:
            _no_nul(value)


def install_openapi(app: FastAPI) -> None:
    """Replace `app.openapi` with one that completes FastAPI's document."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            components = document.setdefault("components", {})
            components.setdefault("schemas", {}).update(SCHEMAS)
            for unused in ("HTTPValidationError", "ValidationError"):
                components["schemas"].pop(unused, None)
            components["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer", "description": "il_… token"}
            }
            for path, item in document["paths"].items():
                for method, operation in item.items():
                    if path.startswith("/v1/"):
                        _complete(path, method, operation)
                        _no_nul(operation.get("requestBody"))
            for name, schema in components["schemas"].items():
                if name not in SCHEMAS:  # request models; the answers' are ours
                    _no_nul(schema)
            app.openapi_schema = document
        return app.openapi_schema

    setattr(app, "openapi", openapi)  # noqa: B010 - FastAPI's documented override
