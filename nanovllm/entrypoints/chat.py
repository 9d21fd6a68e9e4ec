"""`nanovllm chat MODEL`: an interactive chat in the terminal, with the engine in this process.

Each turn renders the whole conversation with the chat template and streams the reply. The conversation
so far is the new prompt's prefix, served from the prefix cache: the line after each reply says how much.
"""
import dataclasses
import sys

from nanovllm.entrypoints.args import llm_from_args
from nanovllm.sampling_params import SamplingParams

HELP = "/reset clears the conversation, /exit or Ctrl-D leaves, Ctrl-C stops a reply"


def chat(args) -> int:
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed)
    llm = llm_from_args(args)
    with llm:
        if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
            print(f"nanovllm chat: the model {args.model!r} has no chat template", file=sys.stderr)
            return 2
        opening = [{"role": "system", "content": args.system}] if args.system else []
        messages = list(opening)
        print(f"nanovllm chat with {args.model} ({HELP})", flush=True)
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            command = line.strip()
            if not command:
                continue
            if command == "/exit":
                return 0
            if command == "/reset":
                messages = list(opening)
                print("(conversation cleared)", flush=True)
                continue
            messages.append({"role": "user", "content": line})
            ids = llm.render_chat(messages)
            room = llm.config.max_model_len - len(ids)
            if room < 1:
                messages.pop()
                print(f"(the conversation fills max_model_len={llm.config.max_model_len}: /reset to start over)",
                      flush=True)
                continue
            reply, num_tokens, final = [], 0, None
            stream = llm.stream([ids], dataclasses.replace(params, max_tokens=min(params.max_tokens, room)))
            try:
                for update in stream:
                    if update["text"]:
                        print(update["text"], end="", flush=True)
                        reply.append(update["text"])
                    num_tokens += len(update["token_ids"])
                    if update["finished"]:
                        final = update
            except KeyboardInterrupt:
                stream.close()  # aborts the reply
                print("\n(stopped)", end="")
            messages.append({"role": "assistant", "content": "".join(reply)})
            cached = final["num_cached_tokens"] if final is not None else "?"
            reason = final["finish_reason"] if final is not None else "abort"
            print(f"\n[{len(ids)} prompt tokens, {cached} cached, {num_tokens} generated, {reason}]",
                  flush=True)

