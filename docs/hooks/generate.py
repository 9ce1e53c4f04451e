"""mkdocs hooks: the pages that are generated from the code at build time.

- ``<!-- generated: cli -->`` becomes the command line's reference, read from the argparse
  parsers that ``dptune`` itself runs (``dptune.cli.app.build_parser``): every subcommand, its
  flags by group, their values, defaults and help, the exit codes (the parser's own epilog and
  the error classes of :mod:`dptune.errors`) and the input bounds.
- ``<!-- generated: api PACKAGE -->`` becomes one mkdocstrings entry per public name of
  ``PACKAGE.__all__`` (``dptune``, ``dptune.ddp``, ...), each resolved (through the package's
  lazy names) to the module that defines it today, so moving a module never breaks the page.
- ``<!-- generated: cards -->`` becomes the card table, each card parsed as a spec.
- ``changelog.md`` is ``CHANGELOG.md`` of the repository root, its links into ``docs/`` made
  relative to the site; ``img/*.png`` are the committed example report's and benchmarks' plots.

Nothing here is typed by hand: a flag added to a parser shows up on the next build.
"""

from __future__ import annotations

import argparse
import html
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]


# ---- the command line ------------------------------------------------------------------------

def _cell(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _values(action: argparse.Action) -> str:
    if action.choices is not None:
        return ", ".join(f"`{c}`" for c in action.choices)
    kind = action.type
    if kind is None:
        return "(a switch)" if action.nargs == 0 else "text"
    if kind in (int, float, str):
        return kind.__name__
    doc = inspect.getdoc(kind) or ""
    first = doc.split("\n\n", 1)[0]
    first = re.sub(r"^``[^`]+``: ", "", first)      # "``--flag``: what" repeats the flag
    if not first:
        return getattr(kind, "__name__", "text").strip("_").replace("_", " ")
    return _cell(_roles(first, kind.__module__))


def _roles(text: str, home: str = "") -> str:
    """Sphinx roles made plain: ``:data:`dptune.x.LIMIT``` becomes the constant's value (a bare
    name is looked up in ``home``, the module whose docstring it is)."""
    def value(m: re.Match) -> str:
        role, target = m.group(1), m.group(2)
        if role == "data":
            module, _, name = target.rpartition(".")
            module = module or home
            try:
                got = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError, ValueError):
                return f"`{target}`"
            return f"{got:,}" if isinstance(got, int) else f"`{got}`"
        return f"`{target.rpartition('.')[2]}`"
    return re.sub(r":(\w+):`~?([\w.]+)`", value, text).replace("``", "`")


def _default(action: argparse.Action) -> str:
    if action.default in (None, argparse.SUPPRESS) or action.nargs == 0:
        return ""
    return f"`{action.default}`"


def _flags(action: argparse.Action) -> str:
    """The flag and its metavar as code (HTML, so that a ``|`` in a metavar keeps the table)."""
    if not action.option_strings:
        return f"<code>{html.escape(action.metavar or action.dest)}</code>"
    metavar = "" if action.nargs == 0 else f" {action.metavar or action.dest.upper()}"
    return ", ".join(f"<code>{html.escape(s + metavar)}</code>".replace("|", "&#124;")
                     for s in action.option_strings)


def _command(name: str, parser: argparse.ArgumentParser) -> list[str]:
    out = [f"## dptune {name}", "", "```text", parser.format_usage().strip(), "```", ""]
    if parser.description:
        out += [_cell(_roles(parser.description)), ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.help != argparse.SUPPRESS
                   and "-h" not in a.option_strings]
        if not actions:
            continue
        out += [f"### {group.title}", "", "| flag | values | default | what |", "|---|---|---|---|"]
        for a in actions:
            out.append(f"| {_flags(a)} | {_values(a)} | {_default(a)} | {_cell(_roles(a.help or ''))} |")
        out.append("")
    return out


def _first(*places: tuple[str, str]) -> Any:
    """The first of ``(module, name)`` that imports: modules move, their constants stay."""
    for module, name in places:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise RuntimeError(f"none of {places} exists: update docs/hooks/generate.py")


def _bounds() -> list[str]:
    from dptune.units import format_bytes

    cards = _first(("dptune.cli.checks", "MAX_SIMULATED_CARDS"), ("dptune.cli.checks", "MAX_SIMULATED_CARDS"))
    headroom = _first(("dptune.cli.checks", "MAX_HEADROOM_BYTES"), ("dptune.cli.checks", "MAX_HEADROOM_BYTES"))
    accumulate = _first(("dptune.step.workload", "MAX_ACCUMULATE"), ("dptune.step.workload", "MAX_ACCUMULATE"))
    return ["| input | bound |", "|---|---|",
            f"| `--simulate` | at most {cards:,} cards |",
            f"| `--accumulate` | 1 to {accumulate:,} micro-batches |",
            f"| `--headroom` | at most {headroom:,} bytes ({format_bytes(headroom)}) |", ""]


def _exit_codes() -> list[str]:
    import dptune.errors as errors

    rows = ["| error class | exit code | what |", "|---|---|---|"]
    for name, cls in sorted(vars(errors).items()):
        if inspect.isclass(cls) and issubclass(cls, errors.DptuneError):
            doc = (inspect.getdoc(cls) or "").split("\n\n", 1)[0]
            rows.append(f"| `{name}` | {cls.exit_code} | {_cell(_roles(doc))} |")
    return rows + [""]


def cli_reference() -> str:
    from dptune.cli.app import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = ["```text", parser.format_usage().strip(), "```", "",
           "Exit codes, as `dptune --help` prints them:", "", "```text", (parser.epilog or "").strip(),
           "```", "", "Each failure is raised as one of these classes (`dptune.errors`), and its exit code "
           "is the class's:", ""]
    out += _exit_codes()
    out += ["Inputs out of these bounds are refused before anything runs (exit 2):", ""]
    out += _bounds()
    for name, child in sub.choices.items():
        out += _command(name, child)
    return "\n".join(out)


# ---- the Python API --------------------------------------------------------------------------

def api_reference(package: str) -> str:
    """One mkdocstrings entry per name of ``package.__all__``, at the module defining it."""
    mod = importlib.import_module(package)
    lazy: dict[str, str] = dict(getattr(mod, "_LAZY", {}))
    out: list[str] = []
    for name in mod.__all__:
        if name.startswith("__"):
            continue
        value = getattr(mod, name)
        home = getattr(value, "__module__", None) if callable(value) else None
        home = home or lazy.get(name) or package
        out += [f"### `{package}.{name}`", "", f"::: {home}.{name}",
                "    options:", "      show_root_heading: false", ""]
    return "\n".join(out)


# ---- the card table ---------------------------------------------------------------------------

def card_table() -> str:
    """The known cards, each parsed as a one-card spec through ``dptune.parse_cluster``."""
    import dptune
    from dptune.units import format_bytes

    names = _first(("dptune.hardware", "CARD_TYPES"), ("dptune.hardware.cards", "CARD_TYPES"),
                   ("dptune.hardware.cluster", "CARD_TYPES"))
    rows = ["| card (in a spec) | memory (as torch reports it) | compute capability |", "|---|---|---|"]
    for name in names:
        cluster = dptune.parse_cluster(f"1x{name}")
        major, minor = cluster.capabilities[0]
        rows.append(f"| `{name}` | {format_bytes(cluster.total_bytes[0])} | {major}.{minor} |")
    return "\n".join(rows + [""])


# ---- mkdocs events ---------------------------------------------------------------------------

def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    for marker, make in (("cli", cli_reference), ("cards", card_table)):
        if f"<!-- generated: {marker} -->" in markdown:
            markdown = markdown.replace(f"<!-- generated: {marker} -->", make())
    return re.sub(r"<!-- generated: api ([\w.]+) -->", lambda m: api_reference(m.group(1)), markdown)


def on_files(files: Any, config: Any) -> Any:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    text = re.sub(r"\]\(docs/", "](", text)
    files.append(File.generated(config, "changelog.md", content=text))
    # the committed pictures (`make example`, `make bench` redraw them), never a copy in docs/
    for dest, src in _PICTURES.items():
        files.append(File.generated(config, dest, abs_src_path=str(ROOT / src)))
    return files


_PICTURES = {"img/peaks.png": "reports/TinyGPT-4x24GB/peaks.png",
             "img/fits.png": "reports/TinyGPT-4x24GB/fits.png",
             "img/max_batch.png": "reports/TinyGPT-4x24GB/max_batch.png",
             "img/benchmarks-summary.png": "reports/benchmarks/summary.png"}
