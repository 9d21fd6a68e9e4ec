"""Ask a vision-language model (Qwen2.5-VL, Qwen3-VL) about an image:

    python examples/image_chat.py /path/to/Qwen2.5-VL-3B-Instruct cat.jpg "What is in this picture?"

The image goes in an OpenAI-style message, as a data URL, through LLM.chat: the checkpoint's own
image processor cuts it into patches, the vision tower encodes them, and the chat template puts the
image's placeholder where the content part stands (features/multimodal.py)."""
import argparse
import base64
import mimetypes

from nanovllm import LLM, SamplingParams


def data_url(path: str) -> str:
    kind = mimetypes.guess_type(path)[0] or "image/png"
    with open(path, "rb") as f:
        return f"data:{kind};base64," + base64.b64encode(f.read()).decode()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("image")
    parser.add_argument("question", nargs="?", default="Describe this image.")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(args.image)}},
                                             {"type": "text", "text": args.question}]}]
    with LLM(args.model) as llm:
        out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)
    print(out["text"])


if __name__ == "__main__":
    main()
