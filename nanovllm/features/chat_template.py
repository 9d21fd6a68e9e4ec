"""Chat: messages rendered through the tokenizer's chat template (LLMEngine.render_chat; chat_prompt,
LLM.chat's and the server's, with the images of their content parts), and the
check of the template variables a request may set (chat_template_kwargs). Loaded at the first
chat request."""
import functools
import inspect

import jinja2
import jinja2.meta


@functools.lru_cache(maxsize=4)
def template_variables(template: str) -> frozenset[str]:
    """The variables a Jinja chat template reads (those it does not set itself)."""
    environment = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])  # (transformers' parser has it)
    return frozenset(jinja2.meta.find_undeclared_variables(environment.parse(template)))


def render_chat(tokenizer, model: str, messages: list[dict], tools: list[dict] | None,
                template_kwargs: dict | None) -> str:
    """Chat messages ({"role", "content"} dicts) as prompt text through the tokenizer's chat
    template, the assistant's turn opened; tools (OpenAI's definitions) go to the template too, and
    template_kwargs (vLLM's chat_template_kwargs, such as Qwen3's enable_thinking) are its variables."""
    check_template_kwargs(tokenizer, model, template_kwargs or {})
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                             **(template_kwargs or {}))
    except Exception as e:  # jinja2's TemplateError, or a template that raises on these messages
        raise ValueError(f"the chat template cannot render these messages: {e}") from e


def chat_prompt(frontend, messages: list[dict], tools: list[dict] | None = None,
                template_kwargs: dict | None = None, load_url=None):
    """A conversation as a prompt the engine takes: its token ids, or, when its content parts hold
    images (features/multimodal.py reads them; load_url, its image URLs), a dict prompt of the ids
    and the images."""
    images = []
    if has_images(messages):
        from nanovllm.features.multimodal import chat_images  # (image input's layer: loaded when a chat has images)
        messages, images = chat_images(frontend, messages, load_url)
    ids = frontend.render_chat(messages, tools, template_kwargs)
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids


def has_images(messages: list[dict]) -> bool:
    """Whether a message's content parts include an image (OpenAI's image_url, or an image given offline)."""
    return any(isinstance(m, dict) and isinstance(m.get("content"), list) and any(
        isinstance(p, dict) and p.get("type") in ("image_url", "image") for p in m["content"]) for m in messages)


def check_template_kwargs(tokenizer, model: str, template_kwargs: dict):
    """A ValueError unless the model has a chat template and each key is a variable it reads
    that nothing else sets (render_chat's own arguments, apply_chat_template's, the special
    tokens: a key such as `tokenize` would change what rendering returns)."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if not template or not isinstance(template, str):
        raise ValueError(f"the model {model!r} has no chat template (its tokenizer_config.json "
                         "names none): chat needs one; use completions instead")
    if not template_kwargs:
        return
    settable = template_variables(template) - set(inspect.signature(tokenizer.apply_chat_template).parameters)
    settable -= {"messages", *tokenizer.special_tokens_map}
    for key in template_kwargs:
        if key not in settable:
            raise ValueError(f"chat_template_kwargs has {key!r}, which is not a variable of this model's chat "
                             f"template that a request may set; those are: {sorted(settable) or 'none'}")
