"""An INI parser with ${section:key} interpolation (see instruction.md)."""

_MISSING = object()


class ParseError(ValueError):
    pass


class InterpolationError(ValueError):
    pass


class InterpolationCycleError(InterpolationError):
    pass


class NoSectionError(KeyError):
    pass


class NoOptionError(KeyError):
    pass


class Config:
    def sections(self):
        raise NotImplementedError

    def has_section(self, name):
        raise NotImplementedError

    def options(self, section):
        raise NotImplementedError

    def get(self, section, key, fallback=_MISSING, raw=False):
        raise NotImplementedError

    def getint(self, section, key, fallback=_MISSING):
        raise NotImplementedError

    def getfloat(self, section, key, fallback=_MISSING):
        raise NotImplementedError

    def getbool(self, section, key, fallback=_MISSING):
        raise NotImplementedError

    def getlist(self, section, key, sep=",", fallback=_MISSING):
        raise NotImplementedError

    def as_dict(self):
        raise NotImplementedError


def parse(text):
    raise NotImplementedError
