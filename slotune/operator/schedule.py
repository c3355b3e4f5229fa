"""Re-tuning schedules: standard 5-field cron ("0 3 * * 1") or "@every 6h" / "@every 30s".

The operator's timer schedules, not a CronJob, since every step after `tune run` is the operator's
anyway (docs/design/operator-tuning.md). Times are UTC.

A cron expression that can never fire (`0 0 30 2 *`: February 30) is refused by `parse`, so
the operator rejects it at validation; `next_after` searches a bounded window (longer than
the 8-year gap between two February 29ths) and raises `ScheduleError`, never loops.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

_DURATION = re.compile(r"^(\d+)(s|m|h|d)$")
_EVERY = re.compile(r"^@every\s+(\d+[smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_ALIASES = {"@hourly": "0 * * * *", "@daily": "0 0 * * *", "@weekly": "0 0 * * 0", "@monthly": "0 0 1 * *"}
_RANGES = [(0, 59), (0, 23), (1, 31), (1, 12), (0, 6)]  # minute hour day-of-month month day-of-week
_MAX_DAYS = {1: 31, 2: 29, 3: 31, 4: 30, 5: 31, 6: 30, 7: 31, 8: 31, 9: 30, 10: 31, 11: 30, 12: 31}
_MAX_SEARCH = timedelta(days=366 * 9)  # Feb 29 may be 8 years away (2096 -> 2104)


class ScheduleError(ValueError):
    """A schedule that does not parse or can never fire; the message names the expression."""


def _field(text: str, lo: int, hi: int) -> set[int]:
    values: set[int] = set()
    for part in text.split(","):
        base, _, step_s = part.partition("/")
        step = int(step_s) if step_s else 1
        if base == "*":
            a, b = lo, hi
        elif "-" in base:
            a, b = (int(x) for x in base.split("-", 1))
        else:
            a = int(base)
            b = hi if step_s else a
        if not (lo <= a <= b <= hi) or step < 1:
            raise ScheduleError(f"cron field '{text}' is outside {lo}-{hi}")
        values.update(range(a, b + 1, step))
    return values


def parse_duration(text: str) -> timedelta:
    """`<N>s|m|h|d` ("30s", "24h", "7d") as a timedelta; ScheduleError names a bad one."""
    m = _DURATION.match(str(text).strip())
    if m is None:
        raise ScheduleError(f"'{text}' is not a duration: expected <N>s, <N>m, <N>h or <N>d (e.g. 24h)")
    return timedelta(seconds=int(m.group(1)) * _UNITS[m.group(2)])


def parse(expr: str) -> tuple[timedelta | None, list[set[int]] | None]:
    """(interval, None) for @every, (None, fields) for cron; ScheduleError names a bad expression."""
    expr = _ALIASES.get(expr.strip(), expr.strip())
    m = _EVERY.match(expr)
    if m:
        interval = parse_duration(m.group(1))
        if interval <= timedelta(0):
            raise ScheduleError(f"schedule '{expr}': the interval must be positive")
        return interval, None
    parts = expr.split()
    if len(parts) != 5:
        raise ScheduleError(f"schedule '{expr}': expected 5 cron fields or '@every <N>s|m|h|d'")
    try:
        fields = [_field(p, lo, hi) for p, (lo, hi) in zip(parts, _RANGES)]
    except ValueError as exc:  # int() of a malformed field, or ScheduleError
        raise ScheduleError(f"schedule '{expr}': {exc}") from None
    fields[4] = {d % 7 for d in fields[4]}
    _, _, dom, month, dow = fields
    # days matter alone only when day-of-week is unrestricted (else either field may match)
    if len(dow) == 7 and not any(d <= _MAX_DAYS[m] for m in month for d in dom):
        raise ScheduleError(f"schedule '{expr}' never fires: no month in '{parts[3]}' has day '{parts[2]}'")
    return None, fields


def next_after(expr: str, after: datetime) -> datetime:
    """The first scheduled time strictly after `after` (timezone-aware, UTC); ScheduleError if none."""
    after = after.astimezone(timezone.utc)
    interval, fields = parse(expr)
    if interval is not None:
        return after + interval
    minute, hour, dom, month, dow = fields
    t = after.replace(second=0, microsecond=0) + timedelta(minutes=1)
    limit = t + _MAX_SEARCH
    while t < limit:
        # cron: when both day fields are restricted, either may match
        day_ok = (
            (t.day in dom or (t.weekday() + 1) % 7 in dow)
            if (len(dom) < 31 and len(dow) < 7)
            else (t.day in dom and (t.weekday() + 1) % 7 in dow)
        )
        if t.month not in month:  # to the first of the next month
            t = (t.replace(day=28, hour=0, minute=0) + timedelta(days=4)).replace(day=1)
        elif not day_ok:
            t = t.replace(hour=0, minute=0) + timedelta(days=1)
        elif t.hour not in hour:
            t = t.replace(minute=0) + timedelta(hours=1)
        elif t.minute not in minute:
            t += timedelta(minutes=1)
        else:
            return t
    raise ScheduleError(f"schedule '{expr}' never fires within {_MAX_SEARCH.days} days of {after:%Y-%m-%d}")
