"""`jaxpar generate` and `jaxpar serve`: generation from the command line.

    jaxpar generate RUN --prompt "..." [--max-tokens N --temperature T ...]
    jaxpar generate RUN --prompts-file prompts.txt --output results.jsonl
    jaxpar generate RUN --chat --prompt "What is 2 plus 3?"   # prints the answer only
    jaxpar serve RUN [mesh.tensor=8] [--host 127.0.0.1 --port 8000]
    jaxpar serve BASE --adapter sql=runs/sql-lora --adapter chat=runs/chat-lora
    jaxpar serve RUN mesh.tensor=4 --replicas 2     # two engines of 4 devices each, one server
(RUN: a run dir, its checkpoints dir or one step dir; `--checkpoint RUN` says the same.)
"""

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console

from jaxpar.cluster import distributed
from jaxpar.errors import ConfigError, DataError, UserError
from jaxpar.parallel import parse_mesh_sizes
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

console = Console(soft_wrap=True)
notes = Console(stderr=True, soft_wrap=True)  # progress and notes: stdout carries only the text


def add_engine_args(parser):
  """Options shared by `generate` and `serve`: what to load and how to lay it out."""
  parser.add_argument("--checkpoint", metavar="RUN",
                      help="the same as the positional RUN: a run dir, its checkpoints dir or one step dir")
  parser.add_argument("--chat-template", metavar="FILE",
                      help="the chat template (a .jinja file, or chatml) for chat prompts (generate --chat, "
                      "serve's /v1/chat/completions); default: the run's data.chat_template, else its tokenizer's")
  parser.add_argument("mesh", nargs="*", metavar="RUN mesh.AXIS=SIZE",
                      help="the run to load (a run dir, its checkpoints dir or one step dir; or --checkpoint "
                      "RUN), then mesh axis sizes, e.g. mesh.tensor=8 (default: every device holds the "
                      "whole model; rows split over the devices when they divide)")
  parser.add_argument("--slots", type=int, default=8, help="sequences decoded together (default 8)")
  parser.add_argument("--max-seq-len", type=int, help="longest prompt + completion (default: the model's)")
  parser.add_argument("--page-size", type=int, default=16, help="KV cache page size in tokens")
  parser.add_argument("--num-pages", type=int, help="KV cache pages (default: every slot at max length)")
  parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                      help="share the KV pages of prompt blocks requests have in common (default: on)")
  parser.add_argument("--kv-cache", choices=("float", "int8", "int4", "int2"), default="float",
                      help="store the KV cache quantized: int8 per token, or KIVI int4/int2 (keys per "
                      "channel, values per token); each sequence's newest page stays float")
  parser.add_argument("--decode-burst", type=int, default=1, metavar="K",
                      help="decode steps per device call while no request needs the host between "
                      "tokens: fewer round trips, tokens streamed K at a time (default 1)")
  parser.add_argument("--speculative",
                      metavar="draft=PATH,k=K | ngram,k=K,n=N | medusa[=HEADS],k=K|tree=N | mtp,k=K",
                      help="speculative decoding: the checkpoint at PATH (a smaller model on the same tokenizer), "
                      "prompt lookup (ngram: what followed the latest earlier occurrence of the last N tokens, "
                      "default 3), Medusa draft heads (the run's own, or those of the run HEADS trained with "
                      "train.objective=medusa over this one) or the model's own multi-token-prediction module "
                      "(mtp: DeepSeek-V3's) propose up to K tokens (default 4; medusa: one per head, or a tree "
                      "of N candidates from the heads' top guesses; mtp: 1) that the model checks in one "
                      "pass; the same greedy tokens, the same sampling distribution. serve: add default=off for "
                      "requests to opt in with \"speculative\": true")


def add_sampling_args(parser):
  parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
  parser.add_argument("--temperature", type=float,
                      help="0: greedy (default: the run's train.sample_temperature, 0.8 unless its config "
                      "says otherwise; serve uses it too for requests that leave it out)")
  parser.add_argument("--top-k", type=int, default=0, help="0: off (default)")
  parser.add_argument("--top-p", type=float, help="1: off (default: the run's train.sample_top_p, 0.95 unless its "
                      "config says otherwise; serve's too)")
  parser.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
  parser.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
  parser.add_argument("--logprobs", action="store_true", help="report each token's log-probability")


def speculative_options(text: str) -> dict:
  """`draft=PATH,k=4` -> {"draft": PATH, "k": 4, "default": True}; `ngram,k=4,n=3,default=off`
  -> {"ngram": True, "k": 4, "n": 3, "default": False}; `medusa` or `medusa=HEADS,k=3` ->
  {"medusa": None or HEADS, "k": None or 3, ...}; `mtp,k=2` -> {"mtp": True, "k": 2, ...}
  (default: whether requests that leave the `speculative` field out take the draft tokens)."""
  items = text.split(",")
  source, _, value = items[0].partition("=")
  ngram, medusa, mtp = items[0] == "ngram", source == "medusa", items[0] == "mtp"
  options = dict(item.partition("=")[::2] for item in items[ngram or medusa or mtp:])
  allowed = ({"k", "n", "default"} if ngram else {"k", "tree", "default"} if medusa else {"k", "default"} if mtp
             else {"draft", "k", "default"})
  numbers = all(options.get(key, "1").isdigit() for key in ("k", "n", "tree"))
  if (set(options) - allowed or not (ngram or medusa or mtp or options.get("draft")) or not numbers
      or options.get("default", "on") not in ("on", "off")):
    raise ConfigError(f"--speculative {text!r}: write draft=PATH[,k=K], ngram[,k=K][,n=N], "
                      "medusa[=HEADS_RUN][,k=K | ,tree=NODES] or mtp[,k=K], each with [,default=on|off], e.g. "
                      "--speculative draft=runs/small,k=4, --speculative ngram,k=4 or --speculative medusa,tree=16")
  common = {"k": int(options.get("k", 1 if mtp else 4)), "default": options.get("default", "on") == "on"}
  if mtp:
    return {"mtp": True, **common}
  if ngram:
    return {"ngram": True, "n": int(options.get("n", 3)), **common}
  if medusa:  # k: one proposal per head unless given; tree: a candidate tree of that many nodes instead
    return {**common, "medusa": value or None, "k": int(options["k"]) if "k" in options else None,
            "tree": int(options["tree"]) if "tree" in options else None}
  return {"draft": options["draft"], **common}


def take_run_argument(ns):
  """`jaxpar serve RUN` (as `vllm serve MODEL`) or `--checkpoint RUN`: ns.checkpoint from
  either, the mesh sizes apart."""
  runs = [item for item in ns.mesh if "=" not in item]
  ns.mesh = [item for item in ns.mesh if "=" in item]
  if len(runs) + (ns.checkpoint is not None) != 1:
    raise UserError(f"give the run to load once, e.g. jaxpar {ns.command} runs/tiny (or --checkpoint runs/tiny); "
                    f"got {[*runs, *([ns.checkpoint] if ns.checkpoint else [])] or 'none'}")
  ns.checkpoint = ns.checkpoint or runs[0]


def build_engine(ns, echo=None, devices=None, **options):
  """The engine `generate` and `serve` run, on `devices` (default: all)."""
  from jaxpar.inference import Engine
  from jaxpar.inference.mtp import MtpDraft
  from jaxpar.inference.speculative import DraftModel, NgramDraft
  mesh = parse_mesh_sizes(ns.mesh) or None
  spec = speculative_options(ns.speculative) if ns.speculative else {}
  if spec.get("ngram"):
    options["speculative"] = NgramDraft(spec["k"], max_n=spec["n"])
  elif spec.get("mtp"):
    options["speculative"] = MtpDraft(spec["k"])
  elif "medusa" in spec:
    return _medusa_engine(ns, mesh, spec, echo, devices, options)
  elif spec:
    if echo:
      echo(f"loading the speculative draft {spec['draft']}")
    draft = Engine.from_checkpoint(spec["draft"], mesh=mesh, devices=devices, slots=ns.slots, max_seq_len=ns.max_seq_len,
                                   page_size=ns.page_size, prefix_caching=False)
    options["speculative"] = DraftModel(draft, spec["k"])
  return Engine.from_checkpoint(ns.checkpoint, mesh=mesh, devices=devices, **_engine_options(ns), echo=echo,
                                **options)


def _engine_options(ns) -> dict:
  return dict(slots=ns.slots, max_seq_len=ns.max_seq_len, page_size=ns.page_size, num_pages=ns.num_pages,
              kv_cache=ns.kv_cache, prefix_caching=ns.prefix_caching, decode_burst=ns.decode_burst)


def _medusa_engine(ns, mesh, spec, echo, devices, options):
  """The engine over the run's own draft heads, or over heads attached from spec["medusa"]."""
  from jaxpar.inference import Engine
  from jaxpar.inference.medusa import MedusaDraft, with_heads
  from jaxpar.weights import open_run
  options["speculative"] = MedusaDraft(spec["k"], tree=spec["tree"])
  with open_run(ns.checkpoint, mesh or {"data": -1, "fsdp": 1}, devices=devices) as run:
    if spec["medusa"] is None:
      return Engine.from_run(run, **_engine_options(ns), echo=echo, **options)
    if echo:
      echo(f"attaching the draft heads of {spec['medusa']}")
    runtime, params, model_state = with_heads(run, spec["medusa"])
    return Engine(runtime, params, run.tokenizer, model_state=model_state, **_engine_options(ns), echo=echo,
                  **options)


def sampling_from(ns, **overrides):
  from jaxpar.inference import SamplingParams
  return SamplingParams(**{"max_tokens": ns.max_tokens, "temperature": ns.temperature, "top_k": ns.top_k,
                           "top_p": ns.top_p, "seed": ns.seed, "stop": tuple(ns.stop),
                           "logprobs": ns.logprobs, **overrides})


def _read_prompts(path: Path) -> list[dict]:
  """One prompt per line, or JSONL records with "prompt" (and optional sampling fields)."""
  records = []
  for number, line in enumerate(path.read_text().splitlines(), 1):
    if not line.strip():
      continue
    if line.lstrip().startswith("{"):
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f"{path}:{number}: not valid JSON ({e.msg})") from None
      if not isinstance(record.get("prompt"), str):
        raise DataError(f"{path}:{number}: a JSONL record needs a \"prompt\" string")
      records.append(record)
    else:
      records.append({"prompt": line})
  if not records:
    raise DataError(f"{path} holds no prompts")
  return records


def run_defaults(ns) -> tuple:
  """Before anything compiles: (the saved run's tokenizer, the context its engine will have,
  its sampling defaults: {"temperature", "top_p"} of its closing sample, generate's and serve's)."""
  from jaxpar.weights import SavedRun
  with SavedRun(ns.checkpoint) as run:
    config, tokenizer = run.config, run.tokenizer
  longest = config.model.max_seq_len
  sampling = {"temperature": config.train.sample_temperature, "top_p": config.train.sample_top_p}
  return tokenizer, min(ns.max_seq_len or longest, longest), sampling


def _check_room(records, encode, max_tokens: int, limit: int, source: str):
  """Each prompt and its max_tokens fit the context (requests.completion_room: the rule serve
  answers 400 by), checked before anything compiles."""
  from jaxpar.inference.requests import completion_room
  from jaxpar.inference.sampling import RequestError
  for number, record in enumerate(records, 1):
    try:
      completion_room(len(encode(record["prompt"])), record.get("max_tokens", max_tokens), limit)
    except RequestError as e:
      raise RequestError(e.field, f"{source if len(records) == 1 else f'prompt {number} of {source}'}: {e}") from None


def run_chat_renderer(checkpoint, template=None):
  """(the chat renderer of a saved run: `template` (--chat-template), else its data.chat_template,
  else its tokenizer's; None where it has none, the run's tokenizer)."""
  from jaxpar.data.chat_batches import chat_renderer
  from jaxpar.weights import SavedRun
  with SavedRun(checkpoint) as run:
    data, tokenizer = run.config.data, run.tokenizer
  if not template and data.chat_template not in (None, "chatml") and not Path(data.chat_template).is_file():
    raise ConfigError(f"{checkpoint}'s data.chat_template={data.chat_template} is not there any more: run from the "
                      "directory it trained in, or give --chat-template FILE")
  if not template and not data.chat_template and not tokenizer.chat_template:
    return None, tokenizer
  return chat_renderer(data, tokenizer, template), tokenizer


def chat_turns(ns):
  """For --chat, before anything compiles: (user text -> prompt token ids, rendered with the
  run's chat template up to where the assistant answers; the stop settings that end the
  answer at the template's end of turn: its token when it is one, else its text)."""
  renderer, tokenizer = run_chat_renderer(ns.checkpoint, ns.chat_template)
  if renderer is None:
    raise ConfigError(f"--chat: {ns.checkpoint} has no chat template (no data.chat_template in its config, none "
                      "in its tokenizer): give --chat-template FILE (or chatml), or drop --chat and write the "
                      "prompt in the model's format")
  system = [{"role": "system", "content": ns.system}] if ns.system else []

  def prompt_ids(text: str) -> list[int]:
    # Tokenized as SFT tokenized it: the template writes the special tokens, none are added.
    return tokenizer.encode(renderer.render(system + [{"role": "user", "content": text}], True))

  end = renderer.end_of_turn()
  end_ids = tokenizer.encode(end) if end else []
  if len(end_ids) == 1:
    return prompt_ids, {"stop_token_ids": (tokenizer.eos_id, end_ids[0])}
  return prompt_ids, {"stop": (*ns.stop, end) if end else tuple(ns.stop)}


def cmd_generate(ns):
  take_run_argument(ns)
  if (ns.prompt is None) == (ns.prompts_file is None):
    raise UserError("give --prompt TEXT or --prompts-file FILE (one of them)")
  if ns.prompts_file and not ns.output:
    raise UserError("--prompts-file needs --output FILE.jsonl for the results")
  if ns.system and not ns.chat:
    raise UserError("--system needs --chat (the system prompt goes through the chat template)")
  records = _read_prompts(Path(ns.prompts_file)) if ns.prompts_file else None
  tokenizer, limit, run_sampling = run_defaults(ns)
  default = {key: value for key, value in run_sampling.items() if getattr(ns, key) is None}
  sampling, encode = sampling_from(ns, **default), None
  if ns.chat:
    encode, stops = chat_turns(ns)
    sampling = sampling_from(ns, **default, **stops)
  _check_room(records or [{"prompt": ns.prompt}], encode or (lambda text: tokenizer.encode_prompt(text, True)),
              sampling.max_tokens, limit, ns.prompts_file or "--prompt")
  engine = build_engine(ns, echo=lambda text: notes.print(text, style="dim", highlight=False))
  if records is None:
    out = sys.stdout if distributed.is_primary() else open(os.devnull, "w")
    if encode is None:
      out.write(ns.prompt)
    for event in engine.stream(ns.prompt if encode is None else encode(ns.prompt), sampling):
      out.write(event.text)
      out.flush()
    out.write("\n")
    return
  _generate_file(engine, records, sampling, Path(ns.output), encode)


def _generate_file(engine, records, sampling, output: Path, encode=None):
  import dataclasses
  encode = encode or (lambda prompt: prompt)
  requests = [engine.submit(encode(r["prompt"]), dataclasses.replace(
      sampling, **{k: (tuple(v) if k == "stop" else v) for k, v in r.items() if k != "prompt"}))
              for r in records]
  progress = Progress(TextColumn("[bold]generate"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      console=notes)
  with progress, (output.open("w") if distributed.is_primary() else open(os.devnull, "w")) as out:
    task = progress.add_task("generate", total=len(requests))
    while engine.has_work:
      engine.step()
      progress.update(task, completed=sum(r.finish_reason is not None for r in requests))
    for record, request in zip(records, requests):
      done = request.completion()
      out.write(json.dumps({"prompt": record["prompt"], "text": done.text, "tokens": done.tokens,
                            "finish_reason": done.finish_reason, "logprobs": done.logprobs}) + "\n")
  notes.print(f"wrote {len(requests)} completions to {output}")


def adapter_paths(items, base_name: str) -> dict:
  """`--adapter NAME=PATH` arguments -> {NAME: PATH}, in order."""
  adapters = {}
  for item in items:
    name, _, path = item.partition("=")
    if not name or not path:
      raise ConfigError(f"--adapter {item!r}: write NAME=PATH, e.g. --adapter sql=runs/sql-lora")
    if name in adapters or name == base_name:
      raise ConfigError(f"--adapter {item!r}: the name {name!r} is taken (by the base model or another "
                        "adapter): give each adapter its own")
    adapters[name] = path
  return adapters


def cmd_serve(ns):
  take_run_argument(ns)
  from jaxpar.cluster.preemption import stop_on_signals
  from jaxpar.inference.lockstep import Lockstep, check_servable
  from jaxpar.inference.disaggregated import Disaggregated, split_devices
  from jaxpar.inference.replicas import Replicas, device_groups
  from jaxpar.inference.server import serve
  from jaxpar.weights import run_name
  name = ns.model_name or run_name(ns.checkpoint)
  adapters = adapter_paths(ns.adapter, name)
  chat = run_chat_renderer(ns.checkpoint, ns.chat_template)[0]  # checked before compiling
  sampling = run_defaults(ns)[2]
  if ns.speculative:  # for requests that leave `speculative` out
    sampling["speculative"] = speculative_options(ns.speculative)["default"]
  if distributed.is_multiprocess():
    check_servable(ns.replicas, ns.prefill_devices)
  # Checked before compiling: N replicas, or prefill then decode devices, or every device.
  if ns.prefill_devices:
    groups = split_devices(ns.prefill_devices, ns.replicas, speculative=bool(ns.speculative))
  else:
    groups = device_groups(ns.replicas) if ns.replicas != 1 else [None]

  def echo(text):
    if distributed.is_primary():  # one voice: process 0's
      notes.print(text, style="dim", highlight=False)
  engines = []
  for number, devices in enumerate(groups, 1):
    if devices is not None:
      role = ("prefill" if number == 1 else "decode") if ns.prefill_devices else f"replica {number} of {len(groups)}"
      echo(f"{role}: devices {', '.join(str(d.id) for d in devices)}")
    # Every program compiled before the first request: serving never pauses to compile.
    engines.append(build_engine(ns, echo=echo, devices=devices, compile_extras=True, adapters=adapters))
  engine = Disaggregated(*engines) if ns.prefill_devices else Replicas(engines) if len(engines) > 1 else engines[0]
  lockstep = Lockstep(engine) if distributed.is_multiprocess() else None
  if lockstep is not None and not distributed.is_primary():
    with stop_on_signals():  # SIGTERM drains process 0's server, which then tells this one to stop
      lockstep.follow()
    return
  served = ", ".join(repr(n) for n in (name, *adapters))
  slots = f"{len(engines)} replicas x {ns.slots} slots" if len(engines) > 1 else f"{ns.slots} slots"
  slots = f"prefill on {ns.prefill_devices} devices, {ns.slots} decode slots" if ns.prefill_devices else slots
  compile_s = sum(e.compile_s for e in engines)
  announce = lambda url: notes.print(f"serving {served} on {url} ({slots}, context "  # noqa: E731
                                     f"{engines[0].max_seq_len}, compiled in {compile_s:.0f} s)", highlight=False)
  try:
    serve(engine, model_name=name, host=ns.host, port=ns.port, max_queue=ns.max_queue, grace_s=ns.grace_s,
          announce=announce, chat=chat, sampling=sampling)
  finally:
    if lockstep is not None:
      lockstep.finish()


def add_parsers(commands):
  generate = commands.add_parser(
      "generate", help="generate text from a checkpoint",
      description="Load a jaxpar checkpoint (with its tokenizer) and complete a prompt, streaming "
      "the text, or every prompt of a file (JSONL results).")
  add_engine_args(generate)
  generate.add_argument("--prompt", help="the prompt text")
  generate.add_argument("--prompts-file", metavar="FILE",
                        help="one prompt per line, or JSONL with \"prompt\" and sampling fields")
  generate.add_argument("--output", metavar="FILE.jsonl", help="results of --prompts-file")
  generate.add_argument("--chat", action="store_true",
                        help="each prompt is a user's turn: render it with the run's chat template "
                        "(data.chat_template, else the tokenizer's) and print only the assistant's "
                        "answer, which ends at the template's end of turn")
  generate.add_argument("--system", metavar="TEXT", help="with --chat: a system message before the user's turn")
  add_sampling_args(generate)
  # Every process runs the same prompts in lock step (one SPMD program); process 0 writes.
  distributed.add_distributed_args(generate)
  generate.set_defaults(func=cmd_generate)

  serve = commands.add_parser(
      "serve", help="serve a checkpoint over an OpenAI-compatible HTTP API",
      description="/v1/completions, /v1/chat/completions (with the model's chat template), /v1/models "
      "and /health, driven by the continuous-batching engine. SIGTERM drains and exits 0.")
  add_engine_args(serve)
  serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
  serve.add_argument("--port", type=int, default=8000, help="port to listen on (0: a free one, printed)")
  serve.add_argument("--model-name", help="the model id clients send (default: the run's name, e.g. tiny for runs/tiny)")
  serve.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                     help="also serve this LoRA adapter checkpoint (trained over the base) as model NAME; "
                     "repeatable: requests for the base and every adapter share each batch")
  serve.add_argument("--replicas", type=int, default=1, metavar="N",
                     help="N engines, each on its own 1/N of the devices (the mesh sizes apply to each) with its "
                     "own cache, behind this one server; a request goes to the replica caching its prompt's "
                     "prefix unless that one is busier than the least loaded by more than its slots (default 1)")
  serve.add_argument("--prefill-devices", type=int, metavar="N",
                     help="disaggregated prefill: write prompts on the first N devices and decode on the rest (the "
                     "mesh sizes apply to each), each prompt's KV pages moved across when written: long prompts "
                     "never stall the running decodes")
  serve.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429 (default 64)")
  serve.add_argument("--grace-s", type=float, default=30.0,
                     help="on SIGTERM, seconds running requests get to finish (default 30)")
  # Several processes (launch-local, a pod): one engine over all their devices; process 0
  # serves HTTP and the others run its device calls in lock step (lockstep.py).
  distributed.add_distributed_args(serve)
  serve.set_defaults(func=cmd_serve)
