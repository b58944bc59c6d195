"""slugify: turn arbitrary text into a URL slug."""

import re
import unicodedata

_APOSTROPHES = re.compile(r"['\u2019]")
_NOT_ALNUM = re.compile(r"[^A-Za-z0-9]+")


def slugify(text, separator="-", max_length=None, lowercase=True):
    """A URL slug for `text`.

    1. Accented letters lose their accents (Unicode NFKD, then every character outside ASCII is dropped):
       "Crème Brûlée" -> "creme-brulee"; "Straße" -> "strae" (no ASCII decomposition for ß).
    2. Lowercased when `lowercase` is true (the default).
    3. Apostrophes (' and U+2019) are removed: "Don't stop" -> "dont-stop".
    4. Every run of characters other than ASCII letters and digits becomes one `separator`, and separators
       at both ends are removed: "  Hello,   World!  " -> "hello-world"; "***" -> "".
    5. With `max_length` (an int >= 1), the slug is shortened to at most `max_length` characters by dropping
       whole words from the end ("hello-big-world", max_length=10 -> "hello-big"); if even the first word is
       longer, it is cut to `max_length` characters ("supercalifragilistic", max_length=5 -> "super").

    `text` must be a str (TypeError otherwise); `separator` a non-empty str (ValueError otherwise);
    `max_length` None or an int >= 1 (ValueError otherwise).
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not isinstance(separator, str) or not separator:
        raise ValueError("separator must be a non-empty str")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
        raise ValueError(f"max_length must be None or an int >= 1, got {max_length!r}")
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    ascii_text = ascii_text.lower()
    words = _NOT_ALNUM.split(_APOSTROPHES.sub("", ascii_text))
    words = [w for w in words if w]
    if max_length is not None:
        kept = []
        for word in words:
            if len(separator.join([*kept, word])) > max_length:
                break
            kept.append(word)
        words = kept or [words[0][:max_length]] if words else []
    return separator.join(words)
