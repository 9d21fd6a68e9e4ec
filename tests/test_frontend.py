"""engine/frontend.py: the request side of the engine stands alone, on a Config with no model
loaded (what a front of data-parallel replicas holds), and checks and encodes as the engine does."""
import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.engine.frontend import Frontend, PromptTooLong
from nanovllm.utils.tiny_model import build_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(str(tmp_path_factory.mktemp("frontend")), chat_template=True)


def test_a_frontend_encodes_and_checks_as_the_engine_does_with_no_model(model):
    front = Frontend(Config.from_options(model, {"max_model_len": 64}))
    assert not hasattr(front, "model_runner") and not hasattr(front, "scheduler")  # (no weights, no KV cache)
    with LLM(model, max_model_len=64) as llm:
        for prompt in ("The quick brown fox", [5, 17, 99]):
            assert front.encode_prompt(prompt) == llm.encode_prompt(prompt)
        messages = [{"role": "user", "content": "hi"}]
        assert front.render_chat(messages) == llm.render_chat(messages)
        assert front.eos_token_ids == llm.eos_token_ids
    with pytest.raises(PromptTooLong):
        front.encode_prompt([1] * 64)
    with pytest.raises(ValueError, match="exceeds max_model_len=64"):
        front.check_request(60, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        front.check_request(4, SamplingParams(max_tokens=4, stop_token_ids=[10**6]))
    with pytest.raises(TypeError, match="must be a SamplingParams"):
        front.check_request(4, {"max_tokens": 1})
