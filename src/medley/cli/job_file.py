"""``medley train --config job.toml``: the settings of a run in one file, by section.

Each key is a ``medley train`` flag without its dashes (``checkpoint-every`` or
``checkpoint_every``), in the section that :data:`SECTIONS` gives it, with the flag's type
(numbers as TOML numbers, switches as ``true``/``false``, paths as strings). A relative path is
relative to the job file's directory (a path flag's value always; a value that may also be a name,
such as ``data`` or ``model``, when it names something there), so the file means the same on every
node whatever directory a command runs in. A flag given on the command line wins over the file
(and a relative path there is relative to the working directory, as always). The file is read as
the command line is parsed (click's ``default_map``), so ``medley launch PLAN -- --config
job.toml`` checks it once and passes it to every node. Nothing is taken silently: an unknown section
or key, two spellings of one key, a value of another TOML type than the flag's (:func:`type_error`),
a ``$NAME`` that is not set (``~`` and variables expand as in a shell), a value the flag would
refuse, or a plan-making key beside ``plan`` (:func:`refuse_plan_settings`) is one line naming the
file, the key and the fix. Example: ``examples/job.toml``.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any

import typer

from medley.cli.options import INLINE_NAMES, SETTING_SECTIONS
from medley.errors import MedleyInputError
from medley.fileio import anchored, read_user_bytes

# Section -> the flags it holds (as click names them: ``--json`` is ``as_json``): the command's own
# flags, then the run's settings of that section (their fields name it: medley.runtime.settings).
# The inline plan's LoRA flags (--lora-rank, ...) have a section of their own, [adapter].
ADAPTER_NAMES = tuple(name for name in INLINE_NAMES if name.startswith("lora_"))
_OWN: dict[str, tuple[str, ...]] = {
    "plan": ("plan", "cluster", *(n for n in INLINE_NAMES if n not in ADAPTER_NAMES), "local_ranks"),
    "adapter": ADAPTER_NAMES, "model": ("model",),
    "checkpoint": ("export_hf", "export_dtype"), "logging": ("as_json",)}
SECTIONS: dict[str, tuple[str, ...]] = {
    section: _OWN.get(section, ()) + tuple(n for n, s in SETTING_SECTIONS.items() if s == section)
    for section in ("plan", "adapter", "model", "data", "optimizer", "precision", "checkpoint", "logging",
                    "elastic")
}
# The settings that make medley train's inline plan (the plan file fixes them beside ``plan``): the
# [plan] section without the run's own settings, the adapter and the model.
PLAN_DEFINING: tuple[str, ...] = tuple(
    name for name in SECTIONS["plan"]
    if name not in ("plan", "local_ranks", "emulate", "slowdown", "slowdown_from", "device")
) + ADAPTER_NAMES + ("model",)
_MAX_BYTES = 1 << 20
_WHERE = "medley.job_keys"  # ctx.meta: parameter name -> "job.toml [section] key" it came from


def _keys(command: Any) -> dict[str, Any]:
    """Job-file key -> the command's parameter, for every option with a long flag."""
    found = {}
    for param in command.params:
        for opt in param.opts:
            if opt.startswith("--"):
                found[opt[2:].replace("-", "_")] = param
    return found


def read_job(path: Path, command: Any, ctx: typer.Context) -> dict[str, Any]:
    """The job file as click defaults (parameter name -> value), every value checked as its flag."""
    raw = read_user_bytes(path, what="job file", flag="--config")
    if len(raw) > _MAX_BYTES:
        raise MedleyInputError(f"{path}: {len(raw)} bytes; a job file is at most 1 MiB")
    try:
        table = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise MedleyInputError(f"{path}: not TOML ({err}); fix the file") from None
    keys = _keys(command)
    defaults: dict[str, Any] = {}
    for section, entries in table.items():
        if section not in SECTIONS:
            raise MedleyInputError(f"{path}: unknown section [{section}]; the sections are "
                                   f"{', '.join(f'[{s}]' for s in SECTIONS)}")
        if not isinstance(entries, dict):
            raise MedleyInputError(f"{path}: '{section}' must be a [{section}] table of settings")
        spelled: dict[str, str] = {}  # parameter name -> the key that set it in this section
        for key, value in entries.items():
            name = key.replace("-", "_")
            param = keys.get(name)
            if param is None or param.name not in SECTIONS[section]:
                home = next((s for s, names in SECTIONS.items() if param is not None and param.name in names),
                            None)
                fix = f"it belongs in [{home}]" if home else f"[{section}] takes {', '.join(_names(section))}"
                raise MedleyInputError(f"{path}: [{section}] {key}: not a setting of [{section}]; {fix}")
            if param.name in spelled:
                raise MedleyInputError(f"{path}: [{section}] {spelled[param.name]} and {key} are one "
                                       "setting; keep one of them")
            spelled[param.name] = key
            where = f"{path}: [{section}] {key} = {_toml(value)}"
            wrong = type_error(param, value)
            if wrong is not None:
                raise MedleyInputError(f"{where}: {wrong}")
            value = _expanded(value, where=where)
            try:
                converted = param.process_value(ctx, value)
            except typer.BadParameter as err:
                raise MedleyInputError(f"{where}: {err.format_message()}") from None
            defaults[param.name] = _beside(path, value, is_path=isinstance(converted, Path))
            ctx.meta.setdefault(_WHERE, {})[param.name] = f"{path} [{section}] {key}"
    return defaults


def type_error(param: Any, value: object) -> str | None:
    """Why ``value`` (as TOML read it) is not of the flag's type, or None: TOML's types are taken
    strictly (a switch is ``true``/``false``, an integer is no float or boolean, a number no text);
    text settings also take an integer (``micro_batches = 4``), which is the same text."""
    kind = setting_type(param)
    if isinstance(value, (list, dict)):
        got = "an array" if isinstance(value, list) else "a table"
    elif kind is bool:
        got = None if isinstance(value, bool) else "not a boolean"
    elif isinstance(value, bool):
        got = "a boolean"
    elif kind is int:
        got = None if isinstance(value, int) else "not an integer"
    elif kind is float:
        got = None if isinstance(value, (int, float)) else "not a number"
    else:
        got = None if isinstance(value, (str, int)) else "not text"
    return None if got is None else f"{got}; write {_example(param, kind)}"


def setting_type(param: Any) -> type:
    """The Python type the flag was declared with (typer's annotation: int, float, bool, str, Path)."""
    if param.is_flag:
        return bool
    annotation = param.type_descriptor.annotation
    return annotation if annotation in (int, float, bool) else str


def _example(param: Any, kind: type) -> str:
    key = next(opt[2:].replace("-", "_") for opt in param.opts if opt.startswith("--"))
    if kind is bool:
        return f"{key} = true or {key} = false"
    if param.default is not None and not isinstance(param.default, bool):
        return f"{key} = {_toml(param.default)}"
    return {int: f"{key} = 2 (an integer)", float: f"{key} = 0.5 (a number)"}.get(
        kind, f'{key} = "..." (text in quotes)')


_VARIABLE = re.compile(r"\$(\w+|\{[^}]*\})")


def _expanded(value: object, *, where: str) -> object:
    """A text value with a leading ``~`` (or ``~user``) and ``$NAME``/``${NAME}`` expanded as a shell
    would; a variable that is not set, or a ``~user`` that does not exist, is refused."""
    if not isinstance(value, str):
        return value
    if value.startswith("~"):
        home = os.path.expanduser(value)
        if home.startswith("~"):
            raise MedleyInputError(f"{where}: {value.split('/')[0]} names no user's home here; write the "
                                   "path out")
        value = home
    for match in _VARIABLE.finditer(value):
        name = match.group(1).strip("{}")
        if name not in os.environ:
            raise MedleyInputError(f"{where}: ${name} is not set here; set it or write the path out")
    return os.path.expandvars(value)


def _beside(job: Path, value: object, *, is_path: bool) -> object:
    """A relative path value taken from the job file's directory (see the module docstring)."""
    return anchored(value, Path(job).resolve().parent, is_path=is_path) if isinstance(value, str) else value


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return str(value)


def _names(section: str) -> list[str]:
    return [{"as_json": "json"}.get(n, n) for n in SECTIONS[section]]


def plan_settings_given(ctx: typer.Context) -> list[str]:
    """The plan-defining settings (:data:`PLAN_DEFINING`) this command line or its job file gave,
    each as written there (``--seq-len``, ``job.toml [plan] seq_len``)."""
    from_job = ctx.meta.get(_WHERE, {})
    given = []
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name) if param.name in PLAN_DEFINING else None
        if source is None or source.name == "DEFAULT":
            continue
        given.append(from_job[param.name] if source.name == "DEFAULT_MAP" else
                     next(opt for opt in param.opts if opt.startswith("--")))
    return given


def refuse_plan_settings(ctx: typer.Context, *, plan: object) -> None:
    """Beside a plan file the settings that would make another plan are refused, not dropped."""
    given = plan_settings_given(ctx)
    if given:
        raise MedleyInputError(
            f"{', '.join(given)}: {'they set' if len(given) > 1 else 'it sets'} an inline plan, and the plan "
            f"file {plan} fixes the plan; remove {'them' if len(given) > 1 else 'it'}, or make "
            "the plan you want (medley plan or medley simulate ... --out) and pass that")


def load_job_callback(ctx: typer.Context, value: Path | None) -> Path | None:
    """``--config``'s callback (eager): the file's settings become the defaults of every other
    flag of the command; a bad file is a usage error (one line, exit 2)."""
    if value is None or ctx.resilient_parsing:
        return value
    try:
        defaults = read_job(value, ctx.command, ctx)
    except MedleyInputError as err:
        raise typer.BadParameter(str(err)) from None
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def reference(command: Any) -> str:
    """Every section's keys as Markdown tables (key, default, what it sets): docs/job-file.md."""
    params = {param.name: param for param in command.params}
    lines = []
    for section, names in SECTIONS.items():
        lines += [f"### [{section}]", "", "| key | default | |", "|---|---|---|"]
        for name in names:
            param = params[name]
            key = next(opt[2:].replace("-", "_") for opt in param.opts if opt.startswith("--"))
            default = "" if param.default is None else f"`{_toml(param.default)}`"
            text = " ".join(str(param.help or "").split()).replace("|", "\\|")
            lines.append(f"| `{key}` | {default} | {text} |")
        lines.append("")
    return "\n".join(lines)
