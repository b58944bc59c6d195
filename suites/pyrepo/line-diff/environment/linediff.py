"""Line diff (LCS) and patch application (see instruction.md). Must not import difflib."""


class PatchError(ValueError):
    pass


def diff(a, b, n=3, fromfile="a", tofile="b"):
    raise NotImplementedError


def apply(a, patch):
    raise NotImplementedError
