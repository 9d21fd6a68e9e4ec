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


def test_a_request_exactly_at_each_limit_is_taken_and_one_past_it_refused(model):
    """max_model_len 64: a prompt of 54 tokens with max_tokens 10 fills it exactly (and runs to its 10
    tokens), 55 is refused; 63 token ids are a prompt, 64 are not. The vocabulary's last id is taken
    wherever a token id goes, and top_k, logprobs and prompt_logprobs may be the vocabulary's size;
    one more is refused, each."""
    front = Frontend(Config.from_options(model, {"max_model_len": 64}))
    vocab = front.config.hf_config.vocab_size
    front.check_request(54, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="prompt of 55 tokens plus max_tokens=10 exceeds max_model_len=64"):
        front.check_request(55, SamplingParams(max_tokens=10))
    with LLM(model, max_model_len=64) as llm:
        [out] = llm.generate([[7] * 54], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert len(out["token_ids"]) == 10 and out["finish_reason"] == "length"
    assert front.encode_prompt([1] * 63) == [1] * 63
    assert front.encode_prompt([0, vocab - 1]) == [0, vocab - 1]
    with pytest.raises(ValueError, match=f"token id {vocab} is outside the vocabulary"):
        front.encode_prompt([0, vocab])
    last = vocab - 1
    front.check_request(4, SamplingParams(max_tokens=4, top_k=vocab, logprobs=vocab, prompt_logprobs=vocab,
                                          stop_token_ids=[last], logit_bias={last: 1.0}, allowed_token_ids=[last]))
    for name, past in (("top_k", vocab + 1), ("logprobs", vocab + 1), ("prompt_logprobs", vocab + 1),
                       ("stop_token_ids", [vocab]), ("logit_bias", {vocab: 1.0}), ("allowed_token_ids", [vocab])):
        with pytest.raises(ValueError, match=rf"SamplingParams\.{name}[ =]"):
            front.check_request(4, SamplingParams(max_tokens=4, **{name: past}))
