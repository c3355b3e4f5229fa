"""User-facing error formatting: one `field.path: message` line per problem."""

from __future__ import annotations


def format_error(exc: BaseException) -> str:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        lines = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "(root)"
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = "unknown field (check the spelling; unknown keys are errors)"
            lines.append(f"{loc}: {msg}")
        return f"{exc.title}: {len(lines)} problem(s)\n  " + "\n  ".join(lines)
    if isinstance(exc, FileNotFoundError):
        return str(exc)
    return f"{exc}"
