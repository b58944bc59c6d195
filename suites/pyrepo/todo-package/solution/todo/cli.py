"""The command line: python -m todo."""

import argparse
import re
import sys
from collections import Counter
from datetime import date

from todo import storage
from todo.query import select


class UserError(Exception):
    pass


def _parser():
    p = argparse.ArgumentParser(prog="python -m todo")
    p.add_argument("--file", default="todo.json")
    sub = p.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add")
    add.add_argument("title")
    add.add_argument("--tag", action="append", default=[])
    add.add_argument("--due")
    ls = sub.add_parser("list")
    ls.add_argument("--tag")
    ls.add_argument("--before")
    status = ls.add_mutually_exclusive_group()
    status.add_argument("--done", dest="status", action="store_const", const="done", default="open")
    status.add_argument("--all", dest="status", action="store_const", const="all")
    for name in ("done", "rm"):
        sub.add_parser(name).add_argument("ids", nargs="+", type=int)
    sub.add_parser("tags")
    return p


def _date(text):
    try:
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
            raise ValueError
        return date.fromisoformat(text)
    except ValueError:
        raise UserError(f"bad date {text!r}: use YYYY-MM-DD") from None


def _line(task):
    text = f"#{task.id} [{'x' if task.done else ' '}] {task.title}"
    if task.due:
        text += f" due:{task.due.isoformat()}"
    return text + "".join(f" +{tag}" for tag in task.tags)


def _find_all(todo, ids):
    try:
        return [todo.find(i) for i in ids]
    except KeyError as e:
        raise UserError(f"no task #{e.args[0]}") from None


def _run(args, todo):
    """Returns (output lines, whether the file must be saved)."""
    if args.command == "add":
        try:
            task = todo.add(args.title, args.tag, _date(args.due) if args.due else None)
        except ValueError as e:
            raise UserError(str(e)) from None
        return [f"added #{task.id}: {task.title}"], True
    if args.command == "list":
        before = _date(args.before) if args.before else None
        tasks = select(todo.tasks, tag=args.tag, before=before, status=args.status)
        return [_line(t) for t in tasks] or ["no tasks"], False
    if args.command == "tags":
        counts = Counter(tag for t in todo.tasks if not t.done for tag in t.tags)
        return [f"{tag} {counts[tag]}" for tag in sorted(counts)], False
    tasks = _find_all(todo, args.ids)
    if args.command == "done":
        for task in tasks:
            task.done = True
        return [f"done #{t.id}" for t in tasks], True
    removed = {t.id for t in tasks}
    todo.tasks = [t for t in todo.tasks if t.id not in removed]
    return [f"removed #{i}" for i in args.ids], True


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        todo = storage.load(args.file)
        lines, changed = _run(args, todo)
        if changed:
            storage.save(args.file, todo)
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for line in lines:
        print(line)
    return 0
