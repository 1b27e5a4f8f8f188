"""Tokens to text as they arrive (`TextStream`): incremental detokenization and stop strings.

Each new token's text is the difference between decoding a short window of tokens with and without it. The
window starts a few tokens back, in the prompt at first, so that tokenizers whose first token loses its leading
space decode the output's first token as they would mid-text: the text is what follows the prompt's, as vLLM
gives it. Decoding more bytes can change only a trailing U+FFFD (an incomplete UTF-8 sequence that the next
tokens may complete): that one character is held back until a token follows it, so what is released never
changes later.

Stop strings: text is released only once no stop string can start in it; when one appears, the text is cut
before it (the stop string is not part of the output) and the stream stops.
"""

from collections.abc import Sequence

from ..models.tokenizer import Tokenizer

__all__ = ["TextStream"]

PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens decoded ahead of the output's first token (vLLM's choice)."""
REPLACEMENT = "\ufffd"
MAX_WINDOW_TOKENS = 64
"""Decoded tokens kept before the window is trimmed (only its tail is decoded again)."""


class TextStream:
    """One choice's output text, token by token.

    Args:
      tokenizer: decodes token ids (special tokens dropped).
      prompt_token_ids: the prompt (its last tokens give the first output token its context).
      stop: stop strings (the text is cut before the first one that appears).
    """

    def __init__(self, tokenizer: Tokenizer, *, prompt_token_ids: Sequence[int] = (), stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._window = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])  # decoded tokens: context, then output
        self._start = 0  # the window's first token, for the next decode
        self._read = len(self._window)  # the text of the window's tokens before this one is released
        self._extra = 0  # characters released beyond the text of the tokens before `_read`
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1  # chars a stop string could still need
        self._text = ""  # the output's text so far (cut at a stop string)
        self._sent = 0  # characters of `_text` released
        self.num_tokens = 0  # output tokens taken (up to the one that completed a stop string)
        self.stopped = False  # a stop string appeared

    @property
    def text(self) -> str:
        """The text released so far."""
        return self._text[: self._sent]

    def add(self, token_ids: Sequence[int]) -> str:
        """Take output tokens; returns the text they release (empty while held back). Tokens after a stop string
        are ignored."""
        for token in token_ids:
            if self.stopped:
                break
            self.num_tokens += 1
            self._window.append(int(token))
            piece = self._decode_new()
            if piece:
                searched_from = max(0, len(self._text) - self._hold)
                self._text += piece
                self._cut_at_stop(searched_from)
        return self._release(final=self.stopped)

    def finish(self) -> str:
        """The text still held back (the stream's end: nothing more will come)."""
        if not self.stopped and self._read < len(self._window):
            begin = len(self._decode(self._start, self._read)) + self._extra
            searched_from = max(0, len(self._text) - self._hold)
            self._text += self._decode(self._start, len(self._window))[begin:]
            self._start, self._read, self._extra = self._read, len(self._window), 0
            self._cut_at_stop(searched_from)
        return self._release(final=True)

    # ------------------------------------------------------------------------------------------- helpers

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._window[start:end])

    def _decode_new(self) -> str:
        """The stable text the window's newest token adds (the trailing U+FFFD of an incomplete character
        held back)."""
        begin = len(self._decode(self._start, self._read)) + self._extra
        text = self._decode(self._start, len(self._window))
        stable = len(text) - 1 if text.endswith(REPLACEMENT) else len(text)
        if stable <= begin:
            return ""
        piece = text[begin:stable]
        if stable < len(text):
            self._extra += len(piece)
            return piece
        self._start, self._read, self._extra = self._read, len(self._window), 0  # all of it released
        if self._start > MAX_WINDOW_TOKENS:  # tokens before the window's start are never decoded again
            del self._window[: self._start]
            self._start, self._read = 0, self._read - self._start
        return piece

    def _cut_at_stop(self, searched_from: int) -> None:
        found = [i for i in (self._text.find(s, searched_from) for s in self._stop) if i >= 0]
        if found:
            self._text = self._text[: min(found)]
            self.stopped = True

    def _release(self, *, final: bool) -> str:
        end = len(self._text) if final else max(self._sent, len(self._text) - self._hold)
        piece = self._text[self._sent : end]
        self._sent = end
        return piece
