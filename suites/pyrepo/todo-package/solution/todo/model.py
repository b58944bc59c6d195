"""The Task model."""

import re
from dataclasses import dataclass
from datetime import date

_TAG = re.compile(r"[a-z0-9-]+")


def normalize_tags(tags):
    out = set()
    for tag in tags:
        if not isinstance(tag, str) or not _TAG.fullmatch(tag.lower()):
            raise ValueError(f"bad tag {tag!r}: use letters, digits and '-'")
        out.add(tag.lower())
    return tuple(sorted(out))


@dataclass
class Task:
    id: int
    title: str
    tags: tuple = ()
    due: date | None = None
    done: bool = False

    def __post_init__(self):
        if isinstance(self.id, bool) or not isinstance(self.id, int) or self.id < 1:
            raise ValueError(f"task id must be an int >= 1, got {self.id!r}")
        if not isinstance(self.title, str) or not self.title.strip():
            raise ValueError("a task needs a non-empty title")
        self.title = self.title.strip()
        self.tags = normalize_tags(self.tags)
        if self.due is not None and not isinstance(self.due, date):
            raise ValueError(f"due must be a date or None, got {self.due!r}")
        self.done = bool(self.done)

    def to_dict(self):
        return {
            "id": self.id,
            "title": self.title,
            "tags": list(self.tags),
            "due": self.due.isoformat() if self.due else None,
            "done": self.done,
        }

    @classmethod
    def from_dict(cls, d):
        due = d.get("due")
        return cls(
            d["id"], d["title"], d.get("tags", ()), date.fromisoformat(due) if due else None, d.get("done", False)
        )
