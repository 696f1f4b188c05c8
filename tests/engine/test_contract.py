"""The output contract check: what it accepts and what it refuses."""

from __future__ import annotations

from engine_helpers import micro_model

from engine.contract import count_meeting_contract, greedy_matches_reference
from engine.loop.sequential import reference_generate


def test_the_reference_output_meets_the_contract_and_a_changed_token_does_not() -> None:
    model, prompt = micro_model(), list(range(40))
    output, _ = reference_generate(model, prompt, 4)
    assert greedy_matches_reference(model, prompt, output)
    wrong = [*output[:2], (output[2] + 1) % 256, output[3]]
    assert not greedy_matches_reference(model, prompt, wrong)


def test_empty_prompts_and_outputs_never_meet_it() -> None:
    model = micro_model()
    assert not greedy_matches_reference(model, list(range(8)), [])
    assert not greedy_matches_reference(model, [], [1])


def test_counting_with_a_length_refuses_outputs_cut_short() -> None:
    model, prompts = micro_model(), [list(range(40)), list(range(50))]
    outputs = [reference_generate(model, p, 4)[0] for p in prompts]
    assert count_meeting_contract(model, prompts, outputs, 4) == 2
    assert count_meeting_contract(model, prompts, [outputs[0], outputs[1][:3]], 4) == 1
    assert count_meeting_contract(model, prompts, [outputs[0], outputs[1][:3]]) == 2
