"""Verification: which candidates the target accepts, and where a stop rule cuts a step short.

Glossary (one verification step of one request):
  candidate  a token the draft proposed; the target runs one row per candidate after the seed row
             (the seed is the newest committed token)
  accepted   greedy: the leading candidates equal to the target's own greedy token at the same
             position; sampling: the leading candidates the speculative sampling rule kept
  bonus      the target's token after the accepted ones. Greedy: its argmax at the first mismatch,
             or after the last candidate when all were accepted. Sampling: drawn from the residual
             at the first rejection, from the target's distribution after the last candidate when
             all were accepted. A step commits accepted + bonus tokens.

Speculative sampling (`accept_sampled`), with p_i the target's distribution at candidate row i and q_i
the draft's that candidate x_i was drawn from, both after the request's temperature, top-k and top-p
(`sampler.filtered_probs`): x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first
rejection the bonus is drawn from max(0, p_i - q_i), normalized; when all are accepted, from p_k. Each
committed token is then distributed exactly as the target alone's at that position. A deterministic
proposal (the draft's argmax) is q_i a point mass: x_i is accepted with probability p_i(x_i), else the
bonus comes from p_i without x_i.

Randomness is keyed by the request's key and the output position (sampler.uniform). With
deterministic proposals the rule is carried out by the target's own draw at each position: it is x_i
with probability p_i(x_i), else a draw from the rest of p_i. So the committed tokens are exactly those
the target alone draws with the same seed, whatever the candidates, the schedule or the batch: under
f32 (logits that do not depend on the batch) the same seed gives the target alone's text. With
sampled proposals the draws of the draft, the acceptance tests and the residual draws are keyed too,
so a seeded request's text depends only on its prompt, its seed and how many candidates each of its
steps verified; the "adaptive" schedule chooses those from measured timings, so there the same seed
gives the same distribution, not always the same text. Under bf16 the logits themselves move with the
batch (rounding depends on how many rows share a step), so a seed can give another text in another
batch; each step is still exact for the logits it computed.

Nothing past a stop is ever committed: the tokens are cut after the first stop token, after the
token whose text completes a stop string, and at max_new_tokens, so that a step that accepts several
tokens ends a request exactly where steps of one token would.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .config import SamplingParams
from .outputs import TrackedRequest
from .sampler import ACCEPT_STREAM, draw, filtered_probs, uniform


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


def accept_sampled(
    candidates: Sequence[int],
    draft_probs: np.ndarray | None,
    target_logits: np.ndarray,
    params: SamplingParams,
    key: int,
    position: int,
) -> list[int]:
    """Speculative sampling: the accepted candidates, then the bonus token.

    draft_probs: [len(candidates), V] the distribution each candidate was drawn from (after the
    request's filters), or None for deterministic proposals (each a point mass on its candidate).
    target_logits: the target's logits at the seed row and at each candidate row [len(candidates) + 1, V].
    key, position: the request's key and the output index of the first candidate (sampler.uniform).
    The target's distributions are computed only for the rows reached.
    """
    tokens: list[int] = []
    for i, token in enumerate(candidates):
        p = filtered_probs(target_logits[i], params)
        if draft_probs is None:
            # q a point mass on the candidate: accept it with probability p(token), else draw from p
            # without it. The target's own draw at this position does both at once (it is the
            # candidate with probability p(token), otherwise a draw from the rest of p), so the
            # committed tokens are the ones the target alone draws with this key.
            drawn = draw(uniform(key, position + i), p)
            tokens.append(drawn)
            if drawn != token:
                return tokens
            continue
        q = draft_probs[i]
        if uniform(key, position + i, ACCEPT_STREAM) * q[token] < p[token]:  # probability min(1, p/q)
            tokens.append(int(token))
            continue
        tokens.append(draw(uniform(key, position + i), residual(p, q, token)))
        return tokens
    bonus = filtered_probs(target_logits[len(candidates)], params)
    tokens.append(draw(uniform(key, position + len(candidates)), bonus))
    return tokens


def residual(p: np.ndarray, q: np.ndarray, token: int) -> np.ndarray:
    """What a rejected sampled candidate leaves to draw from: max(0, p - q) (unnormalized).

    A rejection needs p(token) < q(token), so the residual has mass; should rounding leave it none
    (p and q equal to the last bit), p itself is returned, which is then the same distribution.
    """
    rest = np.maximum(p - q, 0.0)
    return rest if rest.sum() > 0.0 else p


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
