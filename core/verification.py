"""Verification: which candidates the target accepts, and where a stop rule cuts a step short.

Glossary (one verification step of one request):
  candidate  a token the draft proposed; the target runs one row per candidate after the seed row
             (the seed is the newest committed token)
  accepted   the leading candidates equal to the target's own greedy token at the same position
  bonus      the target's token after the accepted ones: its argmax at the first mismatch, or after
             the last candidate when all were accepted. A step commits accepted + bonus tokens.

Nothing past a stop is ever committed: the tokens are cut after the first stop token, after the
token whose text completes a stop string, and at max_new_tokens, so that a step that accepts several
tokens ends a request exactly where steps of one token would.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .outputs import TrackedRequest


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one step commits for one request, and how its candidates fared."""

    tokens: list[int]  # committed: accepted candidates, then the bonus (cut at a stop)
    num_drafted: int = 0  # candidates verified (0: a plain step)

    @property
    def num_accepted(self) -> int:
        """Accepted candidates actually committed. A stop inside the candidates ends the step there
        and takes the bonus's place, so the counters add up to the committed tokens."""
        return len(self.tokens) - 1 if self.num_drafted else 0


def accept_greedy(candidates: Sequence[int], target_tokens: np.ndarray) -> list[int]:
    """The longest prefix of candidates equal to the target's tokens, then the bonus token.

    target_tokens: the target's argmax at the seed row and at each candidate row (len(candidates) + 1).
    """
    num_accepted = 0
    while num_accepted < len(candidates) and candidates[num_accepted] == target_tokens[num_accepted]:
        num_accepted += 1
    return [int(t) for t in target_tokens[: num_accepted + 1]]


def cut_at_stop(tracked: TrackedRequest, tokens: list[int], tokenizer) -> list[int]:
    """The tokens a step may commit: none past max_new_tokens, none after a stop token and none
    after the token whose text completes a stop string."""
    request = tracked.request
    tokens = tokens[: request.sampling_params.max_new_tokens - request.num_output_tokens]
    stop_at = tracked.stop.first_stop(tokens)
    if stop_at is not None:
        tokens = tokens[: stop_at + 1]
    if len(tokens) > 1 and request.sampling_params.stop_strings:
        tokens = tokens[: _stop_string_end(tracked, tokens, tokenizer)]
    return tokens


def _stop_string_end(tracked: TrackedRequest, tokens: list[int], tokenizer) -> int:
    """How many of `tokens` to keep: up to the first one after which the text holds a stop string.

    The text is checked token by token as the incremental detokenizer builds it (it holds back
    incomplete characters, so a stop string shows at the same token as in one-token steps), on a
    copy of the request's detokenizer that shares the tokenizer.
    """
    probe = copy.deepcopy(tracked.detokenizer, {id(tokenizer): tokenizer})
    output = list(tracked.request.output_token_ids)
    for index, token in enumerate(tokens[:-1]):
        probe.add([token])
        output.append(token)
        if tracked.stop.check(output, probe.text) is not None:
            return index + 1
    return len(tokens)
