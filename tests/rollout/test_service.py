"""The rollout service's answers to bad requests (400, naming what is wrong; the service stays up) and the
wire format's checks, with a real HF engine served in a thread."""
import json
import threading
import urllib.error
import urllib.request

import pytest

from mugrpo.config.rollout_sections import RolloutConfig
from mugrpo.models.loading import load_tokenizer
from mugrpo.rollout.engines import make_engine
from mugrpo.rollout.service import ServiceState, completions_from_json, make_server, tokenizer_fingerprint

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def url(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = make_engine("hf", tiny_model_dir, tokenizer, RolloutConfig(engine="hf", dtype="float32"))
    state = ServiceState(engine, {"engine": "hf", "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer)},
                         vocab_size=len(tokenizer))
    server = make_server(state, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield "http://%s:%d" % server.server_address[:2]
    server.shutdown()


def _post(url, path, body):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        return 200, json.loads(urllib.request.urlopen(urllib.request.Request(url + path, data=data)).read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("path, body, says", [
    ("/generate", {"prompts": []}, "non-empty list"),
    ("/generate", {"prompts": [[1, 2], [99999]]}, "token ids in 0.."),
    ("/generate", {"prompts": [[1, 2]], "sampling": {"n": 2, "beam": 3}}, "keys among"),
    ("/generate", {"prompts": [[1, 2]], "max_new_tokens": [1, 2]}, "one integer in 1..sampling.max_new_tokens"),
    ("/generate", b"{not json", "JSONDecodeError"),
    ("/load_weights", {"path": "/nonexistent/w.safetensors", "version": 1}, "no safetensors file"),
    ("/load_weights", {"path": "/tmp", "version": 0}, "version: an integer >= 1"),
])
def test_a_bad_request_is_a_400_naming_what_is_wrong(url, path, body, says):
    status, answer = _post(url, path, body)
    assert status == 400 and says in answer["error"]
    # ... and the service still answers.
    status, answer = _post(url, "/generate", {"prompts": [[5, 6]], "sampling": {"n": 2, "max_new_tokens": 3}})
    assert status == 200 and len(answer["completions"][0]) == 2 and answer["weights_version"] == 0


def test_an_unknown_path_is_a_404_listing_the_endpoints(url):
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(url + "/v1/completions")
    assert exc.value.code == 404 and "/info" in json.loads(exc.value.read())["error"]


@pytest.mark.unit
@pytest.mark.parametrize("data, says", [
    ([[{"token_ids": [1], "logprobs": [-0.5], "finish_reason": "stop"}]], "expected 2 groups"),
    ([[{"token_ids": [1], "logprobs": [-0.5], "finish_reason": "stop"}]] * 2, "expected 2 completions"),
    ([[{"token_ids": [1, 2], "logprobs": [-0.5], "finish_reason": "stop"}] * 2] * 2, "equal length"),
    ([[{"token_ids": [1.0], "logprobs": [-0.5], "finish_reason": "stop"}] * 2] * 2, "equal length (ints"),
    ([[{"token_ids": [1], "logprobs": [-0.5], "finish_reason": "eos"}] * 2] * 2, "finish_reason 'eos'"),
])
def test_an_answer_of_the_wrong_shape_is_named(data, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        completions_from_json(data, num_prompts=2, n=2)


@pytest.mark.unit
def test_a_well_formed_answer_round_trips():
    data = [[{"token_ids": [1, 2], "logprobs": [-0.5, -1.25], "finish_reason": "length"}]]
    [[c]] = completions_from_json(data, num_prompts=1, n=1)
    assert (c.token_ids, c.behavior_logprobs, c.finish_reason) == ([1, 2], [-0.5, -1.25], "length")


def test_info_says_how_long_ago_the_engine_made_progress_while_a_request_is_pending(tiny_model_dir):
    import time

    from mugrpo.rollout.service import sampling_to_json
    from mugrpo.rollout.engines import SamplingConfig

    tokenizer = load_tokenizer(tiny_model_dir)
    hf = make_engine("hf", tiny_model_dir, tokenizer, RolloutConfig(engine="hf", dtype="float32"))
    seen = []

    class Slow:  # the real engine behind a 0.3 s wait before its first step (a slow prefill)
        def generate(self, prompts, sampling, progress=None, **kwargs):
            def beat(k):
                seen.append(state.describe())  # before this step's beat: the seconds since the last one
                progress(k)
            time.sleep(0.3)
            return hf.generate(prompts, sampling, progress=beat, **kwargs)

    state = ServiceState(Slow(), {"engine": "slow"}, vocab_size=len(tokenizer))
    assert (state.describe()["pending"], state.describe()["since_progress_s"]) == (0, None)
    state.generate({"prompts": [[5, 6, 7]], "sampling": sampling_to_json(SamplingConfig(n=2, max_new_tokens=5))})
    assert len(seen) >= 5 and all(i["pending"] == 1 for i in seen)
    assert seen[0]["since_progress_s"] >= 0.3  # nothing since the request came in
    assert max(i["since_progress_s"] for i in seen[1:]) < 0.3  # each decode step beat
    assert (state.describe()["pending"], state.describe()["since_progress_s"]) == (0, None)
