"""Experiment options: the keyword parameters of an experiment's ``build(cache_dir, **options)``.

An experiment declares its options as keyword parameters of ``build`` with defaults; a
``typing.Literal`` annotation lists the valid values (``batch: Literal[1, 16, 64] = 1``), and the
default's type is the option's type otherwise. ``autopolicy tune NAME --small --option KEY=VALUE``
passes them (``--small`` is ``--option small=true``), checked here before anything is built.

An experiment built with options is another *form* of it: its name gets a suffix from the
options that differ from their defaults (``decoder_1b-small-batch16``), which names its default
run directory; the measurement caches tell forms apart by what each measurement depends on
(weights, data, input shapes), so forms never share what differs between them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import re
import typing
from typing import Any, Callable, Mapping

__all__ = ["Option", "Text", "declared", "resolve", "suffix", "parse_value", "parse_assignment"]

#: The characters a form's suffix keeps (it names a directory); others become "_".
_SAFE = re.compile(r"[^A-Za-z0-9._+-]")
_INT = re.compile(r"[-+]?\d+")
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_KEY = re.compile(r"[A-Za-z_]\w*")


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of an experiment: a keyword parameter of its ``build``.

    Attributes:
      name: The parameter's name.
      default: Its default value (the form without the option).
      choices: The valid values, from a ``typing.Literal`` annotation; None: any value of the
        default's type.
    """

    name: str
    default: Any
    choices: tuple | None = None

    def describe(self) -> str:
        """``batch in (1, 16, 64), default 1``, or ``small (bool, default False)``.

        >>> Option("batch", 1, (1, 16, 64)).describe()
        'batch in (1, 16, 64), default 1'
        >>> Option("small", False).describe()
        'small (bool, default False)'
        """
        if self.choices is not None:
            return f"{self.name} in {self.choices}, default {self.default!r}"
        return f"{self.name} ({type(self.default).__name__}, default {self.default!r})"


def declared(build: Callable[..., Any]) -> dict[str, Option] | None:
    """The options ``build`` takes, in their order: its parameters after the first (the cache
    directory) that have defaults; None when it takes any keyword (``**options``).

    >>> from typing import Literal
    >>> def build(cache_dir, *, small: bool = False, batch: Literal[1, 16] = 1): ...
    >>> [o.describe() for o in declared(build).values()]
    ['small (bool, default False)', 'batch in (1, 16), default 1']
    """
    parameters = list(inspect.signature(build).parameters.values())[1:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    try:
        hints = typing.get_type_hints(build)
    except Exception:  # pylint: disable=broad-except  # an annotation that does not evaluate: no choices
        hints = {}
    options = {}
    for p in parameters:
        if p.default is inspect.Parameter.empty or p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            continue
        hint = hints.get(p.name)
        choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None
        options[p.name] = Option(p.name, p.default, choices)
    return options


def _same_kind(value: Any, example: Any) -> bool:
    """Whether ``value`` may stand where ``example`` does (an int for a float; never a bool
    for a number nor a number for a bool)."""
    if isinstance(example, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(example, bool)
    if isinstance(example, float):
        return isinstance(value, (int, float))
    return example is None or isinstance(value, type(example))


class Text(str):
    """An option's value as written on the command line (``--option batch=16``): read as the
    type the option declares (its choices', or its default's), or guessed by :func:`parse_value`
    for a ``build(cache_dir, **options)``."""


def _read(option: Option, text: Text) -> Any:
    """``text`` read as ``option``'s type; as :func:`parse_value` reads it when it does not read
    as one (to be refused, echoed, by :func:`_check`)."""
    examples = option.choices if option.choices is not None else (option.default,)
    for example in examples:
        value = parse_value(text)
        if isinstance(example, str):
            value = str(text)
        elif isinstance(example, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if _same_kind(value, example) and (option.choices is None or value == example):
            return value
    return parse_value(text)


def _check(option: Option, value: Any, experiment: str) -> Any:
    """``value`` as ``option`` takes it (an int for a float option becomes a float)."""
    head = f"Invalid option {option.name} for the experiment {experiment!r}."
    if isinstance(value, Text):
        value = _read(option, value)
    if option.choices is not None:
        for choice in option.choices:
            if type(value) is type(choice) and value == choice:
                return choice
        raise ValueError(f"{head} Expected one of {option.choices}. Received: {option.name}={value!r}")
    if not _same_kind(value, option.default):
        kind = type(option.default).__name__
        article = "an" if kind[:1] in "aeiou" else "a"
        example = "true" if isinstance(option.default, bool) else option.default
        raise ValueError(f"{head} Expected {article} {kind} (like {option.name}={example}). "
                         f"Received: {option.name}={value!r}")
    return float(value) if isinstance(option.default, float) else value


def resolve(build: Callable[..., Any], options: Mapping[str, Any], experiment: str) -> dict[str, Any]:
    """Checks ``options`` against what ``build`` takes; returns them checked (in its order).

    Args:
      build: The experiment's ``build``.
      options: The options given.
      experiment: The experiment's name, for messages.

    Raises:
      ValueError: for an option ``build`` does not take, naming the options it takes (or saying
        it takes none), or a value of the wrong type or outside the choices, naming them.

    >>> def build(cache_dir, batch: int = 1): ...
    >>> resolve(build, {"batch": 16}, "toy")
    {'batch': 16}
    >>> resolve(build, {"small": True}, "toy")
    Traceback (most recent call last):
    ...
    ValueError: Unknown option 'small' for the experiment 'toy'. Expected one of ('batch',). Received: small=True
    """
    known = declared(build)
    if known is None:
        return {name: parse_value(v) if isinstance(v, Text) else v for name, v in options.items()}
    for name, value in options.items():
        if name not in known:
            expected = f"Expected one of {tuple(known)}" if known else "Its build(cache_dir) takes no options"
            shown = parse_value(value) if isinstance(value, Text) else value
            raise ValueError(f"Unknown option {name!r} for the experiment {experiment!r}. {expected}. "
                             f"Received: {name}={shown!r}")
    return {name: _check(known[name], options[name], experiment) for name in known if name in options}


def suffix(options: Mapping[str, Any], known: Mapping[str, Option] | None = None) -> str:
    """The form's name suffix: ``-small-batch16`` from the options that differ from their
    defaults (a true bool is its name, a false one ``no-NAME``, a number follows its name, a
    str follows it after ``-``); ``""`` for the default form. A value with characters a
    directory name should not hold is written safely, with a hash of it.

    >>> suffix({"small": True, "batch": 16, "phase": "prefill"})
    '-small-batch16-phase-prefill'
    >>> suffix({"batch": 1}, {"batch": Option("batch", 1)})
    ''
    """
    parts = []
    for name, value in options.items():
        if known is not None and name in known and _equal(value, known[name].default):
            continue
        if isinstance(value, bool):
            parts.append(name if value else f"no-{name}")
        elif isinstance(value, (int, float)):
            parts.append(f"{name}{value}")
        else:
            parts.append(f"{name}-{value}")
    text = "".join(f"-{p}" for p in parts)
    safe = _SAFE.sub("_", text)
    if safe != text:
        safe += "-" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:8]
    return safe


def _equal(value: Any, default: Any) -> bool:
    return type(value) is type(default) and value == default or (
        isinstance(default, float) and isinstance(value, (int, float)) and not isinstance(value, bool)
        and float(value) == default)


def parse_value(text: str) -> bool | int | float | str:
    """A command-line option value: ``true``/``false`` (any case) a bool, then an int, a float,
    else the text itself.

    >>> [parse_value(t) for t in ("16", "True", "0.5", "1e-3", "prefill")]
    [16, True, 0.5, 0.001, 'prefill']
    """
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    return text


def parse_assignment(text: str) -> tuple[str, Text]:
    """``"batch=16"`` -> ``("batch", Text("16"))``: the value is read when it is checked, as
    the type the option declares.

    Raises:
      ValueError: for text that is not ``KEY=VALUE`` with KEY a Python name.

    >>> parse_assignment("phase=prefill")
    ('phase', 'prefill')
    """
    key, sep, value = text.partition("=")
    if not sep or not _KEY.fullmatch(key.strip()):
        raise ValueError(f"{text!r} is not KEY=VALUE (like batch=16)")
    return key.strip(), Text(value.strip())
