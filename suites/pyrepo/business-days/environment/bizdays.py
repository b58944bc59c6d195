"""Business-day arithmetic (see instruction.md)."""


class Calendar:
    def __init__(self, weekend=(5, 6), holidays=()):
        raise NotImplementedError

    def is_business_day(self, d):
        raise NotImplementedError

    def next_business_day(self, d):
        raise NotImplementedError

    def previous_business_day(self, d):
        raise NotImplementedError

    def business_days_between(self, start, end):
        raise NotImplementedError

    def add_business_days(self, start, n):
        raise NotImplementedError

    def business_days_in_month(self, year, month):
        raise NotImplementedError
