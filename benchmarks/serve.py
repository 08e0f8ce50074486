"""Serving under load: `jaxpar serve` driven by a real load generator (NVIDIA's aiperf).

    python -m venv /tmp/aiperf && /tmp/aiperf/bin/pip install aiperf     # its own venv: many deps
    python benchmarks/serve.py --aiperf /tmp/aiperf/bin/aiperf [--models tiny bench-20m]
        [--concurrency 1 4 8] [--requests 48] [--isl 128] [--osl 64] [--prefix 256]
        [--layouts 1x1 2x1 1x2 pd]

For each model (random weights, saved as a checkpoint with a byte-level Hugging Face
tokenizer that names every id, so the load generator counts and sees every token), the script starts `jaxpar serve` on
127.0.0.1 and runs aiperf's streaming completions profile at each concurrency: `--requests`
requests of `--isl` random prompt tokens (plus a `--prefix`-token prefix all requests
share) and `--osl` output tokens (ignore_eos, as load generators send it). It does so with
the prefix cache on and off, and prints request throughput, output tokens/s, and TTFT and
inter-token latency percentiles as aiperf measured them. `--layouts RxP` serve each setting
as R replicas (`jaxpar serve --replicas R`) in P processes (`jaxpar launch-local P -- serve`,
one engine in lock step), all on the same `--devices` simulated devices (default: the
largest R or P, at least 2 with `pd`) and with the same `--slots` in all (split among the
replicas); `pd` is disaggregated prefill (`--prefill-devices`: half the devices write
prompts, the other half decode with the slots): one engine against several behind one
server, one process against several, co-located against disaggregated, side by side.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def byte_tokenizer(directory: Path, vocab: int):
  """jaxpar's byte tokenizer as a tokenizer.json (bytes 0-255, <|endoftext|> 256, <|bos|> 257),
  with the model's other ids as plain tokens "<tN>": a random model's every token then has
  text, so the load generator sees each one arrive."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  table = _bytes_to_unicode()
  tokenizer = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.add_special_tokens(["<|endoftext|>", "<|bos|>"])
  tokenizer.add_tokens([f"<t{i}>" for i in range(258, vocab)])
  directory.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<|bos|>"}))


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's printable stand-in for each byte (what the ByteLevel pre-tokenizer emits)."""
  keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
  table, extra = {b: chr(b) for b in keep}, 0
  for b in range(256):
    if b not in table:
      table[b], extra = chr(256 + extra), extra + 1
  return table


def checkpoint(name: str, root: Path, max_seq_len: int) -> Path:
  """A random-weight checkpoint of config `name` with the byte tokenizer beside it."""
  import jax

  from jaxpar.checkpoint import Checkpointer
  from jaxpar.config import MeshConfig, load_config
  from jaxpar.data import copy_tokenizer_files
  from jaxpar.runtime import Runtime
  config = load_config(name, [f"model.max_seq_len={max_seq_len}", "mesh.fsdp=1"])
  runtime = Runtime(config.model, MeshConfig(fsdp=1), jax.devices()[:1])
  params, _ = runtime.init()
  path = root / name
  with Checkpointer(path) as checkpoints:
    checkpoints.save(0, {"params": params}, config=config, force=True)
  byte_tokenizer(root / f"{name}-tokenizer", config.model.vocab_size)
  copy_tokenizer_files(root / f"{name}-tokenizer", path / "tokenizer")
  return path


def prefix_cache_modes() -> list:
  """[True, False] when `jaxpar serve` has --prefix-caching, else [None] (one run, as it serves)."""
  help_text = subprocess.run([sys.executable, "-m", "jaxpar", "serve", "--help"], capture_output=True, text=True).stdout
  return [True, False] if "--prefix-caching" in help_text else [None]


def parse_layout(text: str) -> tuple[int, int, bool]:
  """`RxP` -> (R replicas, P processes, False); `pd` -> (1, 1, True): disaggregated prefill."""
  return (1, 1, True) if text == "pd" else (*map(int, text.split("x")), False)


def start_server(path: Path, port: int, slots: int, prefix_caching, log: Path, replicas: int = 1,
                 processes: int = 1, devices: int = 1, disaggregated: bool = False) -> subprocess.Popen:
  """`jaxpar serve` on `devices` simulated devices (over `processes` processes in lock step):
  `slots` in all, split among `replicas`; the rows of each engine spread over its devices;
  `disaggregated`: prompts written on half the devices, decoded on the other half."""
  flags = [] if prefix_caching is None else ["--prefix-caching" if prefix_caching else "--no-prefix-caching"]
  flags += ["--replicas", str(replicas)] if replicas > 1 else []
  flags += ["--prefill-devices", str(devices // 2)] if disaggregated else []
  env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
  launch = ["launch-local", str(processes), "--devices-per-process", str(devices // processes), "--"]
  serve = ["serve", "--checkpoint", str(path), "--port", str(port), "--slots", str(slots // replicas), "--model-name",
           "bench", *flags, "mesh.data=-1", "mesh.fsdp=1"]
  child = subprocess.Popen([sys.executable, "-m", "jaxpar", *(launch if processes > 1 else []), *serve],
                           stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
  deadline = time.monotonic() + 900
  while time.monotonic() < deadline:
    if child.poll() is not None:
      raise SystemExit(f"jaxpar serve exited {child.returncode}: see {log}")
    try:
      with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
        if answer.status == 200:
          return child
    except OSError:
      time.sleep(1)
  child.kill()
  raise SystemExit(f"jaxpar serve did not come up in 15 minutes: see {log}")


def profile(aiperf: str, port: int, tokenizer: Path, concurrency: int, args, out: Path) -> dict:
  command = [aiperf, "profile", "--model", "bench", "--url", f"http://127.0.0.1:{port}", "--endpoint-type",
             "completions", "--streaming", "--concurrency", str(concurrency), "--request-count", str(args.requests),
             "--isl", str(args.isl), "--osl", str(args.osl), "--extra-inputs", "ignore_eos:true",
             "--use-server-token-count", "--tokenizer", str(tokenizer), "--ui", "none", "--random-seed", "0",
             "--warmup-request-count", str(concurrency), "--artifact-dir", str(out)]
  if args.prefix:
    command += ["--prefix-prompt-length", str(args.prefix), "--prefix-prompt-pool-size", "1"]
  done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
  if done.returncode:
    raise SystemExit(f"aiperf failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
  return json.loads((out / "profile_export_aiperf.json").read_text())


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--aiperf", default="aiperf", help="the aiperf executable")
  parser.add_argument("--models", nargs="+", default=["tiny", "bench-20m"])
  parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
  parser.add_argument("--requests", type=int, default=48)
  parser.add_argument("--isl", type=int, default=128, help="random prompt tokens per request")
  parser.add_argument("--osl", type=int, default=64, help="output tokens per request")
  parser.add_argument("--prefix", type=int, default=256, help="prompt tokens every request shares (0: none)")
  parser.add_argument("--slots", type=int, default=8, help="slots in all (split among replicas)")
  parser.add_argument("--layouts", nargs="+", default=["1x1"], metavar="RxP|pd",
                      help="serve each setting as R replicas in P processes, or disaggregated (pd) (default 1x1)")
  parser.add_argument("--devices", type=int, help="simulated devices of every layout (default: the largest R or P)")
  parser.add_argument("--port", type=int, default=8437)
  args = parser.parse_args()
  root = Path(tempfile.mkdtemp(prefix="jaxpar-serve-bench-"))
  print(f"aiperf streaming completions: {args.requests} requests of {args.prefix} shared + {args.isl} random "
        f"prompt tokens, {args.osl} output tokens (ignore_eos); {args.slots} slots; {os.cpu_count()} cores\n")
  layouts = {text: parse_layout(text) for text in args.layouts}
  devices = args.devices or max(max(r, p, 2 * d) for r, p, d in layouts.values())
  print(f"{devices} simulated devices, the rows of each engine over its devices\n")
  print(f"{'model':>10} {'layout':>6} {'prefix cache':>12} {'conc':>4} | {'req/s':>6} {'out tok/s':>9} | "
        f"{'TTFT p50':>8} {'p99':>7} | {'ITL p50':>7} {'p99':>6} (ms)")
  modes = [(caching, layout) for caching in prefix_cache_modes() for layout in layouts.items()]
  for name in args.models:
    path = checkpoint(name, root, args.prefix + args.isl + args.osl + 16)
    for caching, (layout, (replicas, processes, disaggregated)) in modes:
      where = f"{name}-{caching}-{layout}"
      child = start_server(path, args.port, args.slots, caching, root / f"{where}.log", replicas, processes, devices,
                           disaggregated)
      try:
        for concurrency in args.concurrency:
          got = profile(args.aiperf, args.port, root / f"{name}-tokenizer", concurrency, args,
                        root / f"{where}-{concurrency}")
          ttft, itl = got["time_to_first_token"], got["inter_token_latency"]
          cache = {True: "on", False: "off"}.get(caching, "n/a")
          print(f"{name:>10} {layout:>6} {cache:>12} {concurrency:>4} | "
                f"{got['request_throughput']['avg']:>6.1f} {got['output_token_throughput']['avg']:>9,.0f} | "
                f"{ttft['p50']:>8.1f} {ttft['p99']:>7.1f} | {itl['p50']:>7.2f} {itl['p99']:>6.2f}", flush=True)
      finally:
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=120)


if __name__ == "__main__":
  main()
