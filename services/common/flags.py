"""Command-line flags made from the config dataclasses (services/common/config.py), and back.

    parser = argparse.ArgumentParser(prog="kvmesh worker")
    add_flags(parser, ModelConfig, "KVMESH_WORKER")          # --model, --dtype, ... (or $KVMESH_WORKER_MODEL, ...)
    args = parser.parse_args(argv)
    model = build(parser, ModelConfig, args)                 # validated; a bad value is a usage error
    to_argv(model)                                           # ["--model", "smollm2", "--dtype", "float32", ...]

A flag's default comes from the environment variable `{prefix}_{FIELD}` when it is set, else from the
field. `kvmesh serve` passes every field of a child's config as a flag (to_argv), so what a child
runs with never depends on variables in its environment.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, TypeVar

from services.common.config import flag_name

T = TypeVar("T")
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def parse_bool(text: str) -> bool:
    if str(text).lower() in TRUE:
        return True
    if str(text).lower() in FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _selected(config_class: type, only: Iterable[str] | None, exclude: Iterable[str]):
    names = {f.name for f in fields(config_class)}
    unknown = (set(only or ()) | set(exclude)) - names
    assert not unknown, f"{config_class.__name__} has no field {sorted(unknown)}"
    return [f for f in fields(config_class) if (only is None or f.name in only) and f.name not in exclude]


def _value_type(config_class: type, name: str) -> tuple[type, bool]:
    """The field's type without None, and whether it is a tuple (a repeatable flag)."""
    hint = typing.get_type_hints(config_class)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], True
    return hint, False


def add_flags(parser: argparse.ArgumentParser, config_class: type, env_prefix: str | None, *,
              only: Iterable[str] | None = None, exclude: Iterable[str] = (),
              defaults: Mapping[str, Any] | None = None) -> None:
    """A flag per field of `config_class` (or of those named by `only`, less `exclude`), in a group
    of its own. `defaults` replaces a field's default for this program (e.g. a service's port)."""
    group = parser.add_argument_group(config_class.__name__)
    selected = _selected(config_class, only, exclude)
    parser.__dict__.setdefault("kvmesh_configs", []).append((config_class, tuple(f.name for f in selected)))
    for f in selected:
        meta = f.metadata
        kind, repeated = _value_type(config_class, f.name)
        parse = meta.get("parse") or (str if kind is Path else kind)
        default = (defaults or {}).get(f.name, f.default)
        assert default is not MISSING, f"{config_class.__name__}.{f.name} needs a default"
        env = f"{env_prefix}_{f.name.upper()}" if env_prefix else None
        text = os.environ.get(env) if env else None
        notes = ([] if "(default" in meta["help"] else [f"default: {_show(default)}"]) + ([f"${env}"] if env else [])
        help_text = meta["help"] + (f" ({'; '.join(notes)})" if notes else "")
        kwargs: dict[str, Any] = {"dest": f.name, "help": help_text.replace("%", "%%")}
        if kind is bool:
            try:
                kwargs.update(action=argparse.BooleanOptionalAction,
                              default=default if text is None else parse_bool(text))
            except ValueError as exc:
                parser.error(f"${env}: {exc}")
        elif repeated:
            # The environment gives a comma-separated list; flags add to nothing (not to the default).
            kwargs.update(action="append", type=_checked(parse), default=None,
                          metavar=f.name.upper().rstrip("S"))
            if meta.get("nargs"):
                kwargs.update(action="extend", nargs=meta["nargs"])
            if text is not None:
                try:
                    default = tuple(parse(item.strip()) for item in text.split(",") if item.strip())
                except ValueError as exc:
                    parser.error(f"${env}: {exc}")
            parser.set_defaults(**{f"_default_{f.name}": tuple(default)})
        else:
            kwargs.update(type=_checked(parse), default=default if text is None else text,
                          metavar=f.name.upper())
            if meta.get("choices") is not None:
                kwargs["choices"] = meta["choices"]
        group.add_argument(flag_name(f), **kwargs)


def build(parser: argparse.ArgumentParser, config_class: type[T], args: argparse.Namespace, **values: Any) -> T:
    """`config_class` from the parsed flags (fields without a flag keep their default; `values`
    override); an invalid combination is a usage error (exit 2 with the message)."""
    kwargs = {}
    for f in fields(config_class):
        if f.name in values:
            kwargs[f.name] = values[f.name]
        elif hasattr(args, f.name):
            value = getattr(args, f.name)
            if value is None and hasattr(args, f"_default_{f.name}"):
                value = getattr(args, f"_default_{f.name}")
            if isinstance(value, list):
                value = tuple(value)
            elif isinstance(value, str) and _value_type(config_class, f.name)[0] is Path:
                value = Path(value)
            kwargs[f.name] = value
    try:
        return config_class(**kwargs)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # parser.error exits; for type checkers


def configs_of(parser: argparse.ArgumentParser) -> list[tuple[type, tuple[str, ...]]]:
    """The config classes `parser` has flags of (add_flags), each with the fields it took, in order."""
    return list(parser.__dict__.get("kvmesh_configs", ()))


def to_argv(config: object, *, only: Iterable[str] | None = None, exclude: Iterable[str] = ()) -> list[str]:
    """The flags that rebuild `config` (its selected fields) in a program made with add_flags.
    Fields that are None are left out: None is every optional field's default."""
    argv: list[str] = []
    for f in _selected(type(config), only, exclude):
        value = getattr(config, f.name)
        flag = flag_name(f)
        if value is None:
            assert f.default is None, f"{f.name}: None cannot be passed as a flag"
        elif isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, tuple):
            argv += [arg for item in value for arg in (flag, str(item))]
        else:
            argv += [flag, str(value)]
    return argv


def _checked(parse):
    """argparse reports a ValueError of `parse` as "invalid <name> value"; keep our message."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _show(default: Any) -> str:
    if default is None or default == ():
        return "none"
    return str(default)
