"""EleutherAI's lm-evaluation-harness on a saved run, in process: no server.

`JaxparLM` is an `lm_eval` model (registered as "jaxpar") over a saved run: loglikelihood and
loglikelihood_rolling score token sequences in batches with one compiled forward pass per
bucketed length (scoring.py); generate_until runs the inference engine. Tokenization follows
lm-eval's Hugging Face model (`--model hf`), so the two agree item by item on the same
weights exported with `jaxpar convert jaxpar-to-hf`:

    jaxpar eval runs/tiny --tasks hellaswag,lambada_openai
    lm_eval.simple_evaluate(model=JaxparLM("runs/tiny"), tasks=[...])

Needs the `eval` extra (pip install 'jaxpar[eval]').
"""

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from jaxpar.inference import Engine, SamplingParams
from jaxpar.train.scoring import Scorer
from jaxpar.weights import open_run


@register_model("jaxpar")
class JaxparLM(TemplateLM):
  """pretrained: a run dir, checkpoint dir or step dir (or `run`: an opened SavedRun);
  batch_size: rows per forward pass and sequences generated together; max_gen_toks: the
  default generation length."""

  def __init__(self, pretrained=None, *, run=None, step=None, mesh=None, batch_size=8, max_gen_toks=256, **_):
    super().__init__()
    if run is None:
      run = open_run(pretrained, mesh, None if step is None else int(step))
    self.run = run
    self.tokenizer = run.tokenizer
    self._encoder = _raw_tokenizer(self.tokenizer)
    self._batch_size = int(batch_size)
    self._max_gen_toks = int(max_gen_toks)
    self.scorer = Scorer(run.runtime, run.params, run.model_state, batch_size=self._batch_size)
    self._engine = None

  # -- what lm-eval asks of a model ---------------------------------------------------

  @property
  def eot_token_id(self) -> int:
    return self.tokenizer.eos_id

  @property
  def prefix_token_id(self) -> int:
    """What an empty context is conditioned on: bos when the tokenizer has one, as the HF model does."""
    bos = getattr(self.tokenizer, "bos_id", None)
    return self.eot_token_id if bos is None else bos

  @property
  def max_length(self) -> int:
    return self.run.runtime.model_config.max_seq_len

  def tok_encode(self, string: str, add_special_tokens=None, **_) -> list[int]:
    """As a Hugging Face tokenizer encodes (its post-processor's special tokens unless told not to)."""
    if self._encoder is None:
      return self.tokenizer.encode(string)
    return self._encoder.encode(string, add_special_tokens=add_special_tokens is not False).ids

  def tok_decode(self, tokens, skip_special_tokens=True) -> str:
    return self.tokenizer.decode(tokens)

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **_) -> list[tuple[float, bool]]:
    return self.scorer.score([(context + continuation, len(continuation))
                              for _, context, continuation in requests])

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """Each text's total log-likelihood, scored in disjoint windows of the model's context."""
    windows, owner = [], []
    for index, (text,) in enumerate(request.args for request in requests):
      for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
          token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
          context_len=1)):
        windows.append((context + continuation, len(continuation)))
        owner.append(index)
    totals = [0.0] * len(requests)
    for index, (logprob, _) in zip(owner, self.scorer.score(windows)):
      totals[index] += logprob
    return totals

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Greedy (or sampled, when a task asks) completions through the inference engine, cut at
    the task's stop strings and at eos."""
    eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
    prompts, settings, stops = [], [], []
    for context, gen_kwargs in (request.args for request in requests):
      kwargs = normalize_gen_kwargs(gen_kwargs, self._max_gen_toks)
      until = handle_stop_sequences(kwargs.pop("until", None), eos=eos or None)
      max_tokens = int(kwargs.pop("max_gen_toks"))
      prompts.append(self.tok_encode(context)[-(self.max_length - max_tokens):])
      settings.append(SamplingParams(max_tokens=max_tokens, temperature=float(kwargs.get("temperature") or 0.0),
                                     stop=tuple(u for u in until if u)))
      stops.append(until)
    completions = self.engine().generate(prompts, settings)
    return [postprocess_generated_text(c.text, until, None) for c, until in zip(completions, stops)]

  def engine(self):
    """The generation engine, built (and compiled) on first use."""
    if self._engine is None:
      self._engine = Engine.from_run(self.run, slots=self._batch_size)
    return self._engine


def _raw_tokenizer(tokenizer):
  """The `tokenizers` object behind a Hugging Face tokenizer.json (None: the byte tokenizer)."""
  path = getattr(tokenizer, "path", None)
  if path is None:
    return None
  from tokenizers import Tokenizer
  return Tokenizer.from_file(path)


def run_tasks(path, tasks: list[str], *, step=None, limit=None, batch_size=None, include_path=None,
              num_fewshot=None, log_samples=False, mesh=None) -> dict:
  """lm-eval `tasks` on a saved run: {"results": lm-eval's results dict, "table": its table}."""
  import lm_eval
  from lm_eval.tasks import TaskManager
  model = JaxparLM(path, step=step, mesh=mesh, batch_size=batch_size or 8)
  results = lm_eval.simple_evaluate(model=model, tasks=tasks, limit=limit, num_fewshot=num_fewshot,
                                    task_manager=TaskManager(include_path=include_path), log_samples=log_samples)
  return {"results": results, "table": lm_utils.make_table(results)}
