"""How a service's configuration is declared and read: sections of settings whose fields
double as CLI flags and environment variables.

A service's config (:class:`ServiceConfig`) is a frozen dataclass of sections; a section
(:class:`Section`) is a frozen dataclass of settings. Each setting has one flat name, unique
within its service: the section's ``prefix`` and the field's name (``redis`` + ``ca_file``
-> ``redis_ca_file``), unless the field names its own (``opt(flag=...)``). That name is the
flag (``--redis-ca-file``), the environment variable (``KVROUTE_REDIS_CA_FILE``) and the
keyword of :meth:`ServiceConfig.of`; the code reads ``cfg.redis.ca_file``. A flag beats the
environment, which beats the field default; ``--help`` lists the settings by section.

A section shared by several services means the same there (say, :class:`RedisSettings` for
the router, the endpoint picker and the agent); a setting that means something else on
another service has a name of its own there.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, get_type_hints

ENV_PREFIX = "KVROUTE_"
T = TypeVar("T", bound="ServiceConfig")


@dataclass(frozen=True)
class Range:
    """The values a numeric setting accepts: finite, ``low <= v`` (``low < v`` when
    ``exclusive``) and ``v <= high``. A section's fields declare theirs (:func:`opt`) and are
    checked when it is built, so a bad flag or environment value stops the service at start
    with its name, instead of a busy loop (a 0 s heartbeat), a worker that flaps (a NaN TTL)
    or a traceback deep in an engine; :meth:`parser` checks a CLI's own flags the same way."""

    low: float
    high: float = math.inf
    exclusive: bool = False

    def accepts(self, v: object) -> bool:
        return (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
                and (self.low < v if self.exclusive else self.low <= v) and v <= self.high)

    def wanted(self, integer: bool) -> str:
        """What it accepts, in words: ``an integer >= 1``, ``a finite number in [0, 1]``."""
        bound = (f"in {'(' if self.exclusive else '['}{self.low:g}, {self.high:g}]"
                 if self.high < math.inf else f"{'>' if self.exclusive else '>='} {self.low:g}")
        return f"{'an integer' if integer else 'a finite number'} {bound}"

    def check(self, name: str, v: float) -> None:
        """Exit naming setting ``name``'s flag and environment variable unless ``v`` is
        accepted."""
        if not self.accepts(v):
            raise SystemExit(f"{flag(name)} ({ENV_PREFIX}{name.upper()}) must be "
                             f"{self.wanted(isinstance(v, int))}, got {v!r}")

    def parser(self, kind: type[int] | type[float]) -> Callable[[str], Any]:
        """An argparse ``type`` reading a ``kind`` in this range: argparse then names the flag
        and what it wanted."""
        def parse(text: str) -> int | float:
            try:
                v = kind(text)
            except ValueError:
                v = None
            if not self.accepts(v):
                raise argparse.ArgumentTypeError(
                    f"expected {self.wanted(kind is int)}, got {text!r}")
            return v  # type: ignore[return-value]

        return parse

    def list_parser(self, kind: type[int] | type[float]) -> Callable[[str], list[Any]]:
        """An argparse ``type`` reading ``16,128``: a non-empty comma-separated list of
        ``kind``, each in this range."""
        one = self.parser(kind)

        def parse(text: str) -> list[Any]:
            parts = [x for x in text.split(",") if x.strip()]
            if not parts:
                raise argparse.ArgumentTypeError(
                    f"expected comma-separated values, each {self.wanted(kind is int)}, "
                    f"got {text!r}")
            return [one(x) for x in parts]

        return parse


AT_LEAST_ONE = Range(1)
NON_NEGATIVE = Range(0)
POSITIVE = Range(0, exclusive=True)
PORT = Range(0, 65535)  # 0 picks a free one
FRACTION = Range(0, 1)


def opt(default: Any, help: str, range: Range | None = None, *, flag: str = "",
        formerly: str = "", repeat: bool = False, secret: bool = False,
        choices: tuple[str, ...] = ()) -> Any:
    """A setting. ``flag``: its flat name when not the section's prefix and field name;
    ``formerly``: an older flat name still accepted as a flag; ``repeat``: the flag may be
    given several times, its values joined with commas (as its environment variable writes
    them); ``secret``: never shown in ``--help`` or ``repr``; ``choices``: the values a
    string setting takes."""
    return field(default=default, repr=not secret, metadata={
        "help": help, "range": range, "flag": flag, "formerly": formerly, "repeat": repeat,
        "secret": secret, "choices": choices})


def flag(name: str) -> str:
    """The flag of the setting with flat name ``name``."""
    return "--" + name.replace("_", "-")


class Section:
    """Base of a section: a frozen dataclass of settings, checked against their ranges when
    built. ``prefix`` starts its settings' flat names; ``title`` heads them in ``--help``."""

    prefix: ClassVar[str] = ""
    title: ClassVar[str] = ""

    @classmethod
    def flat_name(cls, f: dataclasses.Field[Any]) -> str:
        return f.metadata.get("flag") or (f"{cls.prefix}_{f.name}" if cls.prefix else f.name)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if (r := f.metadata.get("range")) is not None:
                r.check(self.flat_name(f), getattr(self, f.name))
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                name = self.flat_name(f)
                raise SystemExit(f"{flag(name)} ({ENV_PREFIX}{name.upper()}) must be one of "
                                 f"{', '.join(choices)}, got {getattr(self, f.name)!r}")


@dataclass(frozen=True)
class Setting:
    """One setting of a service: its flat name, where it lives and its declaration."""

    name: str
    section: str  # the service config's field holding the section
    section_cls: type[Section]
    field: dataclasses.Field[Any]
    type: type

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


class ServiceConfig:
    """Base of a service's config: a frozen dataclass whose fields are sections."""

    @classmethod
    def settings(cls) -> Iterator[Setting]:
        for s in dataclasses.fields(cls):  # type: ignore[arg-type]
            sec = get_type_hints(cls)[s.name]
            hints = get_type_hints(sec)
            for f in dataclasses.fields(sec):
                yield Setting(sec.flat_name(f), s.name, sec, f, hints[f.name])

    @classmethod
    def of(cls: type[T], **flat: Any) -> T:
        """The config with these settings (by flat name) and the defaults for the rest; a
        name the service does not have is a TypeError."""
        by_section: dict[str, dict[str, Any]] = {}
        for s in cls.settings():
            if s.name in flat:
                by_section.setdefault(s.section, {})[s.field.name] = flat.pop(s.name)
        if flat:
            raise TypeError(f"{cls.__name__} has no setting {', '.join(sorted(flat))}")
        hints = get_type_hints(cls)
        return cls(**{name: hints[name](**values)  # type: ignore[call-arg]
                      for name, values in by_section.items()})

    def flat(self) -> dict[str, Any]:
        """Every setting by flat name: ``type(cfg).of(**cfg.flat())`` equals ``cfg``."""
        return {s.name: getattr(getattr(self, s.section), s.field.name)
                for s in self.settings()}

    def replace(self: T, **flat: Any) -> T:
        """A copy with these settings changed (by flat name), checked again."""
        return type(self).of(**{**self.flat(), **flat})


class _Join(argparse.Action):
    """Each use of a repeated flag adds its value; the first replaces the default."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        seen = f"_{self.dest}_given"
        prior = getattr(namespace, self.dest) if getattr(namespace, seen, False) else ""
        setattr(namespace, seen, True)
        setattr(namespace, self.dest, f"{prior},{values}" if prior else values)


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, unless the help already says it (say, "default:
    the router's") or the option is a switch (its default is always off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0 or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class RawDefaultsFormatter(DefaultsFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, and a description kept as written (a formula)."""


def add_arguments(parser: argparse.ArgumentParser, cls: type[ServiceConfig],
                  env: Mapping[str, str]) -> None:
    """One flag per setting, grouped by section; the default shown is the environment's
    value if set."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for s in cls.settings():
        title = s.section_cls.title or s.section
        group = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        meta = s.field.metadata
        default = _parse(s.type, env[s.env], s.env) if s.env in env else s.field.default
        help_text = f"{meta.get('help', '')} (env {s.env}; default: %(default)s)"
        if meta.get("secret"):  # --help must not print a secret set in the environment
            help_text = (f"{meta.get('help', '')} (env {s.env}; default: none; a value given "
                         "is never shown)")
        names = [flag(s.name)] + ([flag(meta["formerly"])] if meta.get("formerly") else [])
        if s.type is bool:
            group.add_argument(*names, dest=s.name, default=default,
                               action=argparse.BooleanOptionalAction, help=help_text)
        elif meta.get("repeat"):
            group.add_argument(*names, dest=s.name, default=default, action=_Join,
                               help=help_text)
        else:
            group.add_argument(*names, dest=s.name, type=s.type, default=default,
                               help=help_text, choices=meta.get("choices") or None)


def _parse(typ: type, raw: str, where: str) -> Any:
    try:
        if typ is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        return typ(raw)
    except ValueError:
        raise SystemExit(f"{where}={raw!r} is not a valid {typ.__name__}") from None


def from_namespace(cls: type[T], ns: argparse.Namespace) -> T:
    return cls.of(**{s.name: getattr(ns, s.name) for s in cls.settings()})


def from_env(cls: type[T], env: Mapping[str, str] | None = None, **overrides: Any) -> T:
    """A config from the environment and keyword overrides by flat name (for tests and
    embedding)."""
    env = os.environ if env is None else env
    values = {s.name: _parse(s.type, env[s.env], s.env) for s in cls.settings() if s.env in env}
    return cls.of(**{**values, **overrides})
