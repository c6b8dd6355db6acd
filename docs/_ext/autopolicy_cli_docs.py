"""The command-line reference, generated from the parser, so that it cannot drift from it.

- ``autopolicy-cli``: every subcommand of ``autopolicy.cli.build_parser()``: its help, usage and
  arguments (choices, defaults, mutually exclusive groups), in the parser's order.
- ``autopolicy-exit-statuses``: the table of ``autopolicy.cli.EXIT_STATUSES``.
"""

from __future__ import annotations

import argparse
from typing import Any, Iterator

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

#: The width argparse formats usage lines to, whatever the terminal of the build.
USAGE_WIDTH = 88


def literal(text: str) -> nodes.literal:
    return nodes.literal(text, text)


def _paragraph(*children: nodes.Node) -> nodes.paragraph:
    return nodes.paragraph("", "", *children)


def _text_paragraph(text: str) -> nodes.paragraph:
    return _paragraph(nodes.Text(text))


def _formatter(parser: argparse.ArgumentParser) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(parser.prog, width=USAGE_WIDTH)


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = _formatter(parser)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)  # noqa: SLF001
    return formatter.format_help().strip()


def _subparsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """``(name, help, parser)`` of each subcommand, in the order they were added."""
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}  # noqa: SLF001
            for name, sub in action.choices.items():
                yield name, helps.get(name, ""), sub


def _shown(action: argparse.Action, skip: tuple[str, ...]) -> bool:
    if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):  # noqa: SLF001
        return False
    return not any(option in skip for option in action.option_strings)


def _invocation(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """``--max-drop MAX_DROP``, ``--no-report`` or ``run_dir``."""
    formatter = _formatter(parser)
    if not action.option_strings:
        return formatter._metavar_formatter(action, action.dest)(1)[0]  # noqa: SLF001
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    metavar = formatter._format_args(action, formatter._get_default_metavar_for_optional(action))  # noqa: SLF001
    return ", ".join(f"{option} {metavar}" for option in action.option_strings)


def _notes(parser: argparse.ArgumentParser, action: argparse.Action) -> list[str]:
    notes = []
    if action.choices is not None and not isinstance(action.choices, dict):
        notes.append("choices: " + ", ".join(str(c) for c in action.choices))
    if action.required and action.option_strings:
        notes.append("required")
    if not action.option_strings and action.nargs == "?":
        notes.append("optional")
    default = action.default
    if (action.nargs != 0 and default not in (None, argparse.SUPPRESS)
            and "default" not in (action.help or "")):
        notes.append(f"default: {default}")
    for group in parser._mutually_exclusive_groups:  # noqa: SLF001
        if action in group._group_actions:  # noqa: SLF001
            others = [a.option_strings[0] for a in group._group_actions if a is not action]  # noqa: SLF001
            notes.append(("one of these is required; " if group.required else "") + "not with " + ", ".join(others))
    return notes


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help:
        return ""
    return _formatter(parser)._expand_help(action)  # noqa: SLF001  (%(default)s, %%)


def _arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> nodes.definition_list:
    items = nodes.definition_list()
    for action in parser._actions:  # noqa: SLF001
        if not _shown(action, skip):
            continue
        body = nodes.definition()
        text = _help(parser, action)
        notes = _notes(parser, action)
        if text:
            body += _text_paragraph(text)
        if notes:
            note = "; ".join(notes)
            body += _paragraph(nodes.emphasis("", note[:1].upper() + note[1:]))
        items += nodes.definition_list_item("", nodes.term("", "", literal(_invocation(parser, action))), body)
    return items


def _section(document: nodes.document, title: str, anchor: str) -> nodes.section:
    section = nodes.section()
    section["ids"].append(nodes.make_id(anchor))
    section["names"].append(nodes.fully_normalize_name(anchor))
    section += nodes.title(title, "", literal(title))
    document.note_implicit_target(section, section)
    return section


class CliDirective(SphinxDirective):
    """Renders the command line from ``autopolicy.cli.build_parser()``."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        from autopolicy import cli  # pylint: disable=import-outside-toplevel

        parser = cli.build_parser()
        out: list[nodes.Node] = [
            _text_paragraph(parser.description or ""),
            nodes.literal_block(_usage(parser), _usage(parser)),
            _text_paragraph("Options of every command (also accepted after the command's name):"),
            _arguments(parser),
        ]
        for name, text, sub in _subparsers(parser):
            section = _section(self.state.document, f"autopolicy {name}", f"autopolicy-{name}")
            section += _text_paragraph(text[:1].upper() + text[1:] + ".")
            usage = _usage(sub)
            section += nodes.literal_block(usage, usage)
            shown = [a for a in sub._actions if _shown(a, ("--debug",))]  # noqa: SLF001
            if shown:
                section += _arguments(sub, skip=("--debug",))
            else:
                section += _text_paragraph("No arguments.")
            out.append(section)
        return out


class ExitStatusesDirective(SphinxDirective):
    """Renders ``autopolicy.cli.EXIT_STATUSES`` as a table."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        from autopolicy import cli  # pylint: disable=import-outside-toplevel

        return [table(("status", "meaning"), [[literal(str(status)), nodes.Text(meaning)]
                                               for status, meaning in cli.EXIT_STATUSES.items()], (1, 6))]


def table(header: tuple[str, ...], rows: list[list[nodes.Node]], widths: tuple[int, ...]) -> nodes.table:
    table = nodes.table()
    group = nodes.tgroup(cols=len(header))
    table += group
    for width in widths:
        group += nodes.colspec(colwidth=width)
    head = nodes.thead()
    head += nodes.row("", *[nodes.entry("", _text_paragraph(h)) for h in header])
    group += head
    body = nodes.tbody()
    for row in rows:
        body += nodes.row("", *[nodes.entry("", _paragraph(cell)) for cell in row])
    group += body
    return table



def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("autopolicy-cli", CliDirective)
    app.add_directive("autopolicy-exit-statuses", ExitStatusesDirective)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
