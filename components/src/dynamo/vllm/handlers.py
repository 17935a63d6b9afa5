"""Token-in, token-out request handling in the Dynamo 1.6.1 frontend's protocol.

The frontend tokenizes, templates, detokenizes and applies stop strings; the worker turns a
preprocessed request (``token_ids``, ``sampling_options``, ``stop_conditions``...) into vLLM
``SamplingParams``, streams token deltas back and, in disaggregated mode, carries vLLM's KV transfer
parameters between the prefill and the decode worker. Request translation is pure (``build_sampling_params``,
``output_frame``) and tested without an engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from dynamo.vllm.drain import InflightTracker

log = logging.getLogger(__name__)

KV_TRANSFER_PARAMS_KEY = "kv_transfer_params"
# Stop conditions the frontend applies itself (stop strings are matched on detokenized text there).
_FRONTEND_STOP_KEYS = frozenset({"stop"})


class RequestError(ValueError):
    """A request the engine cannot run (bad sampling option, missing token ids...)."""


def _sampling_fields() -> frozenset[str]:
    from vllm import SamplingParams

    fields = getattr(SamplingParams, "__struct_fields__", None)
    if fields is None:
        import dataclasses

        fields = tuple(f.name for f in dataclasses.fields(SamplingParams))
    return frozenset(fields)


def sampling_kwargs(
    request: Mapping[str, Any], defaults: Mapping[str, Any], model_max_len: int | None
) -> dict[str, Any]:
    """Keyword arguments of ``SamplingParams`` for a preprocessed request (model defaults, then request)."""
    token_ids = request.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids:
        raise RequestError("request has no token_ids")
    allowed = _sampling_fields()
    kwargs: dict[str, Any] = {k: v for k, v in defaults.items() if k in allowed}
    for key, value in (request.get("sampling_options") or {}).items():
        if value is not None and key in allowed:
            kwargs[key] = value
    stop_conditions = request.get("stop_conditions") or {}
    for key, value in stop_conditions.items():
        if value is None or key in _FRONTEND_STOP_KEYS:
            continue
        if key == "stop_token_ids_hidden":
            kwargs["stop_token_ids"] = sorted(set(kwargs.get("stop_token_ids") or []) | set(value))
        elif key in allowed:
            kwargs[key] = value
    output_options = request.get("output_options") or {}
    if output_options.get("logprobs") is not None:
        kwargs["logprobs"] = int(output_options["logprobs"])
    if output_options.get("prompt_logprobs") is not None:
        kwargs["prompt_logprobs"] = int(output_options["prompt_logprobs"])
    if kwargs.get("max_tokens") is None and model_max_len is not None:
        kwargs["max_tokens"] = max(1, model_max_len - len(token_ids))
    return kwargs


def build_sampling_params(
    request: Mapping[str, Any],
    defaults: Mapping[str, Any],
    model_max_len: int | None,
    kv_transfer_params: Mapping[str, Any] | None = None,
) -> Any:
    """vLLM ``SamplingParams`` (token deltas, no detokenization); a bad option raises ``RequestError``."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kwargs = sampling_kwargs(request, defaults, model_max_len)
    kwargs["detokenize"] = False
    kwargs["output_kind"] = RequestOutputKind.DELTA
    if kv_transfer_params is not None:
        extra = dict(kwargs.get("extra_args") or {})
        extra[KV_TRANSFER_PARAMS_KEY] = dict(kv_transfer_params)
        kwargs["extra_args"] = extra
    try:
        return SamplingParams(**kwargs)
    except Exception as exc:  # vLLM's VLLMValidationError is not a ValueError
        raise RequestError(f"invalid sampling options: {exc}") from exc


def decode_kv_transfer_params(request: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The KV transfer parameters the frontend copied from the prefill worker's output, if any."""
    prefill_result = request.get("prefill_result") or {}
    params = (prefill_result.get("disaggregated_params") or {}).get(KV_TRANSFER_PARAMS_KEY)
    return params if isinstance(params, Mapping) else None


def output_frame(output: Any, prompt_len: int, generated: int, prefill: bool) -> dict[str, Any]:
    """One response frame from a DELTA ``RequestOutput``; the last frame carries finish reason and usage."""
    completion = output.outputs[0] if output.outputs else None
    token_ids = list(completion.token_ids) if completion is not None else []
    frame: dict[str, Any] = {"token_ids": token_ids}
    if prefill:
        frame["disaggregated_params"] = (
            {KV_TRANSFER_PARAMS_KEY: output.kv_transfer_params} if output.kv_transfer_params else None
        )
    finish_reason = completion.finish_reason if completion is not None else None
    if output.finished:
        frame["finish_reason"] = _finish_reason(finish_reason)
        if completion is not None and completion.stop_reason is not None:
            frame["stop_reason"] = completion.stop_reason
        frame["completion_usage"] = {
            "prompt_tokens": prompt_len,
            "completion_tokens": generated,
            "total_tokens": prompt_len + generated,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens or 0},
        }
    return frame


def local_dp_rank(routing: Mapping[str, Any] | None, start_rank: int, size: int) -> int | None:
    """The engine-local data-parallel rank the router chose, or None to let vLLM pick (out of range too)."""
    rank = (routing or {}).get("dp_rank")
    if not isinstance(rank, int) or size <= 1 or not start_rank <= rank < start_rank + size:
        return None
    return rank - start_rank


def _finish_reason(reason: str | None) -> str:
    if reason in ("stop", "length", "error"):
        return reason
    if reason == "abort":
        return "cancelled"
    return "stop" if reason is None else str(reason)


class RequestHandler:
    """Serves the ``generate`` endpoint: one instance per worker, one async generator per request."""

    def __init__(
        self,
        engine: Any,
        mode: str,
        tracker: InflightTracker,
        model_max_len: int | None,
        default_sampling: Mapping[str, Any] | None = None,
        dp_start_rank: int = 0,
        dp_size: int = 1,
    ) -> None:
        self.engine = engine
        self.mode = mode
        self.tracker = tracker
        self.model_max_len = model_max_len
        self.default_sampling = dict(default_sampling or {})
        self.dp_start_rank = dp_start_rank
        self.dp_size = dp_size

    def _params(self, request: Mapping[str, Any]) -> Any:
        if self.mode == "prefill":
            # One token and the KV kept for decode. The client's length limits belong to the decode side: a
            # min_tokens above 1 would otherwise fail vLLM's validation here (min_tokens <= max_tokens).
            stop = {**(request.get("stop_conditions") or {}), "max_tokens": 1, "min_tokens": 0}
            return build_sampling_params(
                {**request, "stop_conditions": stop},
                self.default_sampling,
                self.model_max_len,
                {"do_remote_decode": True},
            )
        kv = decode_kv_transfer_params(request) if self.mode == "decode" else None
        return build_sampling_params(request, self.default_sampling, self.model_max_len, kv)

    async def generate(self, request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        """Stream token deltas; abort in vLLM when the client goes away; errors become Dynamo errors."""
        from dynamo.llm.exceptions import EngineShutdown, InvalidArgument, Unknown

        if not self.tracker.accepting:
            raise EngineShutdown("worker is draining")
        try:
            params = self._params(request)
        except RequestError as exc:
            raise InvalidArgument(str(exc)) from exc
        request_id = _request_id(context)
        token_ids = list(request["token_ids"])
        log.debug("request %s: %d prompt tokens, %s mode", request_id, len(token_ids), self.mode)
        prompt_len = len(token_ids)
        generated = 0
        finished = False
        watcher = _watch_cancellation(context, self.engine, request_id)
        with self.tracker.track(request_id):
            try:
                from vllm.inputs import TokensPrompt

                dp_rank = local_dp_rank(request.get("routing"), self.dp_start_rank, self.dp_size)
                stream = self.engine.generate(
                    TokensPrompt(prompt_token_ids=token_ids), params, request_id, data_parallel_rank=dp_rank
                )
                async for output in stream:
                    if context is not None and context.is_stopped():
                        log.info("request %s cancelled by the client (context stopped)", request_id)
                        await self.engine.abort(request_id)
                        return
                    completion = output.outputs[0] if output.outputs else None
                    generated += len(completion.token_ids) if completion is not None else 0
                    finished = output.finished
                    yield output_frame(output, prompt_len, generated, self.mode == "prefill")
                    if finished:
                        return
            except (asyncio.CancelledError, GeneratorExit):
                if not finished:
                    log.info("request %s cancelled by the client (stream closed)", request_id)
                    await _abort_quietly(self.engine, request_id)
                raise
            except Exception as exc:
                if _is_client_error(exc):
                    raise InvalidArgument(str(exc)) from exc
                if _is_engine_dead(exc):
                    raise EngineShutdown(f"vLLM engine is dead: {exc}") from exc
                log.exception("request %s failed", request_id)
                raise Unknown(f"{type(exc).__name__}: {exc}") from exc
            finally:
                if watcher is not None:
                    watcher.cancel()


def _request_id(context: Any) -> str:
    rid = None
    if context is not None:
        with contextlib.suppress(Exception):
            rid = context.id()
    return f"{rid or 'req'}-{uuid.uuid4().hex[:8]}"


def _watch_cancellation(context: Any, engine: Any, request_id: str) -> asyncio.Task[None] | None:
    """Abort in vLLM as soon as the runtime says the client went away (even between tokens)."""
    if context is None or not hasattr(context, "async_killed_or_stopped"):
        return None

    async def watch() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await context.async_killed_or_stopped()
            log.info("request %s cancelled by the client (context killed or stopped)", request_id)
            await _abort_quietly(engine, request_id)

    return asyncio.get_running_loop().create_task(watch())


async def _abort_quietly(engine: Any, request_id: str) -> None:
    with contextlib.suppress(Exception):
        await engine.abort(request_id)


def _is_client_error(exc: BaseException) -> bool:
    """The request itself is bad (prompt too long, invalid option): a 4xx, not a worker failure."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:  # pragma: no cover - older vLLM
        return isinstance(exc, ValueError)
    return isinstance(exc, VLLMClientError | ValueError)


def _is_engine_dead(exc: BaseException) -> bool:
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:  # pragma: no cover - older vLLM
        return False
    return isinstance(exc, EngineDeadError)
