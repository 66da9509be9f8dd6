"""What the engine hands back: per-step outputs for streaming, and a result per finished request.

`TrackedRequest` is the engine's side of one request: its text as it grows, its stop rules, its
timings and its acceptance counters. It turns committed tokens into `RequestOutput`s (text deltas
that never include what a stop string may still cut) and, at the end, into a `GenerationResult`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .detokenizer import IncrementalDetokenizer
from .metrics import SpecDecodingStats, json_of
from .request import Request, RequestStatus, default_finish_reason
from .stopping import StopChecker


@dataclass
class RequestOutput:
    """What one step did for one request: new tokens and text, and whether it finished.

    The `new_text` of all of a request's outputs adds up to its result's text: text that a stop
    string may still cut is held back until it is safe, and the final output brings the rest.
    finish_reason is "stop", "length", "abort" or "error".

    A step's text is decoded when `new_text` is first read, so requests whose text nobody streams
    are decoded once, when they finish. Read it before the request's next step to stream as the
    tokens come: an output read later holds the text committed up to then, and later ones the rest.
    """

    req_id: str
    new_token_ids: list[int]
    _new_text: str | None  # None: decoded from _tracked when first read
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    _tracked: TrackedRequest | None = field(default=None, repr=False, compare=False)

    @property
    def new_text(self) -> str:
        if self._new_text is None:
            self._new_text = self._tracked.stream_delta()
        return self._new_text


@dataclass
class GenerationResult:
    """A finished request."""

    req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length", "abort" or "error"
    error: str | None
    ttft_s: float | None  # arrival to first generated token
    tpot_s: float | None  # mean time per generated token after the first
    stop_reason: str | None = None  # with "stop": which rule, e.g. "stop token 2", "stop string '\\n'"
    spec: SpecDecodingStats | None = None  # acceptance of this request's drafts (with a draft)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)

    def to_json(self) -> dict:
        fields = ("prompt", "text", "token_ids", "num_generated_tokens", "finish_reason", "stop_reason", "error", "ttft_s",
                  "tpot_s")  # fmt: skip
        spec = {"spec_decoding": self.spec.to_json()} if self.spec is not None else {}
        return {"id": self.req_id, **json_of(self, *fields), **spec}


@dataclass
class TrackedRequest:
    """Engine-side state of a request: its text so far, stop rules, timings and acceptance."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    stop: StopChecker
    arrival: float = field(default_factory=time.perf_counter)
    spec: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    first_token_at: float | None = None
    finished_at: float | None = None
    num_streamed_chars: int = 0  # of the text, already handed out as RequestOutput.new_text
    num_decoded_tokens: int = 0  # output tokens the detokenizer has read (the text is decoded lazily)
    final_text: str | None = None  # set when the request finishes: stop strings cut, nothing held back

    def check_stop(self) -> tuple[RequestStatus, str] | None:
        """After a step committed tokens (request.output_token_ids has them): whether a stop rule now
        ends the request, and why. The text is decoded here only for stop strings; otherwise when read."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        return self.stop.check(self.request.output_token_ids, self.text if self.stop.needs_text else "")

    @property
    def text(self) -> str:
        """The text of the committed output tokens so far (incomplete characters held back)."""
        self._decode_new_tokens()
        return self.detokenizer.text

    def _decode_new_tokens(self) -> None:
        output = self.request.output_token_ids
        if self.num_decoded_tokens < len(output):
            self.detokenizer.add(output[self.num_decoded_tokens :])
            self.num_decoded_tokens = len(output)

    def step_output(self, tokens: list[int]) -> RequestOutput:
        """The output of a step that did not finish the request; its text is decoded when read."""
        return RequestOutput(self.request.req_id, tokens, None, False, _tracked=self)

    def stream_delta(self) -> str:
        """The text not streamed yet, less the tail that a stop string could still claim (a stop
        string cut from the final text must never have been streamed)."""
        text = self.text
        end = len(text) - self.stop.num_held_back_chars
        if end <= self.num_streamed_chars:
            return ""
        delta = text[self.num_streamed_chars : end]
        self.num_streamed_chars = end
        return delta

    def finish(self) -> RequestOutput:
        """Record the finish time and the final text; the output tells the caller the request ended
        and carries the text not streamed yet."""
        self.finished_at = time.perf_counter()
        self._decode_new_tokens()
        self.detokenizer.flush()  # a trailing incomplete character is still part of the text
        self.final_text = self.stop.trim_text(self.detokenizer.text)
        delta = self.final_text[self.num_streamed_chars :]
        self.num_streamed_chars = len(self.final_text)
        request = self.request
        return RequestOutput(request.req_id, [], delta, True, default_finish_reason(request.status), request.error)

    def result(self, *, with_spec: bool) -> GenerationResult:
        request = self.request
        ttft = tpot = None
        if self.first_token_at is not None:
            ttft = self.first_token_at - self.arrival
            if request.num_output_tokens > 1 and self.finished_at is not None:
                tpot = (self.finished_at - self.first_token_at) / (request.num_output_tokens - 1)
        return GenerationResult(
            req_id=request.req_id,
            prompt=self.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            text=self.final_text or "",
            token_ids=list(request.output_token_ids),
            finish_reason=default_finish_reason(request.status),
            error=request.error,
            ttft_s=ttft,
            tpot_s=tpot,
            stop_reason=request.finish_reason if request.status == RequestStatus.FINISHED_STOPPED else None,
            spec=self.spec if with_spec else None,
        )
