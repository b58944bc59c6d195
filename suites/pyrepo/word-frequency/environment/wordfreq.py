"""Word frequency counting (see instruction.md)."""


def tokenize(text):
    raise NotImplementedError


def count_words(text, stop_words=()):
    raise NotImplementedError


def top_k(counts, k):
    raise NotImplementedError


def load_stop_words(path):
    raise NotImplementedError


def main(argv=None):
    raise NotImplementedError


if __name__ == "__main__":
    raise SystemExit(main())
