"""Settings layering both processes share: flags > environment > TOML file > defaults.

Each process keeps its own flags, environment prefix (PAGODA_ for the scheduler,
PAGODA_WORKER_ for the worker) and value parsing; `resolve` layers the sources the same
way for both and records where every value came from, which `settings_lines` prints for
--print-config. Also the default endpoints, so both ends meet without a flag.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

DEFAULT_GRPC_ADDRESS = "127.0.0.1:50051"


def default_zmq_endpoint(environ: Mapping[str, str] | None = None) -> str:
    """A private ipc:// path: $XDG_RUNTIME_DIR/pagoda/worker.sock, else /tmp/pagoda-$UID/."""
    runtime_dir = (os.environ if environ is None else environ).get("XDG_RUNTIME_DIR")
    base = Path(runtime_dir) / "pagoda" if runtime_dir else Path(f"/tmp/pagoda-{os.getuid()}")
    return f"ipc://{base / 'worker.sock'}"


def insecure_tcp_problem(endpoint: str, *, curve: bool, allow_insecure_tcp: bool) -> str | None:
    """Why a worker link endpoint is refused (one sentence), or None.

    Over tcp:// without CurveZMQ anyone who can reach the port can pose as the worker
    (read every prompt, stream its own tokens) or as the scheduler; both processes refuse
    that unless the operator says so explicitly (then `insecure_tcp_warning` is logged).
    """
    if not endpoint.startswith("tcp://") or curve or allow_insecure_tcp:
        return None
    return (
        f"the worker link {endpoint} is tcp:// without CurveZMQ keys, which lets anyone who "
        "reaches the port read every prompt and inject tokens; set the CurveZMQ keys (see "
        "python -m pagoda.common.curve), use ipc://, or pass --zmq-allow-insecure-tcp"
    )


def insecure_tcp_warning(endpoint: str, *, curve: bool) -> str | None:
    """The warning line for an allowed plaintext tcp:// link, or None when there is none."""
    if not endpoint.startswith("tcp://") or curve:
        return None
    return (
        f"the worker link {endpoint} is tcp:// without CurveZMQ (--zmq-allow-insecure-tcp): "
        "it is neither encrypted nor authenticated"
    )


def split_host_port(address: str) -> tuple[str, int]:
    """("::1", 8000) from "[::1]:8000"; ("127.0.0.1", 8000) from "127.0.0.1:8000"."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host.removeprefix("[").removesuffix("]"), int(port)


def optional_str(text: str) -> str | None:
    """A setting that may be unset: "" or "none" (any case) is None."""
    return None if text.strip().lower() in ("", "none") else text


def add_config_flags(
    parser: argparse.ArgumentParser, environ: Mapping[str, str], env_prefix: str, example: str = ""
) -> None:
    """--config (also $<PREFIX>CONFIG) and --print-config, which load_flags reads."""
    parser.add_argument(
        "--config",
        default=environ.get(env_prefix + "CONFIG"),
        help=f"TOML file of settings, keys as the flags with underscores{example}; "
        f"also {env_prefix}CONFIG",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved settings and where each came from, then exit",
    )


class SettingError(ValueError):
    """A setting that cannot be read; the message is one sentence naming it and its source."""


@dataclass(frozen=True, slots=True)
class Resolved:
    values: dict[str, Any]  # setting name -> value, in the order of the defaults
    sources: dict[str, str]  # setting name -> "flag", "env PREFIX_NAME", "toml FILE", "default"


def resolve(
    defaults: Mapping[str, Any],
    *,
    flags: Mapping[str, Any],
    environ: Mapping[str, str],
    env_prefix: str,
    config_path: str | None,
    from_toml: Callable[[str, Any, str], Any],
    from_env: Callable[[str, str, str], Any],
) -> Resolved:
    """Layer the sources over `defaults`, whose keys are the settings.

    `flags`: the settings the command line gave, already parsed. `from_toml(name, value,
    path)` and `from_env(name, text, variable)` parse one value or raise SettingError.
    The file's keys are the settings' names; an unknown key is an error.
    """
    values = dict(defaults)
    sources = dict.fromkeys(values, "default")
    if config_path:
        try:
            table = tomllib.loads(Path(config_path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise SettingError(f"cannot read the config file {config_path}: {exc}") from None
        for key, value in table.items():
            if key not in values:
                raise SettingError(f"unknown key {key!r} in {config_path}")
            values[key] = from_toml(key, value, config_path)
            sources[key] = f"toml {config_path}"
    for name in values:
        variable = env_prefix + name.upper()
        if variable in environ:
            values[name] = from_env(name, environ[variable], variable)
            sources[name] = f"env {variable}"
    for name, value in flags.items():
        values[name] = value
        sources[name] = "flag"
    return Resolved(values, sources)


def settings_lines(values: Mapping[str, Any], sources: Mapping[str, str]) -> str:
    """`name = value  # source`, one line per setting, TOML-shaped so it can seed a file
    (an unset one is a comment). Both processes' --print-config use it."""
    lines = []
    for name, value in values.items():
        line = f"# {name} (unset)" if value is None else f"{name} = {_toml_literal(value)}"
        lines.append(line.ljust(48) + f"  # {sources[name]}")
    return "\n".join(lines)


def _toml_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


@dataclass(frozen=True, slots=True)
class LoadedConfig:
    """A service's validated config, where each setting came from, and --print-config."""

    config: Any  # the service's frozen config dataclass
    sources: dict[str, str]  # setting -> "flag", "env PREFIX_X", "toml FILE", "default"
    print_config: bool

    def describe(self) -> str:
        """One line per setting, `name = value  # source`, as every service prints them."""
        values = {f.name: getattr(self.config, f.name) for f in fields(self.config)}
        return settings_lines(values, self.sources)


def load_flags(
    build_parser: Callable[[Mapping[str, str]], argparse.ArgumentParser],
    config_class: type,
    env_prefix: str,
    argv: Sequence[str] | None,
    environ: Mapping[str, str] | None,
) -> LoadedConfig:
    """Flags > environment > TOML file (--config) > defaults into `config_class`, for a
    parser whose settings are the dataclass's fields (plus --config and --print-config); a
    bad value or an unknown TOML key exits 2 with a sentence (argparse's usage error)."""
    environ = os.environ if environ is None else environ
    names = {f.name for f in fields(config_class)}

    def settings_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
        return {a.dest: a for a in parser._actions if a.dest in names}

    parser = build_parser(environ)
    args = parser.parse_args(argv)
    settings = settings_of(parser)

    def parse(name: str, value: object, origin: str) -> object:
        action = settings[name]
        try:
            return action.type(str(value)) if action.type else str(value)
        except ValueError:
            raise SettingError(f"{origin}: {value!r} is not a valid value for {name}") from None

    # Which settings the command line itself gave: a parser whose defaults are all absent.
    explicit = build_parser(environ)
    for action in settings_of(explicit).values():
        action.default = argparse.SUPPRESS
    given = vars(explicit.parse_args(argv)).keys() & settings.keys()
    try:
        resolved = resolve(
            {name: action.default for name, action in settings.items()},
            flags={name: getattr(args, name) for name in given},
            environ=environ,
            env_prefix=env_prefix,
            config_path=args.config,
            from_toml=lambda name, value, path: parse(name, value, f"{name} in {path}"),
            from_env=parse,
        )
        config = config_class(**resolved.values)
    except ValueError as exc:  # SettingError, or the config's own checks
        parser.error(str(exc))
    return LoadedConfig(config, resolved.sources, args.print_config)
