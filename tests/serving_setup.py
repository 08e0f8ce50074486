"""What the serving tests share: tokenizers trained here in the two ways Hugging Face models
add their BOS, a random-weight jaxpar checkpoint with its `jaxpar convert jaxpar-to-hf`
copy loaded in `transformers`, and `jaxpar serve`'s app on 127.0.0.1 in this process."""

import json
import socket
import threading
import time
from pathlib import Path

import jax
import numpy as np

from jaxpar.checkpoint import Checkpointer
from jaxpar.config import MeshConfig, from_dict
from jaxpar.data import copy_tokenizer_files
from jaxpar.runtime import Runtime
from tests.helpers import SMALL_MODEL

TEXTS = ["the quick brown fox jumps over the lazy dog", "the dog sleeps", "a fox runs", "{\"a\": [1, 2]}"]
# A template that writes the BOS itself, as Llama 3's does.
TEMPLATE = "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}" \
           "{% if add_generation_prompt %}<|assistant|>{% endif %}"


def train_tokenizer(directory: Path, style: str):
  """A BPE tokenizer in `directory` laid out as Llama 3's ("llama3": byte-level, the BOS
  added by a TemplateProcessing post-processor, no add_bos_token) or Llama 2's ("llama2":
  SentencePiece-like pieces with byte fallback, add_bos_token in tokenizer_config.json and
  the same rule in its post-processor, as Llama 2's files have both)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  settings = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE}
  if style == "llama3":
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials, alphabet = [eos, bos], pre_tokenizers.ByteLevel.alphabet()
  else:
    bos, eos = "<s>", "</s>"
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    specials, alphabet = ["<unk>", bos, eos] + [f"<0x{i:02X}>" for i in range(256)], []
    settings.update(add_bos_token=True, add_eos_token=False, unk_token="<unk>")
  trainer = trainers.BpeTrainer(vocab_size=300 + 256 * (style == "llama2"), special_tokens=specials,
                                initial_alphabet=alphabet)
  tokenizer.train_from_iterator(TEXTS * 20, trainer)
  tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tokenizer.token_to_id(bos))])
  settings.update(bos_token=bos, eos_token=eos)
  directory.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(settings))
  return tokenizer


def checkpoint_with_hf_copy(root: Path, style: str = "llama3", max_seq_len: int = 160, seed: int = 0):
  """A random-weight jaxpar checkpoint (SMALL_MODEL, the vocabulary at least the tokenizer's) with a `style` tokenizer, and
  its HF export loaded in transformers (float32, eager attention). -> (checkpoint, hf_dir, hf model)."""
  import torch
  import transformers

  from jaxpar.convert.hf import jaxpar_to_hf
  vocab = -(-train_tokenizer(root / "tok", style).get_vocab_size() // 64) * 64
  config = from_dict({"model": {**SMALL_MODEL, "vocab_size": max(vocab, SMALL_MODEL["vocab_size"]),
                                "max_seq_len": max_seq_len}, "mesh": {"fsdp": 1},
                      "data": {"seq_len": 32}})
  runtime = Runtime(config.model, MeshConfig(fsdp=1), jax.devices()[:1], seed=seed)
  params, _ = runtime.init()
  # Larger weights than the initialiser's: a random model's distribution is then far from
  # uniform, so greedy choices and top alternatives are well separated.
  params = jax.tree.map(lambda x: x * 2 if x.ndim >= 3 else x, params)
  with Checkpointer(root / "ckpt") as checkpoints:
    checkpoints.save(0, {"params": params}, config=config, force=True)
  copy_tokenizer_files(root / "tok", root / "ckpt" / "tokenizer")
  hf_dir = jaxpar_to_hf(root / "ckpt", root / "hf")
  model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
  return root / "ckpt", hf_dir, model


def random_checkpoint(root: Path, model: dict) -> Path:
  """A random-weight checkpoint of `model` (weights doubled: well-separated greedy choices)
  with a BPE tokenizer trained here, at root/ckpt."""
  from tests.test_data import _train_hf_tokenizer
  (root / "tok").mkdir(parents=True)
  _train_hf_tokenizer(root / "tok" / "tokenizer.json")
  (root / "tok" / "tokenizer_config.json").write_text(json.dumps({}))
  config = from_dict({"model": model, "mesh": {"fsdp": 1}, "data": {"seq_len": 32}})
  params, _ = Runtime(config.model, MeshConfig(fsdp=1), jax.devices()[:1]).init()
  params = jax.tree.map(lambda x: x * 2 if x.ndim >= 3 else x, params)
  with Checkpointer(root / "ckpt") as checkpoints:
    checkpoints.save(0, {"params": params}, config=config, force=True)
  copy_tokenizer_files(root / "tok", root / "ckpt" / "tokenizer")
  return root / "ckpt"


def hf_logprobs(model, ids: list[int]) -> np.ndarray:
  """log_softmax of transformers' logits at every position of `ids` [len, vocab]."""
  import torch
  with torch.no_grad():
    logits = model(torch.tensor([ids])).logits[0].double()
  return torch.log_softmax(logits, -1).numpy()


class RunningServer:
  """`build_app(engine)` under uvicorn on a thread, on 127.0.0.1; `client` is the official
  openai client (no retries)."""

  def __init__(self, engine, model_name: str, **options):
    import openai
    import uvicorn

    from jaxpar.inference.server import build_app
    self.engine, self.model_name = engine, model_name
    self.app = build_app(engine, model_name=model_name, **{"grace_s": 5, **options})
    self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning"))
    self._thread = threading.Thread(target=self._server.run, daemon=True)
    self._thread.start()
    deadline = time.monotonic() + 60
    while not self._server.started:
      assert time.monotonic() < deadline, "the server did not start"
      time.sleep(0.05)
    self.port = self._server.servers[0].sockets[0].getsockname()[1]  # port 0: the one it bound
    self.url = f"http://127.0.0.1:{self.port}"
    self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

  def post(self, path: str, body) -> tuple[int, dict, dict]:
    """A raw POST -> (status, JSON body, headers)."""
    import http.client
    connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
    connection.request("POST", path, body=body if isinstance(body, (bytes, str)) else json.dumps(body),
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    data = response.read()
    headers = {k.lower(): v for k, v in response.getheaders()}
    connection.close()
    return response.status, json.loads(data) if data else None, headers

  def get(self, path: str) -> tuple[int, bytes]:
    import http.client
    connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
    connection.request("GET", path)
    response = connection.getresponse()
    data = response.read()
    connection.close()
    return response.status, data

  def close(self):
    self._server.should_exit = True
    self._thread.join(timeout=30)


class CliServer:
  """`jaxpar serve ARGS --port 0` in a child process: the port is the one it prints when it
  has bound it (no free-port race); `output` collects everything it printed."""

  def __init__(self, *args, env=None, timeout_s: float = 240):
    import queue
    import re
    import subprocess
    import sys
    env = {**__import__("os").environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", **(env or {})}
    self.child = subprocess.Popen([sys.executable, "-m", "jaxpar", "serve", *map(str, args), "--port", "0"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    self.lines: queue.SimpleQueue = queue.SimpleQueue()
    self.output = []
    threading.Thread(target=lambda: [self.lines.put(line) for line in self.child.stdout] + [self.lines.put(None)],
                     daemon=True).start()
    deadline, self.port = time.monotonic() + timeout_s, None
    while self.port is None:
      line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.1))
      assert line is not None, "".join(self.output)  # it exited before serving
      self.output.append(line)
      found = re.search(r" on http://127\.0\.0\.1:(\d+)/v1", line)
      self.port = int(found[1]) if found else None
    while True:  # bound, then listening once uvicorn has started
      assert self.child.poll() is None and time.monotonic() < deadline, "".join(self.output)
      try:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1):
          break
      except OSError:
        time.sleep(0.1)

  def rest_of_output(self) -> str:
    """Everything it printed, once it has exited."""
    while (line := self.lines.get(timeout=60)) is not None:
      self.output.append(line)
    return "".join(self.output)

  def stop(self):
    import signal
    import subprocess
    if self.child.poll() is None:
      self.child.send_signal(signal.SIGTERM)
      try:
        self.child.wait(timeout=60)
      except subprocess.TimeoutExpired:
        self.child.kill()
