"""Selecting and ordering tasks."""

from datetime import date

_STATUSES = ("open", "done", "all")


def select(tasks, tag=None, before=None, status="open"):
    if status not in _STATUSES:
        raise ValueError(f"status must be one of {_STATUSES}, got {status!r}")
    out = []
    for task in tasks:
        if status != "all" and task.done != (status == "done"):
            continue
        if tag is not None and tag.lower() not in task.tags:
            continue
        if before is not None and (task.due is None or task.due >= before):
            continue
        out.append(task)
    return sorted(out, key=lambda t: (t.due is None, t.due or date.min, t.id))
