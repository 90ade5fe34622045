"""The HF service's request schema and the bounds of both services (mugrpo.serve.protocol)."""
import pytest

from mugrpo.serve.protocol import CompletionRequest, Limits, bound_problem, request_problem

pytestmark = pytest.mark.unit

LIMITS = Limits(max_n=8, max_seqs=20, max_model_len=32)


def test_a_single_prompt_or_a_list_of_prompts():
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    assert CompletionRequest(prompt=[[1]], stop="x").stops() == ("x",)


@pytest.mark.parametrize("request_fields, says", [
    (dict(prompt=[[1]], n=9), "n: 9 samples per prompt is above this service's limit of 8 (--max-n)"),
    (dict(prompt=[[1]] * 3, n=7), "3 prompts x n=7 = 21 sequences is above this service's limit of 20 per request"),
    (dict(prompt=[[1, 2]], max_tokens=31), "max_tokens: prompt 0 has 2 tokens; with 31 new tokens it passes the "
                                           "model's context of 32 tokens (max_model_len); at most 30"),
    (dict(prompt=[[1, 2], [3]], max_tokens=10, mugrpo={"max_tokens": [10, 11]}), "mugrpo.max_tokens: one limit per "
                                                                                 "prompt (2), each in 1..max_tokens"),
    (dict(prompt=[[1, 2]], max_tokens=40, mugrpo={"max_tokens": [31]}), "mugrpo.max_tokens[0]: prompt 0 has 2 tokens"),
    (dict(prompt=[[1, 50]]), "prompt: prompt 0 has token id 50; the model's ids are 0..49"),
    (dict(prompt=[[1]], stop=["a"], include_stop_str_in_output=False), "include_stop_str_in_output"),
])
def test_requests_past_a_bound_are_named(request_fields, says):
    assert says in request_problem(CompletionRequest(**request_fields), LIMITS, vocab_size=50)


def test_a_request_within_every_bound_passes():
    req = CompletionRequest(prompt=[[1, 2], [3]], n=8, max_tokens=30, mugrpo={"max_tokens": [30, 5]})
    assert request_problem(req, LIMITS, vocab_size=50) is None
    assert bound_problem(num_prompts=2, n=8, limits=LIMITS) is None
