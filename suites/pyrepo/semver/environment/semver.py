"""Semantic Versioning 2.0.0 (see the task instruction for the specification)."""


class Version:
    def __init__(self, major, minor=0, patch=0, prerelease=(), build=()):
        raise NotImplementedError

    @classmethod
    def parse(cls, text):
        raise NotImplementedError


def compare(a, b):
    raise NotImplementedError
