"""Chat prompts rendered with the model's own chat template (Jinja, as Hugging Face ships
it in tokenizer_config.json or chat_template.jinja), in a sandbox."""

import functools

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
  """The template refused the conversation (its raise_exception), or is broken."""


def _raise(message):
  raise TemplateError(message)


@functools.lru_cache(maxsize=8)
def _compile(source: str):
  environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  environment.globals["raise_exception"] = _raise
  return environment.from_string(source)


def render_chat(template: str, messages: list[dict], *, bos_token: str = "", eos_token: str = "",
                add_generation_prompt: bool = True) -> str:
  """The prompt text for `messages` ([{role, content}]), ending where the assistant answers
  (with add_generation_prompt)."""
  try:
    return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=bos_token, eos_token=eos_token)
  except jinja2.TemplateError as e:
    raise TemplateError(f"the model's chat template failed: {e}") from None
