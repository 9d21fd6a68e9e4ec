"""The engine's options as command-line flags: every keyword option of `LLM(...)` is a flag with
dashes (`--max-model-len 2048`, `--no-enable-prefix-caching`), read from LLM's own signature, so
the two never drift apart. A leaf module: the `nanovllm` command and each entry point import it."""
import argparse
import inspect
import types
import typing

from nanovllm.llm import LLM


def llm_options() -> list[tuple[str, object, type]]:
    """(name, default, type) of each keyword option of LLM(), from its signature."""
    options = []
    for name, p in inspect.signature(LLM.__init__).parameters.items():
        if p.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        kinds = typing.get_args(p.annotation) if isinstance(p.annotation, types.UnionType) else (p.annotation,)
        kind = next(k for k in (bool, int, float, dict, str) if k in kinds)
        options.append((name, p.default, kind))
    return options


def add_llm_arguments(parser: argparse.ArgumentParser):
    group = parser.add_argument_group("engine options (those of LLM(...))")
    for name, default, kind in llm_options():
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif kind is dict:  # as JSON text: `--speculative-config '{"method": "ngram", ...}'` (Config parses it)
            group.add_argument(flag, type=str, default=default, metavar="JSON", help=f"default: {default}")
        else:
            group.add_argument(flag, type=kind, default=default, metavar=kind.__name__.upper(),
                               help=f"default: {default}")


def llm_from_args(args: argparse.Namespace) -> LLM:
    """The engine the parsed flags describe (args.model and every LLM option)."""
    return LLM(args.model, **{name: getattr(args, name) for name, _, _ in llm_options()})
