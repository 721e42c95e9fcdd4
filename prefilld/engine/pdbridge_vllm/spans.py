"""The plugin's spans: each stage of a traced request's work (`capture`, `to_mlx`, `reconstruct`,
`to_host`, `send`) as an OpenTelemetry span named ``pdbridge.<stage>``, under prefilld's span of the
request (its W3C ``traceparent`` in `PluginParams`). They are exported by the tracer provider vLLM
installs in its processes when it runs with ``--otlp-traces-endpoint`` (prefilld's
``[telemetry]``); without one, or for a request that is not traced, nothing is recorded."""

from __future__ import annotations

import contextlib
from typing import Any

try:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # vLLM depends on OpenTelemetry; a build without it traces nothing
    trace = None


def parent(traceparent: str) -> Any:
    """The context a request's spans continue, or None when the request is not traced."""
    if not traceparent or trace is None:
        return None
    context = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    return context if trace.get_current_span(context).get_span_context().is_valid else None


@contextlib.contextmanager
def span(context: Any, stage: str, **attributes):
    """A span of `stage` under `context` (nothing when it is None); an exception marks it failed."""
    if context is None:
        yield
        return
    s = trace.get_tracer("pdbridge_vllm").start_span(
        f"pdbridge.{stage}", context=context, attributes={f"pdbridge.{k}": v for k, v in attributes.items()})
    try:
        yield
    except BaseException as e:
        s.record_exception(e)
        s.set_status(trace.Status(trace.StatusCode.ERROR, str(e)))
        raise
    finally:
        s.end()
