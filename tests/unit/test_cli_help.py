"""Every `scd` command documents every option it takes (`scd COMMAND --help` is the user's manual)."""

from __future__ import annotations

import typer.main
from typer.testing import CliRunner

from tools.cli import app


def _commands(group, path: tuple[str, ...] = ("scd",)):
    subs = getattr(group, "commands", None)
    if not subs:
        yield path, group
        return
    for name, sub in subs.items():
        yield from _commands(sub, (*path, name))


def test_every_option_of_every_command_has_a_help_text():
    """--device, --dtype, --verbose, --json, --stop, --seed, --max-new-tokens showed a name and a type
    only, in ten commands."""
    commands = list(_commands(typer.main.get_command(app)))
    assert len(commands) >= 15, [" ".join(p) for p, _ in commands]  # every command, the sub-commands too
    bare = [f"{' '.join(path)} {p.opts[-1]}" for path, cmd in commands for p in cmd.params
            if p.param_type_name == "option" and p.name != "help" and not (p.help or "").strip()]
    assert not bare, bare


def test_every_command_prints_its_help():
    for path, _ in _commands(typer.main.get_command(app)):
        res = CliRunner().invoke(app, [*path[1:], "--help"])
        assert res.exit_code == 0 and "Usage:" in res.output, (path, res.output[-500:])
