"""Markdown tables (see instruction.md)."""


def render_table(rows, columns=None, align=None, headers=None, precision=None):
    raise NotImplementedError


def parse_table(text):
    raise NotImplementedError
