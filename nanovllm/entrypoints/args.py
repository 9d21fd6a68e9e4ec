"""The engine's options as command-line flags: every keyword option of `LLM(...)` is a flag with
dashes (`--max-model-len 2048`, `--no-enable-prefix-caching`), read from Config's fields, so the
two never drift apart. A leaf module: the `nanovllm` command and each entry point import it."""
import argparse
import dataclasses
import types
import typing

from nanovllm.config import OPTIONS, Config
from nanovllm.llm import LLM


def llm_options() -> list[tuple[str, object, type]]:
    """(name, default, type) of each keyword option of LLM(): Config's fields (config.OPTIONS)."""
    options = []
    for f in dataclasses.fields(Config):
        if f.name in OPTIONS:
            kinds = typing.get_args(f.type) if isinstance(f.type, types.UnionType) else (f.type,)
            options.append((f.name, f.default, next(k for k in (bool, int, float, dict, str) if k in kinds)))
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


def options_from_args(args: argparse.Namespace) -> dict:
    """The LLM(...) options the parsed flags give (every one of them)."""
    return {name: getattr(args, name) for name, _, _ in llm_options()}


def llm_from_args(args: argparse.Namespace) -> LLM:
    """The engine the parsed flags describe (args.model and every LLM option)."""
    return LLM(args.model, **options_from_args(args))


def config_from_args(args: argparse.Namespace) -> Config:
    """The Config the parsed flags describe, without an engine (a headless node's)."""
    return Config.from_options(args.model, options_from_args(args))
