"""How requests reach the engine: prompts encoded and checked, queued from any thread,
cancelled at a step boundary (`Engine` inherits these)."""

from jaxpar.inference.requests import Request, check_tokens
from jaxpar.inference.sampling import GREEDY, RequestError, SamplingParams


class RequestIntake:
  def encode(self, prompt, add_special_tokens: bool = True) -> list[int]:
    """Text -> prompt token ids, with the special tokens (BOS) the tokenizer adds to prompts as
    `transformers` does; token ids pass as they are."""
    if isinstance(prompt, str):
      return self.tokenizer.encode_prompt(prompt, add_special_tokens)
    return [int(t) for t in prompt]

  def make_request(self, prompt, sampling: SamplingParams = GREEDY, on_event=None,
                   adapter: str | None = None) -> Request:
    """A checked Request for a prompt (text or token ids), not yet queued; `adapter`: the name
    of a stacked adapter to generate with (None: the base)."""
    if adapter is not None and adapter not in self.adapters:
      raise RequestError("model", f"no adapter {adapter!r} is served: choose one of {list(self.adapters)} "
                         "or none for the base model")
    stops = sampling.stop_token_ids
    if stops is None:
      stops = () if self.tokenizer is None else (self.tokenizer.eos_id,)
    if self.draft is not None and (sampling.logprobs or sampling.logit_bias or sampling.penalized
                                   or sampling.top_logprobs or sampling.min_tokens):
      raise RequestError("logprobs", "speculative decoding reports no log-probabilities and applies no penalties, "
                         "biases or min_tokens: drop them, or serve without a draft")
    ids = self.encode(prompt)
    check_tokens(ids, sampling, stops, self.runtime.model_config.vocab_size, self.max_seq_len)
    request = Request(ids, sampling, tuple(stops), on_event)
    request.adapter = 0 if adapter is None else self.adapters.index(adapter) + 1
    return request

  def submit(self, prompt, sampling: SamplingParams = GREEDY, on_event=None, adapter: str | None = None) -> Request:
    """Queue a prompt (text or token ids); thread-safe. on_event(TokenEvent) is called from
    the thread that runs `step`."""
    request = self.make_request(prompt, sampling, on_event, adapter)
    self.enqueue(request)
    return request

  def enqueue(self, request: Request):
    """Queue a request made by `make_request` (thread-safe)."""
    self._inbox.put(request)

  def cancel(self, request: Request):
    """Stop a request at the next step boundary (thread-safe); it ends "cancelled"."""
    request.cancelled = True

  @property
  def pending(self) -> int:
    return self._inbox.qsize() + len(self.waiting)

  @property
  def has_work(self) -> bool:
    return not self._inbox.empty() or bool(self.waiting) or any(self.slots)
