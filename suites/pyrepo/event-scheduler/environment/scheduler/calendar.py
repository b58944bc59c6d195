"""The Calendar: a set of events, conflicts and free time."""


class Calendar:
    pass
