"""Packed (oneDNN) linears in engine steps: same answers as the dense kernels and the
no-cache reference, used in every step and nowhere else, and the model's work on the
engine's loop thread."""

from __future__ import annotations

import threading

import pytest
import torch
from engine_helpers import close_to_reference, micro_cache_config, micro_model, reference_logits

import engine.model.linear as linear_module
from engine.loop.engine import Engine
from engine.loop.request import EngineClosedError, SamplingParams
from engine.loop.threads import on_own_thread
from engine.model.linear import LinearConfig, LinearKernelError, PackedLinears, packed_mismatch
from engine.model.tiny import random_model, tiny_config

PROMPTS = [list(range(40, 63)), list(range(90, 101)), [7, 8, 9, 10, 11, 12, 13]]
PACKED = LinearConfig("onednn")  # `auto` keeps the micro model's small linears dense
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def linears_of(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def outputs(engine: Engine) -> list[list[int]]:
    futures = [engine.submit(p, GREEDY) for p in PROMPTS]
    return [f.result().output_token_ids for f in futures]


def test_auto_packs_a_model_of_large_linears_and_keeps_small_ones_dense():
    assert LinearConfig("auto").resolve(micro_model(seed=2).model) == "dense"
    tiny = random_model(tiny_config())
    assert LinearConfig("auto").resolve(tiny) == "onednn"
    assert LinearConfig("onednn").resolve(micro_model(seed=2).model) == "onednn"


def test_packed_linears_answer_as_the_dense_kernels_do():
    micro = micro_model(seed=3)
    with Engine(micro, micro_cache_config(), linear_config=LinearConfig("dense")) as dense:
        want = outputs(dense)
    with Engine(micro, micro_cache_config(), linear_config=PACKED) as packed:
        assert (dense.linear_kernel, packed.linear_kernel) == ("dense", "onednn")
        assert outputs(packed) == want
        assert outputs(packed) == want  # warm: every prompt's whole blocks cached


def test_prefill_logits_through_packed_linears_meet_the_no_cache_reference():
    micro = micro_model(seed=4)
    ids = list(range(30, 57))
    with Engine(micro, micro_cache_config(), linear_config=PACKED) as engine:
        cold, cold_cached = engine.prefill_logits(ids)
        warm, warm_cached = engine.prefill_logits(ids)
    ref = reference_logits(micro, ids)[-1]
    assert (cold_cached, warm_cached) == (0, 24)
    assert close_to_reference(cold, ref) and close_to_reference(warm, ref)


def test_every_linear_of_every_step_runs_packed():
    micro = micro_model(seed=5)
    per_forward = len(linears_of(micro.model))  # 2 layers x 7 projections + the output one
    assert per_forward == 15
    with Engine(micro, micro_cache_config(), linear_config=PACKED) as engine:
        linears = micro.model._kvstore_linears
        before = linears.calls
        engine.submit(PROMPTS[1], SamplingParams(max_new_tokens=5, ignore_eos=True)).result()
        # one request alone: its prefill (11 tokens, one step) and 4 decode steps
        assert linears.calls - before == 5 * per_forward


def test_outside_a_step_the_model_keeps_its_own_dense_linears():
    micro = micro_model(seed=6)
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        before = micro.model(input_ids=ids).logits
    with Engine(micro, micro_cache_config(), linear_config=PACKED) as engine:
        with torch.inference_mode():
            during = micro.model(input_ids=ids).logits
        calls = engine.model.model._kvstore_linears.calls
        assert torch.equal(before, during)  # bit for bit: not a packed product
        assert micro.model._kvstore_linears.calls == calls


def test_the_last_engine_to_close_gives_every_linear_its_own_forward_back():
    micro = micro_model(seed=7)
    first = Engine(micro, micro_cache_config(), linear_config=PACKED)
    second = Engine(micro, micro_cache_config(), linear_config=PACKED)
    assert micro.model._kvstore_linears.users == 2
    first.close()
    assert all("forward" in vars(m) for m in linears_of(micro.model))
    second.close()
    assert not hasattr(micro.model, "_kvstore_linears")
    assert not any("forward" in vars(m) for m in linears_of(micro.model))


def test_dense_asked_packs_nothing():
    micro = micro_model(seed=8)
    with Engine(micro, micro_cache_config(), linear_config=LinearConfig("dense")) as engine:
        assert engine.linear_kernel == "dense"
        assert not hasattr(micro.model, "_kvstore_linears")


def test_onednn_asked_of_a_float16_model_is_a_typed_error_naming_the_dtype():
    micro = micro_model(seed=9)
    micro.model.to(torch.float16)
    with pytest.raises(LinearKernelError, match="float16"):
        LinearConfig("onednn").resolve(micro.model)
    assert LinearConfig("auto").resolve(micro.model) == "dense"


def test_an_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="linear kernel must be one of"):
        LinearConfig("mkl")


def test_the_model_runs_on_the_engine_loop_thread_whoever_calls():
    micro = micro_model(seed=10)
    seen: set[str] = set()
    hook = micro.model.register_forward_pre_hook(
        lambda *_: seen.add(threading.current_thread().name)
    )
    try:
        # its self-test included
        with Engine(micro, micro_cache_config(), linear_config=PACKED) as engine:
            engine.prefill_logits(PROMPTS[0])
            engine.submit(PROMPTS[2], GREEDY).result()
            engine.run(PROMPTS[1], GREEDY)
    finally:
        hook.remove()
    assert seen == {"kvstore-engine"}


def test_a_call_on_a_closed_engine_is_refused():
    micro = micro_model(seed=11)
    engine = Engine(micro, micro_cache_config(), linear_config=PACKED)
    engine.close()
    with pytest.raises(Exception, match="closed"):
        engine.prefill_logits(PROMPTS[0])


def test_on_own_thread_returns_the_value_and_raises_the_error_here():
    assert on_own_thread(lambda a, b: (a + b, threading.current_thread().name), 2, 3) == (
        5,
        "kvstore-load",
    )
    with pytest.raises(KeyError, match="missing"):
        on_own_thread(lambda: {}["missing"])


def test_on_loop_runs_the_callers_forward_on_the_loop_thread_with_the_steps_kernels():
    micro = micro_model(seed=12)
    ids = torch.tensor([PROMPTS[0]])
    with Engine(micro, micro_cache_config(), linear_config=PACKED) as engine:
        linears = micro.model._kvstore_linears
        before = linears.calls

        def forward() -> tuple[str, torch.Tensor]:
            with torch.inference_mode():
                return threading.current_thread().name, micro.model(input_ids=ids).logits[0, -1]

        name, logits = engine.on_loop(forward)
        assert (name, linears.calls - before) == ("kvstore-engine", 15)
    assert close_to_reference(logits, reference_logits(micro, PROMPTS[0])[-1])


def test_the_check_passes_packed_products_and_catches_weights_that_differ():
    micro = micro_model(seed=13)
    linears = PackedLinears(micro.model)
    try:
        assert packed_mismatch(micro.model, linears) is None
        with torch.no_grad():  # the dense weights move, the packed copies do not
            linears.modules[0].weight.mul_(3.0)
        assert "packed linears move the logits by" in packed_mismatch(micro.model, linears)
    finally:
        linears.restore()


def test_packed_linears_that_fail_their_check_give_way_to_dense_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(linear_module, "packed_mismatch", lambda model, linears: "forced")
    micro = micro_model(seed=14)
    logs = caplog.at_level("WARNING", logger="kvstore.engine")
    with logs, Engine(micro, micro_cache_config(), linear_config=PACKED) as engine:
        assert (engine.linear_kernel, engine.mode) == ("dense", "paged")
        assert not hasattr(micro.model, "_kvstore_linears")
        got = engine.submit(PROMPTS[0], GREEDY).result().output_token_ids
    assert "forced; its linear layers run dense" in caplog.text
    with Engine(micro, micro_cache_config(), linear_config=LinearConfig("dense")) as dense:
        assert dense.submit(PROMPTS[0], GREEDY).result().output_token_ids == got


def test_a_failed_check_leaves_no_linear_patched(monkeypatch):
    def broken(model, linears):
        raise RuntimeError("oneDNN kernel failed")

    monkeypatch.setattr(linear_module, "packed_mismatch", broken)
    micro = micro_model(seed=15)
    with Engine(micro, micro_cache_config(), linear_config=PACKED) as engine:
        assert engine.linear_kernel == "dense"
        assert "oneDNN kernel failed" in engine.runner.linear_note
        assert not hasattr(micro.model, "_kvstore_linears")
        assert not any("forward" in vars(m) for m in linears_of(micro.model))


def test_steps_nest_and_a_linear_with_a_forward_of_its_own_is_left_alone():
    micro = micro_model(seed=16)
    hooked = linears_of(micro.model)[0]
    own = hooked.forward
    hooked.forward = own  # an instance forward, as accelerate's hooks set
    linears = PackedLinears(micro.model)
    try:
        assert hooked not in linears.modules and len(linears.modules) == 14
        with linears.step():
            with linears.step():
                pass
            assert linears.local.on  # the outer step goes on packed
        assert not linears.local.on
    finally:
        linears.restore()
    assert vars(hooked)["forward"] is own


def test_on_loop_carries_the_callers_inference_mode():
    micro = micro_model(seed=17)
    with Engine(micro, micro_cache_config(), linear_config=PACKED) as engine:
        with torch.inference_mode():
            assert engine.on_loop(torch.is_inference_mode_enabled)
        assert not engine.on_loop(torch.is_inference_mode_enabled)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_loop_that_died_refuses_calls_instead_of_leaving_them_waiting(monkeypatch):
    micro = micro_model(seed=18)
    engine = Engine(micro, micro_cache_config(), linear_config=PACKED)

    def die() -> None:
        raise SystemExit("the loop thread ends")

    monkeypatch.setattr(engine.stepper, "step", die)
    engine.submit(PROMPTS[0], GREEDY)
    engine._worker.join(timeout=30)
    assert not engine._worker.is_alive()
    with pytest.raises(EngineClosedError):
        engine.prefill_logits(PROMPTS[0])
    engine.close()


def test_the_per_request_path_runs_on_the_packed_kernels_too():
    micro = micro_model(seed=19)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    with Engine(micro, micro_cache_config(), linear_config=PACKED) as engine:
        linears = micro.model._kvstore_linears
        before = linears.calls
        ran = engine.run(PROMPTS[1], params).output_token_ids
        assert linears.calls - before == 3 * 15  # its prefill and 2 decode forwards
        assert engine.submit(PROMPTS[1], params).result().output_token_ids == ran
