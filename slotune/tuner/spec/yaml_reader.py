"""User input at the boundary: the one YAML reader for user files, the error it raises, how the CLI
prints errors (one `path: message` line per problem), and how a spec's paths and storage URLs
resolve against its folder.

Every spec, workload and search-space file goes through `load_yaml`, which reads plain YAML
only: no tags (`!!python/...`), no duplicate keys, bounded size, nesting depth and alias
expansion (a "billion laughs" document is refused before anything walks it), no NUL bytes,
UTF-8 only. Its problems are `SpecError`s naming the file, line and column.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

MAX_YAML_BYTES = 2 * 1024 * 1024  # a spec is a few KB; this bounds the read of /dev/zero too
MAX_YAML_DEPTH = 64  # nested collections; PyYAML's composer recurses, so a deeper document would hit RecursionError
MAX_YAML_NODES = 100_000  # after alias expansion: every use of an alias counts its whole subtree


@dataclass(frozen=True, slots=True)
class Problem:
    """One user-facing problem: where (file, line, column, field) and what."""

    message: str
    source: str | None = None
    line: int | None = None  # 1-based
    column: int | None = None  # 1-based
    field: str | None = None  # dotted path inside the document

    def __str__(self) -> str:
        where = ":".join(str(p) for p in (self.source, self.line, self.column) if p is not None)
        return ": ".join(p for p in (where, self.field, self.message) if p)


class SpecError(ValueError):
    """A mistake in a user's input file or value, with its location; the CLI prints one line per problem.

    A ValueError, so a pydantic validator that raises it reports it under the field being validated.
    """

    def __init__(
        self,
        message: str = "",
        *,
        source: str | Path | None = None,
        line: int | None = None,
        column: int | None = None,
        field: str | None = None,
        problems: list[Problem] | None = None,
    ):
        self.problems = (
            list(problems)
            if problems
            else [Problem(message, str(source) if source is not None else None, line, column, field)]
        )
        super().__init__("\n".join(str(p) for p in self.problems))

    def with_source(self, source: str | Path) -> "SpecError":
        """The same problems, attributed to `source` where they name no file."""
        return type(self)(
            problems=[
                p if p.source else Problem(p.message, str(source), p.line, p.column, p.field) for p in self.problems
            ]
        )

    @classmethod
    def from_validation(cls, exc: Any, source: str | Path | None = None, prefix: str = "") -> "SpecError":
        """A pydantic ValidationError's problems, attributed to `source`, fields under `prefix`."""
        return cls(
            problems=[
                Problem(
                    _pydantic_message(err),
                    str(source) if source is not None else None,
                    field=".".join([prefix] * bool(prefix) + [str(p) for p in err["loc"]]) or None,
                )
                for err in exc.errors()
            ]
        )


class MissingFileError(SpecError, FileNotFoundError):
    """A file a spec names does not exist (also a FileNotFoundError, for callers that catch that)."""


# --- the YAML reader -------------------------------------------------------------------------------
# Explicit tags that only restate a plain type (`!!str 123`); any other (!!set, !!binary, !!python/...,
# !custom) is refused before it is constructed.
_PLAIN_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "seq", "map")}


class _PlainLoader(yaml.SafeLoader):
    """SafeLoader that refuses tags, duplicate keys and deep nesting (the document is trusted with nothing)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            event = self.peek_event()
            if self._depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested more than {MAX_YAML_DEPTH} levels deep", event.start_mark
                )
            tag = getattr(event, "tag", None)
            if tag not in (None, "!") and tag not in _PLAIN_TAGS:
                shown = tag.replace("tag:yaml.org,2002:", "!!")
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"tag '{shown}' is not allowed: specs are plain YAML (no tags, no Python objects)",
                    event.start_mark,
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        "a mapping key must be a plain value (text or number), not a list or mapping",
                        key_node.start_mark,
                    ) from None
                if key in first_line:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key '{key}' (first on line {first_line[key]}); keep one",
                        key_node.start_mark,
                    )
                first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)

    def _refuse_tag(self, node):
        tag = node.tag.replace("tag:yaml.org,2002:", "!!")
        raise yaml.constructor.ConstructorError(
            None,
            None,
            f"tag '{tag}' is not allowed: specs are plain YAML (no tags, no Python objects)",
            node.start_mark,
        )


_PlainLoader.add_constructor(None, _PlainLoader._refuse_tag)


def _expanded_size(node, memo: dict[int, int], active: set[int]) -> int:
    """Nodes in the document once every alias is expanded; refuses recursive aliases."""
    key = id(node)
    if key in memo:
        return memo[key]
    if key in active:
        raise yaml.composer.ComposerError(
            None, None, "recursive alias: a node contains an alias to itself", node.start_mark
        )
    active.add(key)
    n = 1
    if isinstance(node, yaml.SequenceNode):
        for child in node.value:
            n += _expanded_size(child, memo, active)
    elif isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            n += _expanded_size(k, memo, active) + _expanded_size(v, memo, active)
    active.discard(key)
    if n > MAX_YAML_NODES:
        raise yaml.composer.ComposerError(
            None,
            None,
            f"aliases expand to more than {MAX_YAML_NODES} values (a 'billion laughs' document?); "
            "write the values out or use fewer aliases",
            node.start_mark,
        )
    memo[key] = n
    return n


def _yaml_problem(exc: yaml.YAMLError, source: str) -> SpecError:
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        msg = "; ".join(str(p) for p in (exc.context, exc.problem) if p) or "invalid YAML"
        if "\t" in msg or "'\\t'" in msg:
            msg += " (YAML indents with spaces, not tabs)"
        if mark is not None:
            return SpecError(msg, source=source, line=mark.line + 1, column=mark.column + 1)
        return SpecError(msg, source=source)
    return SpecError(f"invalid YAML: {exc}", source=source)


def parse_yaml(text: str | bytes, source: str = "<string>") -> Any:
    """Parse one plain-YAML document (see the module docstring for what is refused).

    Args:
        text: the document, as text or UTF-8 bytes.
        source: the file name the problems are reported against.
    Returns:
        The document's value (None for an empty document). Raises SpecError.
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = text[: exc.start].count(b"\n") + 1
            raise SpecError(
                f"not UTF-8 text (byte 0x{text[exc.start]:02x}); is this a binary file?", source=source, line=line
            ) from None
    text = text.removeprefix("\ufeff")
    if len(text) > MAX_YAML_BYTES:
        raise SpecError(f"larger than {MAX_YAML_BYTES // 1024} KiB; is this the right file?", source=source)
    nul = text.find("\x00")
    if nul >= 0:
        raise SpecError("contains a NUL byte; is this a binary file?", source=source, line=text.count("\n", 0, nul) + 1)
    loader = _PlainLoader(text)
    loader.name = source
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node, {}, set())
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise _yaml_problem(exc, source) from None
    finally:
        loader.dispose()


def load_yaml(path: str | Path, what: str = "file") -> Any:
    """Read and parse a user's YAML file (a spec, a workload, a search space).

    Args:
        path: the file.
        what: what the file is, for the not-found message ("spec file", "workload file").
    Returns:
        The document's value. Raises MissingFileError, or SpecError for anything else wrong.
    """
    path = Path(path)
    if not path.exists():
        raise MissingFileError(f"{what} not found", source=path)
    if path.is_dir():
        raise SpecError(f"is a directory; expected a YAML {what}", source=path)
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_YAML_BYTES + 1)
    except OSError as exc:
        raise SpecError(f"cannot read: {exc.strerror or exc}", source=path) from None
    return parse_yaml(raw, str(path))


def load_yaml_mapping(path: str | Path, what: str = "file", *, empty_ok: bool = False) -> dict[str, Any]:
    """`load_yaml`, requiring a mapping at the top level (an empty file is {} when `empty_ok`)."""
    data = load_yaml(path, what)
    if data is None and empty_ok:
        return {}
    if not isinstance(data, dict):
        got = "an empty file" if data is None else f"a {type(data).__name__}"
        raise SpecError(f"a {what} must hold a mapping (key: value lines) at the top level, got {got}", source=path)
    return data


# --- formatting ------------------------------------------------------------------------------------
def error_lines(exc: BaseException, source: str | Path | None = None) -> list[str]:
    """One `path: field: message` line per problem in `exc`.

    Args:
        exc: a SpecError, a pydantic ValidationError, a YAML error, an OSError or any other exception.
        source: the file the user gave, for problems that name no file of their own.
    """
    from pydantic import ValidationError

    src = str(source) if source is not None else None
    if isinstance(exc, SpecError):
        return [str(p) for p in (exc.with_source(src).problems if src else exc.problems)]
    if isinstance(exc, ValidationError):
        return [
            str(Problem(_pydantic_message(err), src, field=".".join(str(p) for p in err["loc"]) or None))
            for err in exc.errors()
        ]
    if isinstance(exc, yaml.YAMLError):
        name = getattr(getattr(exc, "problem_mark", None), "name", None)  # "<unicode string>" for text
        return [
            str(p) for p in _yaml_problem(exc, name if name and not name.startswith("<") else src or "<input>").problems
        ]
    if isinstance(exc, OSError) and exc.filename is not None:
        return [f"{exc.filename}: {exc.strerror or exc}"]
    if isinstance(exc, RecursionError):
        return [str(Problem("nested too deeply", src))]
    msg = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return [str(Problem(line, src)) for line in (msg.splitlines() or [type(exc).__name__])]


def _pydantic_message(err: dict[str, Any]) -> str:
    if err["type"] == "extra_forbidden":
        return "unknown field (check the spelling; unknown keys are errors)"
    if err["type"] == "finite_number":
        return "must be a finite number (NaN and inf are not accepted)"
    return err["msg"].removeprefix("Value error, ")


def format_error(exc: BaseException) -> str:
    """A pydantic error as a `Model: N problem(s)` header and one indented `field.path: message` line per
    problem (the header names no field; callers that want lines only use `error_lines`); other errors as text."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        lines = [
            f"{'.'.join(str(p) for p in err['loc']) or '(root)'}: {_pydantic_message(err)}" for err in exc.errors()
        ]
        return f"{exc.title}: {len(lines)} problem(s)\n  " + "\n  ".join(lines)
    return str(exc)


def resolve_path(ref: str, base: Path | None, name_ok: bool = False) -> str:
    """`ref` against the spec's folder; with `name_ok`, a bare name (no separator, no leading '.' or '~',
    nothing of that name in the folder) is kept as a name (a bundled model)."""
    if "\x00" in ref:
        raise ValueError("contains a NUL character")
    p = Path(ref).expanduser()
    if p.is_absolute() or base is None:
        return str(p) if not name_ok or p.is_absolute() else ref
    if (
        name_ok
        and "/" not in ref
        and os.sep not in ref
        and not ref.startswith((".", "~"))
        and p.suffix != ".gguf"
        and not (base / p).exists()
    ):
        return ref
    return os.path.normpath(base / p)


def resolve_ref(ref: str, base: Path | None, builtins: dict[str, Path]) -> str:
    """A workload / search space reference: a file next to the spec, a built-in name, or a path."""
    if "\x00" in ref:
        raise ValueError("contains a NUL character")
    if base is not None and (base / ref).exists():
        return os.path.normpath(base / ref)
    if ref in builtins:
        return ref
    if Path(ref).suffix not in (".yaml", ".yml", ".json") and "/" not in ref and os.sep not in ref:
        raise ValueError(f"'{ref}' is not a file next to the spec, and not a built-in ({', '.join(sorted(builtins))})")
    return resolve_path(ref, base)


def check_storage_url(url: str, base: Path | None) -> str:
    """An Optuna (SQLAlchemy) storage URL: parsed, its dialect known, a relative sqlite path resolved."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        parsed = make_url(url)
        parsed.get_dialect()
    except NoSuchModuleError:  # an ArgumentError too: first
        raise ValueError(
            f"'{url}': unknown database kind '{url.split(':', 1)[0]}' (e.g. sqlite, postgresql, mysql)"
        ) from None
    except ArgumentError:
        raise ValueError(
            f"'{url}' is not a database URL (e.g. sqlite:///study.db, postgresql://user@host/db)"
        ) from None
    if (
        parsed.get_backend_name() == "sqlite"
        and parsed.database
        and parsed.database != ":memory:"
        and not parsed.database.startswith("file:")
    ):
        db = resolve_path(parsed.database, base)
        if db != parsed.database:
            return f"{url.split(':', 1)[0]}:///{db}"
    return url
