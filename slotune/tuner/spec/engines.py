"""External serving engines as data: how one is launched, when it is ready, and how each knob
becomes its flags.

An engine file (slotune/tuner/engines/<name>.yaml, or a user's own) holds a launch template, a readiness
path and the knobs a study may search; a new engine is a new file. `EngineDescription.argv`
renders one trial's knob values into a command line; `help_problems` holds every flag and choice
the file uses against the binary's own `--help`, so a flag renamed in a newer build is a
`tune validate` error, not a study of failed trials.
"""

from __future__ import annotations

import ast
import operator
import re
from importlib import resources
from pathlib import Path
from typing import Literal, NamedTuple

from pydantic import Field, ValidationError, model_validator

from slotune.engine.config import StrictModel
from slotune.tuner.spec.yaml_reader import SpecError, load_yaml_mapping

Value = bool | int | float | str
_NAME = r"[a-z][a-z0-9_]*"
_PLACEHOLDERS = ("binary", "model", "host", "port")


class EngineKnob(StrictModel):
    """One searchable setting and the flag it becomes."""

    flag: str | None = Field(None, pattern=r"^--?[A-Za-z][\w-]*$")  # None: only read by other knobs' `value`
    type: Literal["int", "choice", "bool", "path"]
    choices: list[Value] | None = None
    low: int | None = None
    high: int | None = None
    bool_values: tuple[str, str] | None = None  # a bool as the flag's argument (on, off); None: a switch
    default: Value | None = None  # what the engine does with the flag left off, where a rule needs it
    value: str | None = None  # the flag's argument as a formula of knob names, e.g. "parallel * ctx_per_slot"
    format: str = Field("{}", pattern=r"\{\}")  # the argument, {} standing for the value: "max_num_seqs={}"

    @model_validator(mode="after")
    def _check(self) -> EngineKnob:
        if self.type == "choice" and not self.choices:
            raise ValueError("a choice knob needs `choices`")
        if self.type != "choice" and self.choices is not None:
            raise ValueError(f"`choices` is for choice knobs; this one is {self.type}")
        if self.type == "int" and self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"low {self.low} > high {self.high}")
        if self.bool_values is not None and self.type != "bool":
            raise ValueError("`bool_values` is for bool knobs")
        return self


class Recorded(StrictModel):
    """What a trial records from a running server: `fields` name a metric after a value at `path`
    (a JSON field by dotted path, or a Prometheus sample by name)."""

    path: str = Field(pattern=r"^/")
    fields: dict[str, str]


class Rule(StrictModel):
    """A combination the engine refuses: when every `when` knob takes one of its values (null: the
    knob is left off), every `require` knob must take one of its own; without `require`, never."""

    when: dict[str, list[Value | None]]
    require: dict[str, list[Value | None]] = {}
    reason: str


class EngineDescription(StrictModel):
    """An external engine (`slotune/tuner/engines/*.yaml`)."""

    name: str = Field(pattern=r"^[a-z][a-z0-9-]*$")
    binary: str  # the executable, looked up on PATH unless the spec names one
    command: list[str]  # launch template; {binary}, {model}, {host}, {port} are filled in
    ready_path: str = "/health"  # answers 200 once the model is loaded
    help: list[str] = ["--help"]  # arguments that print every flag the binary knows
    knobs: dict[str, EngineKnob]
    rules: list[Rule] = []
    gates: list[str] = []  # the gate kinds this engine can serve through its API
    slot_context: str | None = None  # the knob bounding one request's tokens, prompt and output
    slots: str | None = None  # the knob counting the requests served at once (a load sweep's scale)
    settings: Recorded | None = None  # JSON of what it resolved at start (slots, context), once per trial
    counters: Recorded | None = None  # Prometheus counters, recorded as their rise over the measured requests

    @model_validator(mode="after")
    def _check(self) -> EngineDescription:
        for name in self.knobs:
            if not re.fullmatch(_NAME, name):
                raise ValueError(f"knob name {name!r}: use lower-case letters, digits and _")
            if name == "model":
                raise ValueError("knob name 'model': the weights are {model} in `command`; name the knob otherwise")
        for part in re.findall(r"{(\w+)}", " ".join(self.command)):
            if part not in _PLACEHOLDERS:
                raise ValueError(f"command: unknown placeholder {{{part}}}; use {', '.join(_PLACEHOLDERS)}")
        for name, knob in self.knobs.items():
            if knob.value is None:
                continue
            unknown = [ref for ref in _names(knob.value) if ref not in self.knobs]
            if unknown:
                raise ValueError(f"knob '{name}': `value` names '{unknown[0]}', which is not a knob of this engine")
            try:
                _evaluate(knob.value, dict.fromkeys(_names(knob.value), 1))
            except (SyntaxError, ValueError, ZeroDivisionError) as exc:
                raise ValueError(f"knob '{name}': {exc}") from None
        for field in ("slot_context", "slots"):
            if getattr(self, field) is not None and getattr(self, field) not in self.knobs:
                raise ValueError(f"{field}: '{getattr(self, field)}' is not a knob of this engine")
        for i, rule in enumerate(self.rules):
            for part in ("when", "require"):
                unknown = sorted(set(getattr(rule, part)) - set(self.knobs))
                if unknown:
                    raise ValueError(f"rules[{i}].{part}: {', '.join(unknown)} not a knob of this engine")
        return self

    def flags(self) -> list[str]:
        """Every flag this engine's launches can use: the command template's and the knobs'."""
        template = [a for a in self.command if a.startswith("-")]
        return sorted(set(template) | {k.flag for k in self.knobs.values() if k.flag})

    def check_values(self, values: dict[str, Value], rules: bool = True) -> list[str]:
        """What is wrong with one launch's knob values, in words ([] when nothing); `rules`: the
        combinations the engine refuses too."""
        problems = [f"'{n}' is not a knob of {self.name}" for n in values if n not in self.knobs]
        for name, v in values.items():
            knob = self.knobs.get(name)
            if knob is None:
                continue
            if knob.value is not None:
                problems.append(f"{name} is set from {knob.value}: set those instead")
            elif knob.type == "choice" and v not in knob.choices:
                problems.append(f"{name}: {v!r} is not one of {knob.choices}")
            elif knob.type == "int" and (not isinstance(v, int) or isinstance(v, bool)):
                problems.append(f"{name}: {v!r} is not a whole number")
            elif knob.type == "int" and knob.low is not None and v < knob.low:
                problems.append(f"{name}: {v} is below {knob.low}")
            elif knob.type == "int" and knob.high is not None and v > knob.high:
                problems.append(f"{name}: {v} is above {knob.high}")
            elif knob.type == "bool" and not isinstance(v, bool):
                problems.append(f"{name}: {v!r} is not true or false")
            elif knob.type == "path" and not isinstance(v, str):
                problems.append(f"{name}: {v!r} is not a file path")

        def value(k: str) -> Value | None:
            return values.get(k, self.knobs[k].default)

        for rule in self.rules if rules else []:
            if all(value(k) in vs for k, vs in rule.when.items()):
                if not rule.require or any(value(k) not in vs for k, vs in rule.require.items()):
                    problems.append(rule.reason)
        return problems

    def argv(
        self, values: dict[str, Value], *, binary: str, model: str, port: int, host: str = "127.0.0.1"
    ) -> list[str]:
        """The command line of one launch: the template, then each set knob's flag in knob order.
        Raises ValueError naming every problem (`check_values`)."""
        problems = self.check_values(values)
        if problems:
            raise ValueError("; ".join(problems))
        fill = {"binary": binary, "model": model, "host": host, "port": str(port)}
        args = [re.sub(r"{(\w+)}", lambda m: fill[m.group(1)], a) for a in self.command]
        for name, knob in self.knobs.items():
            if knob.flag is None or (name not in values and knob.value is None):
                continue
            if knob.value is not None:
                if any(ref not in values for ref in _names(knob.value)):
                    continue
                args += [knob.flag, knob.format.replace("{}", _format(_evaluate(knob.value, values)))]
            elif knob.type == "bool" and knob.bool_values is None:
                args += [knob.flag] if values[name] else []
            elif knob.type == "bool":
                args += [knob.flag, knob.format.replace("{}", knob.bool_values[0 if values[name] else 1])]
            else:
                args += [knob.flag, knob.format.replace("{}", _format(values[name]))]
        return args

    def help_problems(self, help_text: str) -> list[str]:
        """Every flag and choice this file uses that the binary's `--help` does not list, in words."""
        known = parse_help(help_text)
        problems = []
        for flag in self.flags():
            users = ", ".join([n for n, k in self.knobs.items() if k.flag == flag] or ["command"])
            if flag not in known:
                problems.append(
                    f"{users}: `{self.binary}` does not know {flag} (not in its {' '.join(self.help)}; "
                    f"renamed in this build?)"
                )
            elif re.search(r"has been removed|no longer (?:supported|used)|deprecated", known[flag].text, re.I):
                problems.append(f"{users}: `{self.binary}` lists {flag} as gone: {known[flag].text}")
        for name, knob in self.knobs.items():
            allowed = known[knob.flag].allowed if knob.flag in known else []
            if allowed and knob.type == "choice":
                bad = [c for c in knob.choices if str(c) not in allowed]
                if bad:
                    problems.append(
                        f"{name}: {knob.flag} does not accept {', '.join(map(str, bad))} "
                        f"(this build allows {', '.join(allowed)})"
                    )
        return problems


class FlagHelp(NamedTuple):
    allowed: list[str]  # the values the help lists for it ([] when it does not say)
    text: str  # its help, joined


def parse_help(text: str) -> dict[str, FlagHelp]:
    """Flags listed by a `--help` text -> their allowed values and help. Reads llama.cpp's layout
    (an option's names at the start of a line, its help indented below; `[on|off|auto]` or
    `a,b,c` hints and "allowed values: a, b" lines), argparse's (`--flag {a,b}`) and rich's boxed
    panels (typer)."""
    found: dict[str, FlagHelp] = {}
    current: list[str] = []
    for line in text.splitlines():
        line = re.sub(r"^│", " ", line)
        names = re.match(r"^\s{0,4}(-[^\s,]+(?:,\s*-[^\s,]+)*)(?:[ =]+(\S+))?", line)
        if names and not line.startswith(" " * 5):
            current = re.split(r",\s*", names.group(1))
            choices = re.fullmatch(r"[\[{]?([\w.-]+(?:[|,][\w.-]+)+)[\]}]?", names.group(2) or "")
            for n in current:
                found.setdefault(n, FlagHelp(re.split(r"[|,]", choices.group(1)) if choices else [], ""))
            line = line[names.end() :]
        elif line[:1].strip():  # other text at the margin (a section title): no option's help
            current = []
        allowed = re.search(r"allowed values:\s*([\w.-]+(?:,\s*[\w.-]+)*)", line)
        for n in current:
            old = found[n]
            found[n] = FlagHelp(
                re.split(r",\s*", allowed.group(1)) if allowed else old.allowed, f"{old.text} {line.strip()}".strip()
            )
    return found


def load_engine(name_or_path: str | Path) -> EngineDescription:
    """A built-in engine by name (slotune/tuner/engines/<name>.yaml) or an engine file; SpecError when bad."""
    path = Path(name_or_path)
    if not path.suffix:
        builtin = resources.files("slotune.tuner").joinpath("engines", f"{name_or_path}.yaml")
        if not builtin.is_file():
            raise SpecError(f"no built-in engine '{name_or_path}'; built in: {', '.join(builtin_engines())}")
        path = Path(str(builtin))
    try:
        return EngineDescription.model_validate(load_yaml_mapping(path, "engine file"))
    except ValidationError as exc:
        raise SpecError.from_validation(exc, path) from None


def engine_ref(ref: object, base: Path | None) -> object:
    """An engine as a spec or search space names it: a built-in name as it is, a file resolved against
    `base` (the folder of the file that names it)."""
    if not isinstance(ref, str) or base is None or ("/" not in ref and not Path(ref).suffix):
        return ref
    return str((base / Path(ref).expanduser()).resolve())


def builtin_engines() -> list[str]:
    folder = resources.files("slotune.tuner").joinpath("engines")
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def _names(formula: str) -> list[str]:
    """The knob names a `value` formula reads ([] when it does not parse: `_evaluate` says why)."""
    try:
        return [n.id for n in ast.walk(ast.parse(formula, mode="eval")) if isinstance(n, ast.Name)]
    except SyntaxError:
        return []


def _evaluate(formula: str, values: dict[str, Value]) -> int:
    """A `value` formula over whole numbers: knob names, numbers, + - * // and parentheses."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Name):
            return int(values[node.id])
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        raise ValueError(f"value {formula!r}: only knob names, whole numbers, + - * // and ( ) are allowed")

    return ev(ast.parse(formula, mode="eval").body)


def _format(v: Value) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)
