"""`python -m bench loglik`: the harness-like prompt logprobs workload, cached and not."""

from __future__ import annotations

from bench.loglik import main


def test_the_cached_arm_prefills_the_context_once_and_each_question_once(capsys) -> None:
    # 2 questions x 2 choices of 32 + 24 + 6 = 62 tokens (3 whole blocks of 16). Cached: the
    # first request all 62; the first choice of the other question its 30 after the context;
    # the second choice of each 14 after the context and its question's first block
    argv = ["--questions", "2", "--choices", "2", "--context", "32", "--device", "cpu"]
    assert main(argv) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert rows["cached"][2:] == ["248", str(62 + 30 + 14 + 14)]
    assert rows["no-cache"][2:] == ["248", "248"]
    assert float(rows["speedup"][-1]) <= 2e-4  # the worst logprob difference: the contract's
