"""Generate with nanovllm.

    python example.py [MODEL_FOLDER]

With a Hugging Face model folder, it chats with that model. Without one, it builds a tiny
random-weight Qwen3 in a temporary folder, so the whole pipeline runs anywhere, but its text is
random noise.
"""
import sys
import tempfile

from nanovllm import LLM, SamplingParams


def main():
    if len(sys.argv) > 1:
        path = sys.argv[1]
    else:
        from nanovllm.utils.tiny_model import build_model
        path = build_model(tempfile.mkdtemp(prefix="nanovllm-tiny-qwen3-"))
        print(f"No model folder given: built a tiny RANDOM-WEIGHT Qwen3 in {path}.\n"
              "Its output is random text; pass a real model folder to see real completions.\n")
    llm = LLM(path, max_model_len=1024)
    prompts = ["Introduce yourself.", "List all prime numbers within 100."]
    if llm.tokenizer is not None and llm.tokenizer.chat_template:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                     add_generation_prompt=True) for p in prompts]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.6, max_tokens=128))
    for prompt, out in zip(prompts, outputs):
        print(f"\nPrompt: {prompt!r}\nCompletion: {out['text']!r} ({out['finish_reason']})")


if __name__ == "__main__":
    main()
