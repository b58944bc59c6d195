"""Loading and atomically saving the JSON file."""

import json
import os
import tempfile
from dataclasses import dataclass, field

from todo.model import Task

VERSION = 1


@dataclass
class TodoList:
    tasks: list = field(default_factory=list)
    next_id: int = 1

    def add(self, title, tags=(), due=None):
        task = Task(self.next_id, title, tags, due)
        self.tasks.append(task)
        self.next_id += 1
        return task

    def find(self, task_id):
        for task in self.tasks:
            if task.id == task_id:
                return task
        raise KeyError(task_id)


def load(path):
    if not os.path.exists(path):
        return TodoList()
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        tasks = [Task.from_dict(d) for d in data["tasks"]]
        next_id = int(data["next_id"])
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a todo file: {e}") from None
    return TodoList(sorted(tasks, key=lambda t: t.id), next_id)


def save(path, todo_list):
    tasks = sorted(todo_list.tasks, key=lambda t: t.id)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".todo-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            data = {"version": VERSION, "next_id": todo_list.next_id, "tasks": [t.to_dict() for t in tasks]}
            json.dump(data, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
