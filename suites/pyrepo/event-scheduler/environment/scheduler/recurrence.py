"""Expanding events into occurrences."""


def occurrences(event, window_start, window_end):
    raise NotImplementedError
