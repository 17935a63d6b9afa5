"""Token-in, token-out request handling in the Dynamo 1.6.1 frontend's protocol.

The frontend tokenizes, templates, detokenizes and applies stop strings; the worker turns a
preprocessed request (``token_ids``, ``sampling_options``, ``stop_conditions``...) into vLLM
``SamplingParams``, streams token deltas back and, in disaggregated mode, carries vLLM's KV transfer
parameters between the prefill and the decode worker. Request translation is pure (``build_sampling_params``,
``FrameBuilder``) and tested without an engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from dynamo.vllm.drain import InflightTracker, Outcome

log = logging.getLogger(__name__)

KV_TRANSFER_PARAMS_KEY = "kv_transfer_params"
# Stop conditions the frontend applies itself (stop strings are matched on detokenized text there).
_FRONTEND_STOP_KEYS = frozenset({"stop"})
# Stop conditions named differently in vLLM: both kinds of stop token end the request in vLLM (which keeps the
# token in its output); the frontend hides the hidden ones.
_STOP_TOKEN_KEYS = ("stop_token_ids_hidden", "stop_token_ids_visible")
_RENAMED_STOP_KEYS = {"max_thinking_tokens": "thinking_token_budget"}
# Output options the frontend applies itself when it detokenizes.
_FRONTEND_OUTPUT_KEYS = frozenset({"skip_special_tokens", "formatted_prompt", "return_tokens_as_token_ids"})
# vLLM floors logprobs at this value in its own OpenAI server (-inf is not JSON).
_LOGPROB_FLOOR = -9999.0
# The frontend returns prompt logprobs (as ``nvext.prompt_logprobs``) only when the client names this field in
# ``nvext.extra_fields``; without it they would be computed and dropped.
PROMPT_LOGPROBS_FIELD = "prompt_logprobs"


class RequestError(ValueError):
    """A request the engine cannot run (bad sampling option, missing token ids...)."""


def _sampling_fields() -> frozenset[str]:
    from vllm import SamplingParams

    fields = getattr(SamplingParams, "__struct_fields__", None)
    if fields is None:
        import dataclasses

        fields = tuple(f.name for f in dataclasses.fields(SamplingParams))
    return frozenset(fields)


# Sampling options vLLM has no field for, accepted at their neutral value only (see
# ``_unsupported_sampling``).
_NEUTRAL_ONLY_SAMPLING = frozenset({"best_of", "use_beam_search", "length_penalty"})


def _unsupported_sampling(key: str, value: Any, options: Mapping[str, Any]) -> str | None:
    """Why a sampling option this worker receives cannot be honoured, or None when it can."""
    if key == "best_of":
        return None if value in (1, options.get("n") or 1) else "best_of (vLLM V1 has no best_of)"
    if key == "use_beam_search":
        return "use_beam_search (not served by this worker)" if value else None
    if key == "length_penalty":
        return None if value == 1.0 else "length_penalty (applies to beam search only, not served)"
    if key == "guided_decoding":
        return "guided_decoding (structured output is not served by this worker)"
    return None


def _extra_fields(request: Mapping[str, Any]) -> frozenset[str]:
    """The ``nvext.extra_fields`` the client asked the frontend to return (the frontend forwards
    ``nvext``)."""
    names: set[str] = set()
    extra_args = request.get("extra_args")
    for source in (
        request.get("nvext"),
        extra_args.get("nvext") if isinstance(extra_args, Mapping) else None,
    ):
        if isinstance(source, Mapping) and isinstance(source.get("extra_fields"), list):
            names.update(str(name) for name in source["extra_fields"])
    return frozenset(names)


def _non_negative_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise RequestError(f"{name} must be a non-negative integer, got {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise RequestError(f"{name} must be a non-negative integer, got {value!r}") from None
    if number < 0 or number != float(value):
        raise RequestError(f"{name} must be a non-negative integer, got {value!r}")
    return number


def sampling_kwargs(
    request: Mapping[str, Any],
    defaults: Mapping[str, Any],
    model_max_len: int | None,
    mode: str = "agg",
) -> dict[str, Any]:
    """Keyword arguments of ``SamplingParams`` for a preprocessed request (model defaults, then request).

    Every option the request sets is either honoured or refused with a ``RequestError`` naming it (the
    frontend answers HTTP 400): none is dropped silently.
    """
    token_ids = request.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids:
        raise RequestError("request has no token_ids")
    allowed = _sampling_fields()
    kwargs: dict[str, Any] = {k: v for k, v in defaults.items() if k in allowed}
    refused: list[str] = []
    options = request.get("sampling_options") or {}
    for key, value in options.items():
        if value is None:
            continue
        reason = _unsupported_sampling(key, value, options)
        if reason is not None:
            refused.append(reason)
        elif key in _NEUTRAL_ONLY_SAMPLING:
            continue  # at its neutral value: nothing to do
        elif key in allowed:
            kwargs[key] = value
        else:
            refused.append(f"{key} (unknown sampling option)")
    stop_conditions = request.get("stop_conditions") or {}
    for key, value in stop_conditions.items():
        if value is None or key in _FRONTEND_STOP_KEYS:
            continue
        if key in _STOP_TOKEN_KEYS:
            kwargs["stop_token_ids"] = sorted(set(kwargs.get("stop_token_ids") or []) | set(value))
        elif key in _RENAMED_STOP_KEYS:
            kwargs[_RENAMED_STOP_KEYS[key]] = value
        elif key in allowed:
            kwargs[key] = value
        else:
            refused.append(f"{key} (unknown stop condition)")
    output_options = request.get("output_options") or {}
    for key, value in output_options.items():
        if value is None or key in _FRONTEND_OUTPUT_KEYS:
            continue
        if key == "logprobs":
            kwargs["logprobs"] = _non_negative_int(value, "logprobs")
        elif key == "prompt_logprobs":
            kwargs["prompt_logprobs"] = _non_negative_int(value, "prompt_logprobs")
        else:
            refused.append(f"{key} (unknown output option)")
    n = kwargs.get("n") or 1
    if mode != "agg" and n != 1:
        refused.append(f"n={n} (several choices are served by aggregated workers only)")
    if kwargs.get("prompt_logprobs") is not None:
        if mode != "agg":
            refused.append("prompt_logprobs (served by aggregated workers only)")
        elif PROMPT_LOGPROBS_FIELD not in _extra_fields(request):
            refused.append(
                'prompt_logprobs (the frontend returns them only with nvext.extra_fields ["prompt_logprobs"])'
            )
        else:
            # Prompt positions read from the prefix cache would have no logprobs.
            kwargs["skip_reading_prefix_cache"] = True
    if refused:
        raise RequestError("unsupported request option(s): " + "; ".join(refused))
    if mode == "prefill":
        kwargs.pop("logprobs", None)  # the prefill worker's token is discarded: decode computes them
    if kwargs.get("max_tokens") is None and model_max_len is not None:
        kwargs["max_tokens"] = max(1, model_max_len - len(token_ids))
    return kwargs


def build_sampling_params(
    request: Mapping[str, Any],
    defaults: Mapping[str, Any],
    model_max_len: int | None,
    kv_transfer_params: Mapping[str, Any] | None = None,
    mode: str = "agg",
) -> Any:
    """vLLM ``SamplingParams`` (token deltas, no detokenization); a bad option raises ``RequestError``."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kwargs = sampling_kwargs(request, defaults, model_max_len, mode)
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


def _logprob(value: float) -> float:
    return max(float(value), _LOGPROB_FLOOR)


def token_logprobs(
    token_ids: list[int], logprobs: Any, top: int
) -> tuple[list[float], list[list[dict[str, Any]]]] | None:
    """The frontend's ``log_probs`` / ``top_logprobs`` for one chunk of a DELTA output (None if vLLM sent
    none).

    ``log_probs``: the sampled token's logprob per position; ``top_logprobs``: the ``top`` most likely tokens
    per position, by rank (vLLM also lists the sampled token when it ranks lower). The frontend adds the token
    text.
    """
    if not logprobs or len(logprobs) < len(token_ids):
        return None
    chosen: list[float] = []
    tops: list[list[dict[str, Any]]] = []
    for token_id, position in zip(token_ids, logprobs, strict=False):
        if position is None or token_id not in position:
            return None
        chosen.append(_logprob(position[token_id].logprob))
        ranked = sorted(
            (info.rank, tid, info.logprob) for tid, info in position.items() if info.rank is not None
        )
        tops.append(
            [
                {"rank": rank, "token_id": tid, "token": None, "logprob": _logprob(lp)}
                for rank, tid, lp in ranked
                if rank <= top
            ]
        )
    return chosen, tops


def prompt_logprobs_payload(prompt_logprobs: Any) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``RequestOutput.prompt_logprobs`` as the frontend's ``nvext.prompt_logprobs`` (token ids as
    keys)."""
    payload: list[dict[str, dict[str, Any]] | None] = []
    for position in prompt_logprobs:
        if position is None:
            payload.append(None)
            continue
        payload.append(
            {
                str(tid): {
                    "logprob": _logprob(info.logprob),
                    **({"rank": info.rank} if info.rank is not None else {}),
                }
                for tid, info in position.items()
            }
        )
    return payload


class FrameBuilder:
    """Response frames of one request from vLLM's DELTA outputs: one frame per choice that has news.

    With ``n`` > 1 each frame names its choice (``index``); a choice's last frame carries its finish reason
    and the usage so far (prompt once, completion tokens of every choice).
    """

    def __init__(self, prompt_len: int, prefill: bool, params: Any) -> None:
        self.prompt_len = prompt_len
        self.prefill = prefill
        self.n = int(getattr(params, "n", 1) or 1)
        self.top_logprobs = getattr(params, "logprobs", None)
        self.generated: dict[int, int] = {}
        self._prompt_logprobs: list[Any] | None = None
        self._want_prompt_logprobs = getattr(params, "prompt_logprobs", None) is not None

    @property
    def total_generated(self) -> int:
        return sum(self.generated.values())

    def frames(self, output: Any) -> list[dict[str, Any]]:
        if (
            self._want_prompt_logprobs
            and self._prompt_logprobs is None
            and output.prompt_logprobs is not None
        ):
            self._prompt_logprobs = prompt_logprobs_payload(output.prompt_logprobs)
        completions = list(output.outputs or [])
        if not completions:
            return [self._frame(output, None, [], output.finished)]
        frames = []
        for completion in completions:
            token_ids = list(completion.token_ids)
            index = int(getattr(completion, "index", 0) or 0)
            self.generated[index] = self.generated.get(index, 0) + len(token_ids)
            done = completion.finish_reason is not None or (output.finished and self.n == 1)
            if self.n > 1 and not token_ids and not done:
                continue
            frame = self._frame(output, completion, token_ids, done)
            if self.n > 1:
                frame["index"] = index
            if self.top_logprobs is not None:
                found = token_logprobs(token_ids, completion.logprobs, self.top_logprobs)
                if found is not None:
                    frame["log_probs"], frame["top_logprobs"] = found
            frames.append(frame)
        return frames

    def _frame(self, output: Any, completion: Any, token_ids: list[int], done: bool) -> dict[str, Any]:
        frame: dict[str, Any] = {"token_ids": token_ids}
        if self.prefill:
            frame["disaggregated_params"] = (
                {KV_TRANSFER_PARAMS_KEY: output.kv_transfer_params} if output.kv_transfer_params else None
            )
        if done:
            frame["finish_reason"] = _finish_reason(
                completion.finish_reason if completion is not None else None
            )
            if completion is not None and completion.stop_reason is not None:
                frame["stop_reason"] = completion.stop_reason
            generated = self.total_generated
            frame["completion_usage"] = {
                "prompt_tokens": self.prompt_len,
                "completion_tokens": generated,
                "total_tokens": self.prompt_len + generated,
                "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens or 0},
            }
            if self._prompt_logprobs is not None:
                frame["engine_data"] = {PROMPT_LOGPROBS_FIELD: self._prompt_logprobs}
        return frame


KV_TRANSFER_FAILED = "KV transfer from prefill worker failed"


def kv_peer(params: Mapping[str, Any] | None) -> str:
    """The prefill engine a decode request reads its KV from, as vLLM's NixlConnector names it."""
    if not params:
        return "none"
    host, port, engine = params.get("remote_host"), params.get("remote_port"), params.get("remote_engine_id")
    where = f"{host}:{port}" if host is not None else "unknown address"
    return f"{where} (engine {engine})" if engine is not None else where


def failed_stage(mode: str, output: Any, kv_params: Mapping[str, Any] | None) -> str | None:
    """``kv_transfer`` when a decode request that was to read its KV from a prefill worker ended with vLLM's
    ``error`` finish reason (the read failed and ``kv_load_failure_policy`` is ``fail``), else None."""
    if mode != "decode" or not kv_params or not output.finished:
        return None
    return "kv_transfer" if any(c.finish_reason == "error" for c in output.outputs or []) else None


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
                mode="prefill",
            )
        kv = decode_kv_transfer_params(request) if self.mode == "decode" else None
        return build_sampling_params(request, self.default_sampling, self.model_max_len, kv, mode=self.mode)

    async def generate(self, request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        """Stream token deltas; abort in vLLM when the client goes away; errors become Dynamo errors.

        A request the drain cut (``InflightTracker.cut``) ends with ``EngineShutdown`` instead of a finish
        reason: the frontend then migrates it to another worker (``--migration-limit``) with the tokens
        generated so far, or reports an error; it never returns the partial text as a finished answer.
        """
        from dynamo.llm.exceptions import EngineShutdown, InvalidArgument, Unknown

        if not self.tracker.accepting:
            raise EngineShutdown("worker is draining")
        try:
            params = self._params(request)
        except RequestError as exc:
            raise InvalidArgument(str(exc)) from exc
        request_id = _request_id(context)
        kv_params = decode_kv_transfer_params(request) if self.mode == "decode" else None
        token_ids = list(request["token_ids"])
        log.debug("request %s: %d prompt tokens, %s mode", request_id, len(token_ids), self.mode)
        frames = FrameBuilder(len(token_ids), self.mode == "prefill", params)
        finished = False
        watcher = _watch_cancellation(context, self.engine, request_id)

        def handed_back() -> Exception:
            tracked.outcome = Outcome.HANDED_BACK
            log.info(
                "request %s cut by the drain after %d token(s): handed back to the frontend",
                request_id,
                frames.total_generated,
            )
            return EngineShutdown("worker is draining: request handed back for migration")

        with self.tracker.track(request_id) as tracked:
            if _client_gone(context):
                # E.g. a worker resumed after a stop (SIGSTOP, a host stall) finds the requests the frontend
                # gave up on meanwhile: a prefill run now would hold its KV for a read that never comes.
                log.info("request %s cancelled by the client before it started: not run", request_id)
                tracked.outcome = Outcome.CANCELLED
                if watcher is not None:
                    watcher.cancel()
                return
            try:
                from vllm.inputs import TokensPrompt

                dp_rank = local_dp_rank(request.get("routing"), self.dp_start_rank, self.dp_size)
                stream = self.engine.generate(
                    TokensPrompt(prompt_token_ids=token_ids), params, request_id, data_parallel_rank=dp_rank
                )
                async for output in stream:
                    if context is not None and context.is_stopped():
                        log.info("request %s cancelled by the client (context stopped)", request_id)
                        tracked.outcome = Outcome.CANCELLED
                        await self.engine.abort(request_id)
                        return
                    if output.finished and self.tracker.was_cut(request_id) and _aborted(output):
                        raise handed_back()
                    if failed_stage(self.mode, output, kv_params) is not None:
                        peer = kv_peer(kv_params)
                        log.error(
                            "request %s failed: stage=kv_transfer peer=%s cause=the decode engine could "
                            "not read the prompt's KV (prefill worker gone or unreachable; "
                            "kv_load_failure_policy fail)",
                            request_id,
                            peer,
                        )
                        raise _http_error(502, f"{KV_TRANSFER_FAILED}: {peer}")
                    finished = output.finished
                    for frame in frames.frames(output):
                        yield frame
                    if finished:
                        tracked.outcome = Outcome.COMPLETED
                        return
                if self.tracker.was_cut(request_id):
                    raise handed_back()
            except (asyncio.CancelledError, GeneratorExit):
                if not finished:
                    log.info("request %s cancelled by the client (stream closed)", request_id)
                    tracked.outcome = Outcome.CANCELLED
                    await _abort_quietly(self.engine, request_id)
                raise
            except EngineShutdown:
                raise
            except Exception as exc:
                if self.tracker.was_cut(request_id):
                    raise handed_back() from exc
                if _is_http_error(exc):
                    raise
                if _is_client_error(exc):
                    tracked.outcome = Outcome.REJECTED
                    raise InvalidArgument(str(exc)) from exc
                cause = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
                if _is_engine_dead(exc):
                    log.error("request %s failed: stage=%s peer=none cause=%s", request_id, self.mode, cause)
                    raise EngineShutdown(f"vLLM engine is dead: {exc}") from exc
                log.error(
                    "request %s failed: stage=%s peer=%s cause=%s",
                    request_id,
                    self.mode,
                    kv_peer(kv_params),
                    cause,
                )
                log.debug("request %s traceback", request_id, exc_info=True)
                raise Unknown(f"{type(exc).__name__}: {exc}") from exc
            finally:
                if watcher is not None:
                    watcher.cancel()


def _http_error(code: int, message: str) -> Exception:
    """Dynamo's ``HttpError``: the 1.6.1 frontend answers 500 with ``details.backend_status`` = ``code`` (it
    keeps the message of a 5xx in its own log, not in the client's answer)."""
    from dynamo.llm.exceptions import HttpError

    return HttpError(code, message)


def _is_http_error(exc: BaseException) -> bool:
    from dynamo.llm.exceptions import HttpError

    return isinstance(exc, HttpError)


def _aborted(output: Any) -> bool:
    """Whether a finished output ended because vLLM aborted it (any choice)."""
    return (
        any(getattr(c, "finish_reason", None) == "abort" for c in output.outputs or []) or not output.outputs
    )


def _request_id(context: Any) -> str:
    rid = None
    if context is not None:
        with contextlib.suppress(Exception):
            rid = context.id()
    return f"{rid or 'req'}-{uuid.uuid4().hex[:8]}"


def _client_gone(context: Any) -> bool:
    """Whether the runtime already says the client went away (stopped or killed) before any work began."""
    if context is None:
        return False
    for check in ("is_stopped", "is_killed"):
        method = getattr(context, check, None)
        with contextlib.suppress(Exception):
            if method is not None and method():
                return True
    return False


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
