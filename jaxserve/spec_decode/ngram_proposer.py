"""Prompt-lookup (n-gram) drafts, vectorised over the batch with numpy.

For each request, the longest n in ``[prompt_lookup_min, prompt_lookup_max]`` whose last n tokens
occur earlier in its context wins; among that n's occurrences the rightmost (the most recent)
is taken, and the up to K tokens that followed it are the drafts. No match: no drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{prompt_lookup_min} and {prompt_lookup_max}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, contexts: Sequence[Sequence[int] | np.ndarray]) -> list[list[int]]:
        """Drafts (0..K ids) for each context (a request's known tokens)."""
        b = len(contexts)
        if b == 0:
            return []
        lengths = np.fromiter((len(c) for c in contexts), np.int64, b)
        width = int(lengths.max())
        tokens = np.full((b, width), -1, np.int64)  # -1 pads: never equal to a token id
        for i, c in enumerate(contexts):
            tokens[i, :len(c)] = c
        rows = np.arange(b)
        found = np.full(b, -1, np.int64)  # where the drafts start in each row, -1: none yet
        for n in range(min(self.max_n, width - 1), self.min_n - 1, -1):
            todo = (found < 0) & (lengths > n)
            if not todo.any():
                continue
            suffix = tokens[rows[:, None], lengths[:, None] - n + np.arange(n)]          # [B, n]
            windows = sliding_window_view(tokens, n, axis=1)                            # [B, W-n+1, n]
            starts = np.arange(windows.shape[1])
            # A match must end before the suffix begins' last token: something follows it.
            match = (windows == suffix[:, None, :]).all(-1) & (starts[None, :] + n < lengths[:, None])
            has = match.any(1) & todo
            rightmost = windows.shape[1] - 1 - np.argmax(match[:, ::-1], axis=1)
            found = np.where(has, rightmost + n, found)
        out: list[list[int]] = []
        for i in range(b):
            start = found[i]
            out.append([] if start < 0 else
                       tokens[i, start:min(start + self.k, lengths[i])].tolist())
        return out
