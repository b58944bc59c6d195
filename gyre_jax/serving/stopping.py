"""Stop strings: detect the token that completes a stop string in a completion's detokenized text.

Tokens stay exact (token-in/token-out): the completing token is kept in the result, and whoever shows
text cuts it at the stop string. Only generated text is searched, never the prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Detokenize = Callable[[Sequence[int]], str]


class StopStrings:
    """Checks, after each new token, whether a completion's text now contains one of ``stop_strings``.

    Each check decodes only a window of the newest tokens: wide enough for the longest stop string even
    when a character spans 4 byte tokens, so the cost per token is constant.
    """

    def __init__(self, stop_strings: Sequence[str], detokenize: Detokenize):
        if not stop_strings:
            raise ValueError("StopStrings needs at least one stop string")
        self.stop_strings = tuple(stop_strings)
        self._detokenize = detokenize
        self._window = 4 * max(len(s) for s in self.stop_strings) + 8

    def check(self, token_ids: Sequence[int]) -> str | None:
        """The stop string that the text of ``token_ids`` (a completion so far) contains, or None."""
        text = self._detokenize(list(token_ids[-self._window :]))
        for stop in self.stop_strings:
            if stop in text:
                return stop
        return None
