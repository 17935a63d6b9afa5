"""NATS subjects and the Dynamo event-plane envelope that carry FPM records.

Subject: ``namespace.{ns}.component.{component}.endpoint.{endpoint}.forward-pass-metrics`` (core NATS).
Body: a msgpack map ``{publisher_id, sequence, published_at, topic, payload}`` exactly as the Dynamo
runtime's event plane writes it; ``payload`` is the encoded :class:`ForwardPassMetrics`.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

FPM_TOPIC = "forward-pass-metrics"
DEFAULT_NAMESPACE = "dynamo"
DEFAULT_ENDPOINT = "generate"
# Upstream convention that planners rely on: prefill workers serve under "prefill",
# decode and aggregated workers under "backend".
PREFILL_COMPONENT = "prefill"
DECODE_COMPONENT = "backend"


class EventEnvelope(msgspec.Struct, frozen=True, gc=False):
    """The runtime's event-plane envelope (field order as the runtime writes it)."""

    publisher_id: int
    sequence: int
    published_at: int  # epoch milliseconds
    topic: str
    payload: bytes


_envelope_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(EventEnvelope)


def encode_envelope(envelope: EventEnvelope) -> bytes:
    return _envelope_encoder.encode(envelope)


def decode_envelope(data: bytes | bytearray | memoryview) -> EventEnvelope:
    """Raises ``msgspec.DecodeError`` / ``msgspec.ValidationError`` on bad input (callers count it)."""
    return _envelope_decoder.decode(data)


def _check_token(kind: str, value: str) -> str:
    if not value or any(c in value for c in ". *>\t\r\n"):
        raise ValueError(f"invalid {kind} {value!r}: must be non-empty, without '.', '*', '>' or whitespace")
    return value


def fpm_subject(namespace: str, component: str, endpoint: str = DEFAULT_ENDPOINT) -> str:
    """The subject one engine publishes on."""
    return (
        f"namespace.{_check_token('namespace', namespace)}"
        f".component.{_check_token('component', component)}"
        f".endpoint.{_check_token('endpoint', endpoint)}.{FPM_TOPIC}"
    )


def fpm_subscription(namespace: str, component: str | None = None, endpoint: str | None = None) -> str:
    """A subscription subject; ``None`` for component or endpoint means any (NATS ``*``)."""
    comp = "*" if component is None else _check_token("component", component)
    ep = "*" if endpoint is None else _check_token("endpoint", endpoint)
    return f"namespace.{_check_token('namespace', namespace)}.component.{comp}.endpoint.{ep}.{FPM_TOPIC}"


@dataclass(frozen=True, slots=True)
class FpmSubject:
    namespace: str
    component: str
    endpoint: str


def parse_fpm_subject(subject: str) -> FpmSubject | None:
    """Inverse of :func:`fpm_subject`; ``None`` if the subject is not an FPM subject."""
    parts = subject.split(".")
    if (
        len(parts) != 7
        or parts[0] != "namespace"
        or parts[2] != "component"
        or parts[4] != "endpoint"
        or parts[6] != FPM_TOPIC
        or not all(parts[i] for i in (1, 3, 5))
    ):
        return None
    return FpmSubject(namespace=parts[1], component=parts[3], endpoint=parts[5])
