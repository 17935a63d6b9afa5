"""The worker's decisions without an engine: argument validation, scheduler choice, FPM environment,
request translation into vLLM sampling parameters, drain ordering, exported metrics, frontend flags.

vLLM's own ``SamplingParams`` and ``RequestOutput`` types are used (real types, no engine).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
import types
from pathlib import Path
from typing import Any

import pytest
from dynamo.vllm import args as wargs
from dynamo.vllm import engine as eng
from dynamo.vllm.drain import ExitCode, InflightTracker, Outcome, drain
from dynamo.vllm.fpm_metrics import WorkerCollector, WorkerMetrics, read_stats
from dynamo.vllm.registration import ROLES, needs_of


def _config(tmp_path: Path, **kw: Any) -> wargs.WorkerConfig:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    base: dict[str, Any] = {"model": str(model), "served_model_name": "m"}
    base.update(kw)
    return wargs.WorkerConfig(**base)


# ---- arguments ---------------------------------------------------------------------------------


def test_valid_config_passes(tmp_path: Path) -> None:
    wargs.validate(_config(tmp_path))


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"model": "/definitely/not/here"}, "does not exist"),
        ({"disaggregation_mode": "prefill"}, "needs --kv-transfer-config"),
        ({"disaggregation_mode": "decode"}, "needs --kv-transfer-config"),
        ({"drain_timeout_s": -1.0}, "--drain-timeout"),
        ({"metrics_port": 70000}, "--metrics-port"),
        ({"namespace": "a.b"}, "--namespace"),
        ({"custom_jinja_template": "/no/template.jinja"}, "--custom-jinja-template"),
    ],
)
def test_bad_configs_fail_with_a_reason(tmp_path: Path, changes: dict[str, Any], reason: str) -> None:
    with pytest.raises(wargs.ConfigError, match=reason.replace("-", r"\-")):
        wargs.validate(_config(tmp_path, **changes))


def test_disaggregated_modes_accept_a_kv_transfer_config(tmp_path: Path) -> None:
    kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    for mode in ("prefill", "decode"):
        wargs.validate(_config(tmp_path, disaggregation_mode=mode, kv_transfer_config=kv))


def test_model_path_problem(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert wargs.model_path_problem(str(tmp_path)) is None
    (tmp_path / "file").write_text("x")
    assert "not a directory" in (wargs.model_path_problem(str(tmp_path / "file")) or "")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "HF_HUB_OFFLINE" in (wargs.model_path_problem("org/model") or "")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert wargs.model_path_problem("org/model") is None


def test_prevalidate_fails_fast_without_vllm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wargs.prevalidate(["--model", str(tmp_path), "--max-num-seqs", "4", "--enforce-eager"])
    wargs.prevalidate(["--help"])
    for argv, reason in (
        (["--model", "/not/here"], "does not exist"),
        (["--model", str(tmp_path), "--disaggregation-mode", "decode"], "needs --kv-transfer-config"),
        (["--model", str(tmp_path), "--drain-timeout", "soon"], "invalid float value"),
    ):
        with pytest.raises(SystemExit) as exc:
            wargs.prevalidate(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("dynamo.vllm: error:") and reason in err[0]


def test_component_follows_mode() -> None:
    assert wargs.component_for_mode("prefill") == "prefill"
    assert wargs.component_for_mode("decode") == "backend"
    assert wargs.component_for_mode("agg") == "backend"


def test_event_plane_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NATS_SERVER", raising=False)
    assert wargs.default_event_plane() == "zmq"
    monkeypatch.setenv("NATS_SERVER", "nats://127.0.0.1:4222")
    assert wargs.default_event_plane() == "nats"


def test_parser_keeps_vllm_engine_args_and_our_env_defaults(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DYN_NAMESPACE", "ns1")
    monkeypatch.setenv("DYN_DRAIN_TIMEOUT_S", "7.5")
    from vllm.engine.arg_utils import AsyncEngineArgs

    ns = wargs.build_parser().parse_args(
        [
            "--model",
            str(tmp_path),
            "--disaggregation-mode",
            "prefill",
            "--max-num-seqs",
            "5",
            "--enforce-eager",
            "--kv-transfer-config",
            '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}',
            "--scheduler-cls",
            "my.Sched",
        ]
    )
    config = wargs.config_from_namespace(ns, AsyncEngineArgs.from_cli_args(ns))
    assert config.namespace == "ns1"
    assert config.drain_timeout_s == 7.5
    assert config.component == "prefill"
    assert config.endpoint_path == "ns1.prefill.generate"
    assert config.engine_args.max_num_seqs == 5
    assert config.engine_args.enforce_eager is True
    assert config.kv_transfer_config.kv_role == "kv_producer"
    assert config.scheduler_cls == "my.Sched"
    assert config.local_prefill is True  # a decode worker serves alone while no prefill worker is registered
    wargs.validate(config)
    monkeypatch.setenv("DYN_VLLM_LOCAL_PREFILL", "0")
    assert wargs.build_parser().parse_args(["--model", str(tmp_path)]).local_prefill is False
    monkeypatch.delenv("DYN_VLLM_LOCAL_PREFILL")
    assert (
        wargs.build_parser().parse_args(["--model", str(tmp_path), "--no-local-prefill"]).local_prefill
        is False
    )


# ---- scheduler choice and FPM environment ------------------------------------------------------


def test_scheduler_injected_by_default() -> None:
    choice = eng.choose_scheduler(None, True, True)
    assert choice == eng.SchedulerChoice(wargs.INSTRUMENTED_SCHEDULER, True, None)
    assert eng.choose_scheduler(wargs.INSTRUMENTED_SCHEDULER, True, True).fpm_enabled


def test_user_scheduler_wins_with_one_warning() -> None:
    choice = eng.choose_scheduler("my.Sched", True, True)
    assert choice.scheduler_cls == "my.Sched"
    assert not choice.fpm_enabled
    assert choice.warning and "FPM" in choice.warning and "my.Sched" in choice.warning


def test_fpm_off_or_missing_scheduler() -> None:
    assert eng.choose_scheduler(None, False, True) == eng.SchedulerChoice(None, False, None)
    missing = eng.choose_scheduler(None, True, False)
    assert (
        missing.scheduler_cls is None
        and not missing.fpm_enabled
        and "not importable" in (missing.warning or "")
    )


def test_instrumented_scheduler_is_importable_here() -> None:
    assert eng.instrumented_scheduler_available()


def test_fpm_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NATS_SERVER", "nats://127.0.0.1:1")
    config = _config(tmp_path, namespace="ns", component="prefill")
    env = eng.fpm_environment(config, "123", True, "/d")
    assert env == {
        "DYN_NAMESPACE": "ns",
        "DYN_FPM_COMPONENT": "prefill",
        "DYN_FPM_ENDPOINT": "generate",
        "DYN_FPM_WORKER_ID": "123",
        "DYN_FPM_ENABLED": "1",
        "DYN_FPM_STATS_FILE": "/d/fpm-stats-{dp_rank}.json",
        "NATS_SERVER": "nats://127.0.0.1:1",
    }
    assert eng.fpm_environment(config, "123", False, "/d")["DYN_FPM_ENABLED"] == "0"


def test_fpm_environment_is_what_the_scheduler_reads(tmp_path: Path) -> None:
    from dynamo.vllm.fpm_env import FpmSettings

    env = eng.fpm_environment(_config(tmp_path, namespace="ns"), "42", True, "/d")
    settings = FpmSettings.from_env(env)
    assert (settings.namespace, settings.component, settings.worker_id) == ("ns", "backend", "42")
    assert settings.stats_file_for(3) == "/d/fpm-stats-3.json"


def test_disaggregation_environment() -> None:
    assert eng.disaggregation_environment("agg", {}, 5601) == {}
    assert eng.disaggregation_environment("decode", {}, 5601) == {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601",
    }
    kept = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": "7000"}
    assert eng.disaggregation_environment("prefill", kept, 5601) == {}


def test_disaggregated_cpu_workers_do_not_bind_openmp_threads_unless_told() -> None:
    cpu = eng.disaggregation_environment("decode", {}, 5601, cpu_platform=True)
    assert cpu["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in eng.disaggregation_environment("decode", {}, 5601)  # GPU
    assert eng.disaggregation_environment("agg", {}, 5601, cpu_platform=True) == {}
    user = {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert "VLLM_CPU_OMP_THREADS_BIND" not in eng.disaggregation_environment(
        "prefill", user, 5601, cpu_platform=True
    )


def test_roles_pair_prefill_and_decode() -> None:
    assert ROLES["agg"].worker_type == "Aggregated" and ROLES["agg"].needs == ()
    assert ROLES["decode"].needs == (("Prefill",),)
    assert ROLES["prefill"].needs == (("Decode",),)
    # Degraded mode: a decode worker also serves alone (the empty AND-set) unless --no-local-prefill.
    assert needs_of("decode") == (("Prefill",), ())
    assert needs_of("decode", local_prefill=False) == (("Prefill",),)
    assert needs_of("prefill") == (("Decode",),) and needs_of("agg") == ()
    from dynamo.llm import ModelType, WorkerType

    for role in ROLES.values():
        assert hasattr(WorkerType, role.worker_type)
        assert all(hasattr(ModelType, t) for t in role.model_types)


# ---- request translation -----------------------------------------------------------------------


def _request(**kw: Any) -> dict[str, Any]:
    req: dict[str, Any] = {
        "token_ids": [1, 2, 3],
        "stop_conditions": {"max_tokens": 5},
        "sampling_options": {"temperature": 0.0},
        "output_options": {},
        "eos_token_ids": [2],
    }
    req.update(kw)
    return req


def test_sampling_options_and_stop_conditions_reach_vllm() -> None:
    from dynamo.vllm.handlers import build_sampling_params
    from vllm.sampling_params import RequestOutputKind

    req = _request(
        sampling_options={
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 5,
            "seed": 11,
            "n": None,
            "best_of": None,
        },
        stop_conditions={
            "max_tokens": 9,
            "min_tokens": 2,
            "ignore_eos": True,
            "stop": ["x"],
            "stop_token_ids_hidden": [7, 8],
            "stop_token_ids_visible": [9],
        },
        output_options={"logprobs": 2},
    )
    params = build_sampling_params(req, {"temperature": 1.0, "repetition_penalty": 1.1}, 100)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.7, 0.9, 5, 11)
    assert (params.max_tokens, params.min_tokens, params.ignore_eos) == (9, 2, True)
    assert params.repetition_penalty == 1.1  # model default kept when the request says nothing
    assert set(params.stop_token_ids or []) >= {7, 8, 9}
    assert not params.stop  # stop strings are applied by the frontend on detokenized text
    assert params.logprobs == 2
    assert params.detokenize is False and params.output_kind == RequestOutputKind.DELTA


def test_max_tokens_defaults_to_the_rest_of_the_context() -> None:
    from dynamo.vllm.handlers import build_sampling_params

    params = build_sampling_params(_request(stop_conditions={}), {}, 10)
    assert params.max_tokens == 7


def test_prefill_worker_accepts_a_client_min_tokens_above_one() -> None:
    """The frontend forwards the client's min_tokens with max_tokens=1 to prefill; the limits are decode's."""
    from dynamo.vllm.handlers import RequestHandler

    handler = RequestHandler(None, "prefill", InflightTracker(), 100)
    params = handler._params(_request(stop_conditions={"max_tokens": 1, "min_tokens": 5}))
    assert (params.max_tokens, params.min_tokens) == (1, 0)
    assert params.extra_args["kv_transfer_params"] == {"do_remote_decode": True}
    decode = RequestHandler(None, "decode", InflightTracker(), 100)
    params = decode._params(_request(stop_conditions={"max_tokens": 8, "min_tokens": 5}))
    assert (params.max_tokens, params.min_tokens) == (8, 5)


def test_bad_sampling_option_is_a_request_error() -> None:
    from dynamo.vllm.handlers import RequestError, build_sampling_params

    with pytest.raises(RequestError, match="temperature"):
        build_sampling_params(_request(sampling_options={"temperature": -1.0}), {}, 100)
    with pytest.raises(RequestError, match="token_ids"):
        build_sampling_params(_request(token_ids=[]), {}, 100)


def test_decode_gets_kv_transfer_params_from_prefill_result() -> None:
    from dynamo.vllm.handlers import build_sampling_params, decode_kv_transfer_params

    kv = {"remote_engine_id": "e", "remote_block_ids": [1, 2], "do_remote_prefill": True}
    req = _request(prefill_result={"disaggregated_params": {"kv_transfer_params": kv}})
    got = decode_kv_transfer_params(req)
    assert got == kv
    params = build_sampling_params(req, {}, 100, got)
    assert params.extra_args["kv_transfer_params"] == kv
    assert decode_kv_transfer_params(_request()) is None
    assert decode_kv_transfer_params(_request(prefill_result={"disaggregated_params": None})) is None


async def test_a_failed_kv_read_is_one_log_line_and_an_error_naming_the_stage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM ends a decode request whose KV read failed with finish reason ``error``: the worker logs one line
    (id, stage, peer, cause) and fails the request with an error naming the stage and the prefill peer."""
    from dynamo.llm.exceptions import HttpError
    from dynamo.vllm.handlers import KV_TRANSFER_FAILED, RequestHandler, failed_stage, kv_peer

    kv = {
        "remote_engine_id": "e1",
        "remote_host": "127.0.0.1",
        "remote_port": 5601,
        "do_remote_prefill": True,
    }
    failed = types.SimpleNamespace(
        finished=True,
        outputs=[types.SimpleNamespace(finish_reason="error", token_ids=[], index=0, stop_reason=None)],
    )

    class Engine:
        async def generate(self, *args: Any, **kwargs: Any) -> Any:
            yield failed

    assert kv_peer(kv) == "127.0.0.1:5601 (engine e1)" and kv_peer(None) == "none"
    assert failed_stage("decode", failed, kv) == "kv_transfer"
    assert failed_stage("decode", failed, None) is None  # a local prefill (degraded mode): not a transfer
    assert failed_stage("agg", failed, kv) is None
    tracker = InflightTracker()
    handler = RequestHandler(Engine(), "decode", tracker, 100)
    request = _request(prefill_result={"disaggregated_params": {"kv_transfer_params": kv}})
    with caplog.at_level("INFO", logger="dynamo.vllm.handlers"), pytest.raises(HttpError) as err:
        async for _ in handler.generate(request):
            pass
    assert err.value.code == 502 and err.value.message == f"{KV_TRANSFER_FAILED}: 127.0.0.1:5601 (engine e1)"
    lines = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(lines) == 1 and "stage=kv_transfer peer=127.0.0.1:5601 (engine e1) cause=" in lines[0]
    assert tracker.ended[Outcome.FAILED] == 1


async def test_a_request_whose_client_is_gone_before_it_starts_is_not_run() -> None:
    """A worker resumed after a stop finds requests the frontend already failed (their context is stopped or
    killed): none reaches the engine, where a prefill run would hold its KV for a read that never comes."""
    from dynamo.vllm.handlers import RequestHandler

    started: list[str] = []

    class Engine:
        async def generate(self, *args: Any, **kwargs: Any) -> Any:
            started.append(args[2])
            yield None

    class Context:
        def __init__(self, stopped: bool, killed: bool) -> None:
            self.stopped, self.killed = stopped, killed

        def id(self) -> str:
            return "r1"

        def is_stopped(self) -> bool:
            return self.stopped

        def is_killed(self) -> bool:
            return self.killed

    tracker = InflightTracker()
    handler = RequestHandler(Engine(), "prefill", tracker, 100)
    for stopped, killed in ((True, False), (False, True)):
        assert [f async for f in handler.generate(_request(), Context(stopped, killed))] == []
    assert started == [] and tracker.ended[Outcome.CANCELLED] == 2


def test_router_dp_rank_maps_to_the_local_engine_rank() -> None:
    from dynamo.vllm.handlers import local_dp_rank

    assert local_dp_rank({"dp_rank": 5}, 4, 2) == 1
    assert local_dp_rank({"dp_rank": 6}, 4, 2) is None  # not ours: let vLLM choose
    assert local_dp_rank({"dp_rank": 0}, 0, 1) is None  # one rank: nothing to choose
    assert local_dp_rank({}, 0, 4) is None
    assert local_dp_rank(None, 0, 4) is None


def test_options_that_cannot_be_honoured_are_refused_by_name() -> None:
    """Never dropped silently: each one is a RequestError (HTTP 400 at the frontend) that names it."""
    from dynamo.vllm.handlers import RequestError, build_sampling_params

    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"sampling_options": {"best_of": 3}}, "agg", "best_of"),
        ({"sampling_options": {"use_beam_search": True}}, "agg", "use_beam_search"),
        ({"sampling_options": {"length_penalty": 0.5}}, "agg", "length_penalty"),
        ({"sampling_options": {"guided_decoding": {"json": {}}}}, "agg", "guided_decoding"),
        ({"sampling_options": {"new_knob": 1}}, "agg", "new_knob"),
        ({"stop_conditions": {"max_tokens": 4, "new_stop": 1}}, "agg", "new_stop"),
        ({"output_options": {"new_output": 1}}, "agg", "new_output"),
        ({"output_options": {"logprobs": -1}}, "agg", "logprobs"),
        ({"output_options": {"prompt_logprobs": 1}}, "agg", "prompt_logprobs"),  # not asked back: dropped
        ({"output_options": {"prompt_logprobs": 1}, **_NVEXT_PROMPT_LOGPROBS}, "decode", "prompt_logprobs"),
        ({"sampling_options": {"n": 3}}, "decode", "n=3"),
        ({"sampling_options": {"n": 2}}, "prefill", "n=2"),
    ]
    for change, mode, name in cases:
        with pytest.raises(RequestError, match=re.escape(name)):
            build_sampling_params(_request(**change), {}, 100, mode=mode)
    # Neutral values are fine: best_of equal to n, beam-search settings left at their defaults.
    params = build_sampling_params(
        _request(sampling_options={"n": 3, "best_of": 3, "use_beam_search": False, "length_penalty": 1.0}),
        {},
        100,
    )
    assert params.n == 3


_NVEXT_PROMPT_LOGPROBS = {"extra_args": {"nvext": {"extra_fields": ["prompt_logprobs"]}}}


def test_logprob_options_reach_vllm() -> None:
    from dynamo.vllm.handlers import RequestHandler, build_sampling_params

    params = build_sampling_params(
        _request(output_options={"logprobs": 0, "prompt_logprobs": 2}, **_NVEXT_PROMPT_LOGPROBS), {}, 100
    )
    assert (params.logprobs, params.prompt_logprobs) == (0, 2)
    assert params.skip_reading_prefix_cache is True  # cached prompt positions would have no logprobs
    # The prefill worker's token is discarded: it computes no logprobs, the decode worker does.
    prefill = RequestHandler(None, "prefill", InflightTracker(), 100)
    assert prefill._params(_request(output_options={"logprobs": 2})).logprobs is None
    decode = RequestHandler(None, "decode", InflightTracker(), 100)
    assert decode._params(_request(output_options={"logprobs": 2})).logprobs == 2


def _completion(index: int, token_ids: list[int], reason: str | None = None, logprobs: Any = None) -> Any:
    from vllm.outputs import CompletionOutput

    return CompletionOutput(
        index=index,
        text="",
        token_ids=token_ids,
        cumulative_logprob=None,
        logprobs=logprobs,
        finish_reason=reason,
    )


def _output(
    token_ids: list[int],
    finished: bool,
    reason: str | None = None,
    kv: Any = None,
    outputs: list[Any] | None = None,
    prompt_logprobs: Any = None,
) -> Any:
    from vllm.outputs import RequestOutput

    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1, 2, 3],
        prompt_logprobs=prompt_logprobs,
        outputs=outputs if outputs is not None else [_completion(0, token_ids, reason)],
        finished=finished,
        kv_transfer_params=kv,
        num_cached_tokens=2,
    )


def _builder(prefill: bool = False, **params: Any) -> Any:
    from dynamo.vllm.handlers import FrameBuilder
    from vllm import SamplingParams

    return FrameBuilder(3, prefill, SamplingParams(**params))


def test_output_frames() -> None:
    frames = _builder()
    assert frames.frames(_output([5], False)) == [{"token_ids": [5]}]
    [last] = frames.frames(_output([6, 7], True, "length"))
    assert last["token_ids"] == [6, 7] and last["finish_reason"] == "length"
    assert last["completion_usage"]["completion_tokens"] == 3
    assert last["completion_usage"]["prompt_tokens_details"]["cached_tokens"] == 2
    assert _builder().frames(_output([], True, "abort"))[0]["finish_reason"] == "cancelled"


def test_several_choices_are_framed_by_index() -> None:
    """n=3: each choice streams under its own index and ends with its own finish reason."""
    frames = _builder(n=3)
    step = frames.frames(_output([], False, outputs=[_completion(0, [5]), _completion(2, [6])]))
    assert [(f["index"], f["token_ids"]) for f in step] == [(0, [5]), (2, [6])]
    assert all("finish_reason" not in f for f in step)
    step = frames.frames(_output([], False, outputs=[_completion(1, [7, 8], "length"), _completion(0, [])]))
    assert [(f["index"], f["token_ids"], f["finish_reason"]) for f in step] == [(1, [7, 8], "length")]
    step = frames.frames(
        _output([], True, outputs=[_completion(0, [9], "stop"), _completion(2, [4], "length")])
    )
    assert [(f["index"], f["finish_reason"]) for f in step] == [(0, "stop"), (2, "length")]
    assert step[-1]["completion_usage"]["completion_tokens"] == 6  # every choice's tokens
    assert frames.generated == {0: 2, 1: 2, 2: 2}


def test_logprobs_are_framed_for_the_frontend() -> None:
    from vllm.logprobs import Logprob

    position = {
        7: Logprob(logprob=-2.5, rank=3, decoded_token=None),  # sampled, outside the top 2
        4: Logprob(logprob=-0.1, rank=1, decoded_token=None),
        5: Logprob(logprob=float("-inf"), rank=2, decoded_token=None),
    }
    frames = _builder(logprobs=2)
    [frame] = frames.frames(_output([], False, outputs=[_completion(0, [7], logprobs=[position])]))
    assert frame["log_probs"] == [-2.5]
    assert frame["top_logprobs"] == [
        [
            {"rank": 1, "token_id": 4, "token": None, "logprob": -0.1},
            {"rank": 2, "token_id": 5, "token": None, "logprob": -9999.0},
        ]
    ]
    # logprobs=0 (chat's logprobs without top_logprobs): the sampled token's logprob only.
    [frame] = _builder(logprobs=0).frames(
        _output([], False, outputs=[_completion(0, [7], logprobs=[position])])
    )
    assert frame["log_probs"] == [-2.5] and frame["top_logprobs"] == [[]]
    # Not asked for: nothing added.
    assert "log_probs" not in _builder().frames(_output([7], False))[0]


def test_prompt_logprobs_ride_on_the_last_frame() -> None:
    from vllm.logprobs import Logprob

    prompt = [None, {2: Logprob(logprob=-1.5, rank=1, decoded_token=None)}, {3: Logprob(-0.5, 4, None)}]
    frames = _builder(prompt_logprobs=1)
    assert "engine_data" not in frames.frames(_output([5], False, prompt_logprobs=prompt))[0]
    [last] = frames.frames(_output([6], True, "length"))
    assert last["engine_data"] == {
        "prompt_logprobs": [None, {"2": {"logprob": -1.5, "rank": 1}}, {"3": {"logprob": -0.5, "rank": 4}}]
    }


def test_prefill_frame_carries_disaggregated_params() -> None:
    kv = {"do_remote_prefill": True, "remote_block_ids": [0]}
    frame = _builder(prefill=True).frames(_output([9], True, "length", kv))[0]
    assert frame["disaggregated_params"] == {"kv_transfer_params": kv}
    assert _builder(prefill=True).frames(_output([9], True, "length"))[0]["disaggregated_params"] is None


# ---- drain -------------------------------------------------------------------------------------


async def test_drain_unregisters_first_then_waits_for_inflight() -> None:
    tracker = InflightTracker()
    events: list[str] = []

    async def request(rid: str, seconds: float) -> None:
        with tracker.track(rid) as tracked:
            await asyncio.sleep(seconds)
            events.append(f"done {rid}")
            tracked.outcome = Outcome.COMPLETED

    async def unregister() -> None:
        events.append("unregistered")

    async def abort(rid: str) -> None:
        events.append(f"abort {rid}")

    task = asyncio.create_task(request("a", 0.3))
    await asyncio.sleep(0.05)
    report = await drain(tracker, unregister, abort, grace_s=5)
    await task
    assert events == ["unregistered", "done a"]
    assert not tracker.accepting
    assert report.inflight_at_start == 1 and report.aborted == 0 and report.completed == 1
    assert report.exit_code == ExitCode.OK
    assert report.waited_s >= 0.2
    assert "1 completed, aborted 0" in report.summary()


async def test_a_request_routed_just_before_the_unregister_took_effect_is_served() -> None:
    """The frontend routes here until it has seen the unregister: such a request is served (settle_s), one
    arriving after the settle period is refused (the frontend migrates it, --migration-limit)."""
    tracker = InflightTracker()
    served: list[str] = []

    async def request(rid: str) -> None:
        assert tracker.accepting, f"{rid} refused"
        with tracker.track(rid) as tracked:
            await asyncio.sleep(0.1)
            served.append(rid)
            tracked.outcome = Outcome.COMPLETED

    async def unregister() -> None:
        asyncio.get_running_loop().call_later(0.05, lambda: asyncio.ensure_future(request("late")))

    async def abort(rid: str) -> None:
        raise AssertionError(rid)

    report = await drain(tracker, unregister, abort, grace_s=5, settle_s=0.3)
    assert served == ["late"] and report.completed == 1 and report.exit_code == ExitCode.OK
    assert not tracker.accepting


async def test_drain_cuts_what_outlives_the_grace_period_and_counts_it() -> None:
    tracker = InflightTracker()
    aborted: list[str] = []
    gate = asyncio.Event()

    async def request(rid: str) -> None:
        with tracker.track(rid) as tracked:
            await gate.wait()
            # What the handler does: a request the drain cut is handed back, not finished.
            tracked.outcome = Outcome.HANDED_BACK if tracker.was_cut(rid) else Outcome.COMPLETED

    async def abort(rid: str) -> None:
        aborted.append(rid)
        gate.set()  # what vLLM's abort does: the request's stream ends

    async def unregister() -> None:
        raise RuntimeError("discovery down")  # must not stop the drain

    tasks = [asyncio.create_task(request(rid)) for rid in ("slow-1", "slow-2")]
    await asyncio.sleep(0.01)
    start = time.monotonic()
    report = await drain(tracker, unregister, abort, grace_s=0.2)
    await asyncio.gather(*tasks)
    assert aborted == ["slow-1", "slow-2"]
    assert (report.aborted, report.handed_back, report.completed) == (2, 2, 0)
    assert "aborted 2 (2 at the grace period" in report.summary()
    assert report.exit_code == ExitCode.DRAIN_TIMEOUT
    assert time.monotonic() - start < 2


async def test_requests_that_fail_during_the_drain_count_as_aborted() -> None:
    """A scale-down whose requests were cut by something else (the engine stopped under them) logged
    "aborted 0": every request that ended without its whole answer counts, however it was cut."""
    tracker = InflightTracker()

    async def request(rid: str, seconds: float, outcome: Outcome | None) -> None:
        with tracker.track(rid) as tracked:
            await asyncio.sleep(seconds)
            if outcome is not None:
                tracked.outcome = outcome

    async def nothing() -> None:
        return None

    async def abort(rid: str) -> None:
        raise AssertionError("nothing outlives the grace period here")

    tasks = [
        asyncio.create_task(request("failed", 0.05, None)),  # an engine error: no outcome set
        asyncio.create_task(request("done", 0.05, Outcome.COMPLETED)),
        asyncio.create_task(request("gone", 0.05, Outcome.CANCELLED)),
    ]
    await asyncio.sleep(0.01)
    report = await drain(tracker, nothing, abort, grace_s=5)
    await asyncio.gather(*tasks)
    assert (report.aborted, report.completed, report.cancelled, report.handed_back) == (1, 1, 1, 0)
    assert report.exit_code == ExitCode.DRAIN_TIMEOUT


def _write_held(path: Path, pinned: int) -> None:
    path.write_text(json.dumps({"published": 1, "time": time.time(), "kv_pinned_requests": pinned}))


async def test_a_prefill_drain_waits_for_the_kv_it_holds_for_decode_workers(tmp_path: Path) -> None:
    """Upstream issue 4917: stopping a prefill engine under KV a decode worker has yet to read fails that
    request. The drain waits (bounded) until the engine holds none, and counts what it gives up."""
    from dynamo.vllm.drain import held_kv_reader

    template = str(tmp_path / "fpm-stats-{dp_rank}.json")
    rank0, rank1 = tmp_path / "fpm-stats-0.json", tmp_path / "fpm-stats-1.json"
    _write_held(rank0, 2)
    _write_held(rank1, 0)

    async def nothing() -> None:
        return None

    async def abort(rid: str) -> None:
        raise AssertionError("nothing in flight")

    async def decode_reads(after_s: float) -> None:  # the publisher rewrites its file about once a second
        await asyncio.sleep(after_s)
        _write_held(rank1, 0)
        _write_held(rank0, 0)

    reader = held_kv_reader(template)
    task = asyncio.create_task(decode_reads(0.4))
    report = await drain(InflightTracker(), nothing, abort, grace_s=5, held_kv=reader)
    await task
    assert report.kv_given_up == 0 and 0.3 <= report.kv_waited_s < 3, report
    assert report.exit_code == ExitCode.OK
    assert "0 KV hand-off(s) given up" in report.summary()
    # A decode worker that never reads: bounded by the grace period (at least one fresh figure), then counted.
    task = asyncio.create_task(decode_reads_never(rank0, rank1))
    start = time.monotonic()
    report = await drain(InflightTracker(), nothing, abort, grace_s=0.5, held_kv=reader)
    task.cancel()
    assert report.kv_given_up == 3, report
    assert time.monotonic() - start < 4
    assert report.exit_code == ExitCode.DRAIN_TIMEOUT


async def decode_reads_never(rank0: Path, rank1: Path) -> None:
    while True:
        _write_held(rank0, 2)
        _write_held(rank1, 1)
        await asyncio.sleep(0.2)


async def test_stale_or_missing_figures_are_not_taken_for_released_kv(tmp_path: Path) -> None:
    from dynamo.vllm.drain import held_kv_reader

    reader = held_kv_reader(str(tmp_path / "fpm-stats-{dp_rank}.json"))
    assert reader(0.0) is None  # no file yet
    path = tmp_path / "fpm-stats-0.json"
    path.write_text(json.dumps({"time": time.time() - 10, "kv_pinned_requests": 0}))
    assert reader(time.time()) is None  # written before the drain began: it says nothing of now
    path.write_text(json.dumps({"time": time.time() + 1}))
    assert reader(time.time()) == 0  # an engine that never held any: no field


# ---- metrics -----------------------------------------------------------------------------------


def test_publisher_stats_files_become_prometheus_metrics(tmp_path: Path) -> None:
    template = str(tmp_path / "fpm-stats-{dp_rank}.json")
    for rank, published in ((0, 10), (1, 20)):
        Path(template.format(dp_rank=rank)).write_text(
            json.dumps(
                {
                    "published": published,
                    "dropped": 1,
                    "heartbeats": 3,
                    "reconnects": 2,
                    "queued": 4,
                    "connected": True,
                    "last_error": None,
                    "time": time.time(),
                }
            )
        )
    (tmp_path / "fpm-stats-0.json.tmp99").write_text("{partial")
    assert sorted(read_stats(template)) == [0, 1]
    metrics = WorkerMetrics(WorkerCollector(template, lambda: 2, lambda: True, {"worker_id": "7"}))
    text = metrics.expfmt()
    assert 'dynamo_worker_fpm_published_total{dp_rank="1",worker_id="7"} 20.0' in text
    assert 'dynamo_worker_fpm_reconnects_total{dp_rank="0",worker_id="7"} 2.0' in text
    assert 'dynamo_worker_fpm_connected{dp_rank="0",worker_id="7"} 1.0' in text
    assert 'dynamo_worker_inflight_requests{worker_id="7"} 2.0' in text
    assert 'dynamo_worker_ready{worker_id="7"} 1.0' in text


def test_metrics_without_fpm_and_served_over_http(tmp_path: Path) -> None:
    import urllib.request

    metrics = WorkerMetrics(WorkerCollector(None, lambda: 0, lambda: False, {"worker_id": "7"}))
    port = metrics.serve(0, host="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        metrics.close()
    assert 'dynamo_worker_ready{worker_id="7"} 0.0' in text
    assert "dynamo_worker_fpm_published_total{" not in text


# ---- frontend flags ----------------------------------------------------------------------------


def test_frontend_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from dynamo.frontend import main as fe

    monkeypatch.delenv("NATS_SERVER", raising=False)
    monkeypatch.setenv("DYN_HTTP_PORT", "9001")
    args = fe.parse_args(["--namespace", "ns", "--router-mode", "kv"])
    assert (args.http_host, args.http_port, args.router_mode, args.event_plane) == (
        "0.0.0.0",
        9001,
        "kv",
        "zmq",
    )
    assert fe.entrypoint_kwargs(args) == {
        "http_host": "0.0.0.0",
        "http_port": 9001,
        "migration_limit": 0,
        "namespace": "ns",
    }
    from dynamo.llm import RouterMode

    assert all(hasattr(RouterMode, v) for v in fe.ROUTER_MODES.values())
    with pytest.raises(SystemExit) as exc:
        fe.parse_args(["--router-mode", "nope"])
    assert exc.value.code == 2


def test_frontend_defaults_the_backend_stream_timeout() -> None:
    from dynamo.frontend import main as fe

    env: dict[str, str] = {}
    assert fe.default_stream_timeout(env) == "300" and env == {fe.STREAM_TIMEOUT_ENV: "300"}
    for given in ("0", "45"):  # an operator's value is kept, 0 (no bound) included
        env = {fe.STREAM_TIMEOUT_ENV: given}
        assert fe.default_stream_timeout(env) == given and env == {fe.STREAM_TIMEOUT_ENV: given}
    env = {fe.STREAM_TIMEOUT_ENV: ""}
    assert fe.default_stream_timeout(env) == "300"


def test_standby_options_are_read_before_argparse(tmp_path: Path) -> None:
    from dynamo.common import worker_state as ws
    from dynamo.vllm.standby import StandbyControl, early_options

    assert early_options([], {}) == (False, None)
    assert early_options(["--model", "m", "--standby", "--state-file", "s.json"], {}) == (True, "s.json")
    assert early_options(["--state-file=x.json"], {"DYN_VLLM_STANDBY": "1"}) == (True, "x.json")
    assert early_options(["--no-standby"], {"DYN_VLLM_STANDBY": "yes", "DYN_WORKER_STATE_FILE": "e"}) == (
        False,
        "e",
    )
    with pytest.raises(ValueError, match="DYN_VLLM_STANDBY"):
        early_options([], {"DYN_VLLM_STANDBY": "maybe"})
    path = tmp_path / "state.json"
    control = StandbyControl(True, str(path))
    control.write(ws.STANDBY)
    read = ws.read_state(path)
    assert read is not None and read.state == "standby"
    control.gate_file = tmp_path / "registered"
    control.open_gate()
    assert control.gate_file.exists()
    control.close_gate()
    control.close_gate()  # twice is fine
    assert not control.gate_file.exists()


# ---- registration capacity ---------------------------------------------------------------------


@dataclasses.dataclass
class _EngineConfig:
    """The parts of vLLM's config the worker reads capacity from (real vLLM sub-configs)."""

    model_config: Any
    cache_config: Any
    scheduler_config: Any
    parallel_config: Any


def _engine_config(blocks: int, **parallel: Any) -> _EngineConfig:
    from vllm.config import CacheConfig, ParallelConfig, SchedulerConfig

    cache = CacheConfig(block_size=32)
    cache.num_gpu_blocks = blocks  # what vLLM's engine client leaves there: the sum over its engines
    sched = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=2048, is_encoder_decoder=False
    )
    return _EngineConfig(types.SimpleNamespace(max_model_len=2048), cache, sched, ParallelConfig(**parallel))


@pytest.mark.parametrize(
    ("parallel", "engines"),
    [
        ({}, 1),
        ({"data_parallel_size": 4}, 4),  # internal load balancing: the client manages every rank
        ({"data_parallel_size": 4, "data_parallel_size_local": 2, "data_parallel_hybrid_lb": True}, 2),
        ({"data_parallel_size": 4, "data_parallel_rank_local": 1}, 1),  # offline: one engine per client
    ],
)
def test_data_parallel_workers_register_one_engines_kv_capacity(
    parallel: dict[str, Any], engines: int
) -> None:
    """vLLM sums the engines' block counts; the model card must carry one engine's (the planner
    multiplies)."""
    from dynamo.vllm.registration import runtime_config

    config = _engine_config(1000 * engines, **parallel)
    assert eng.summed_engines(config.parallel_config) == engines
    capacity = eng.engine_capacity(config, eng.summed_engines(config.parallel_config))
    card = runtime_config(capacity)
    assert card.total_kv_blocks == 1000
    assert card.data_parallel_size == parallel.get("data_parallel_size", 1)


def test_the_engine_clients_own_rank_list_wins() -> None:
    config = _engine_config(3001, data_parallel_size=4)
    client = types.SimpleNamespace(engine_core=types.SimpleNamespace(engine_ranks_managed=[0, 1, 2]))
    assert eng.summed_engines(config.parallel_config, client) == 3
    assert eng.engine_capacity(config, 3).total_kv_blocks == 1000  # floored: never more than an engine has


# ---- engine hooks ------------------------------------------------------------------------------


def test_engine_hooks_act_only_in_a_workers_engine_processes() -> None:
    from dynamo.vllm import engine_hooks as hooks

    assert not hooks.is_engine_process({}, 10)  # vLLM run by anything else
    assert not hooks.is_engine_process({hooks.WORKER_PID_ENV: "10"}, 10)  # the worker itself
    assert hooks.is_engine_process({hooks.WORKER_PID_ENV: "10"}, 11)


def test_a_worker_that_is_pid_1_owns_its_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    """A container's (or PID namespace's) PID 1 is compared with the owner before the walk stops there."""
    from dynamo.vllm import engine_hooks as hooks

    parents = {30: 20, 20: 1, 1: 0}
    monkeypatch.setattr(hooks, "_parent_of", parents.get)
    assert hooks.below(1, 1)  # the worker is PID 1 and the engine's parent
    assert hooks.below(30, 1)  # a model-runner below EngineCore below the PID-1 worker
    assert hooks.below(30, 20)
    assert not hooks.below(1, 20)  # reparented to init: the worker is gone
    assert not hooks.below(30, 99)


def test_eager_logprob_ranks_count_what_vllm_counts() -> None:
    import torch
    from dynamo.vllm.cpu_host import logprob_ranks
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs

    x = torch.tensor([[0.1, 0.5, 0.3, 0.3], [1.0, -1.0, 0.0, 2.0]])
    values = torch.tensor([[0.3], [0.0]])
    originals = (logprobs.batched_count_greater_than, sampler.batched_count_greater_than)
    try:
        assert logprob_ranks.eager_logprob_ranks()
        assert sampler.batched_count_greater_than is logprobs.batched_count_greater_than
        assert sampler.batched_count_greater_than(x, values).tolist() == [3, 3]
    finally:
        logprobs.batched_count_greater_than, sampler.batched_count_greater_than = originals


_ORPHAN_SCRIPT = """
import os, subprocess, sys, time
from dynamo.vllm import engine_hooks
if sys.argv[1] == "parent":
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], "child"], env={
        **os.environ, engine_hooks.WORKER_PID_ENV: str(os.getpid())})
    print(child.pid, flush=True)
    time.sleep(60)
else:
    engine_hooks.register()  # what vLLM does in each engine process
    time.sleep(60)
"""


def test_an_engine_process_ends_when_its_worker_is_killed() -> None:
    """The plugin's parent-death tie, on real processes: SIGKILL the parent, its child is gone at once."""
    import signal
    import subprocess
    import sys

    parent = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_SCRIPT, "parent", _ORPHAN_SCRIPT], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        time.sleep(1.0)  # the child has registered its tie (importing the module takes well under that)
        assert Path(f"/proc/{child}").exists()
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and Path(f"/proc/{child}").exists():
            time.sleep(0.05)
        assert not Path(f"/proc/{child}").exists(), "the child outlived its parent"
    finally:
        parent.kill()
        parent.wait(10)


def test_an_engine_process_whose_worker_is_already_gone_ends_at_once() -> None:
    """The race the kernel's tie cannot cover: the worker died before the engine process set the tie."""
    import os
    import subprocess
    import sys

    from dynamo.vllm import engine_hooks

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    env = {**os.environ, engine_hooks.WORKER_PID_ENV: str(gone.pid)}
    child = subprocess.run(
        [sys.executable, "-c", _ORPHAN_SCRIPT, "child"],
        env=env,
        timeout=30,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.returncode == 1
    assert f"is not worker pid {gone.pid}" in child.stderr, child.stderr  # says why, in one line


def test_an_engine_process_below_a_pid_1_worker_stays(tmp_path: Path) -> None:
    """The worker as PID 1 of its own PID namespace (as in a container): its engine process keeps running."""
    import shutil
    import subprocess
    import sys

    unshare = shutil.which("unshare")
    assert unshare is not None, "unshare (util-linux) is needed for this test"
    script = tmp_path / "pid1.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "from dynamo.vllm import engine_hooks\n"
        "assert os.getpid() == 1, os.getpid()\n"
        "child = subprocess.Popen([sys.executable, '-c', 'from dynamo.vllm import engine_hooks; "
        'engine_hooks.register(); import time; time.sleep(2); print("engine alive", flush=True)\'],'
        " env={**os.environ, engine_hooks.WORKER_PID_ENV: str(os.getpid())})\n"
        "sys.exit(child.wait(30))\n"
    )
    run = subprocess.run(
        [unshare, "--pid", "--fork", "--mount-proc", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert "engine alive" in run.stdout
