"""A real load generator drives `jaxpar serve` unchanged: guidellm's command line (as its
users run it) sends 24 streamed completions, 4 at a time, of 32-token synthetic prompts for
16 tokens each (ignore_eos), through the OpenAI completions endpoint, with the served
model's tokenizer. Every request succeeds with the tokens asked for, and the server's
Prometheus metrics, read with prometheus_client's parser, count the same work."""

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.serving_setup import CliServer, checkpoint_with_hf_copy

REQUESTS, STREAMS, PROMPT, OUTPUT = 24, 4, 32, 16


def _metrics(url: str) -> dict:
  """{sample name: value} of the server's /metrics, unlabelled samples only."""
  text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
  return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples if not s.labels}


def test_guidellm_drives_the_server(tmp_path):
  ckpt, hf_dir, _ = checkpoint_with_hf_copy(tmp_path)
  server = CliServer("--checkpoint", ckpt, "--slots", STREAMS)
  url = f"http://127.0.0.1:{server.port}"
  try:
    model = json.load(urllib.request.urlopen(f"{url}/v1/models", timeout=30))["data"][0]["id"]
    before = _metrics(url)
    done = subprocess.run(
        [str(Path(sys.executable).parent / "guidellm"), "run", "--disable-console-interactive",
         "--backend", f"kind=openai_http,target={url},model={model},request_format=/v1/completions",
         "--profile", f"kind=concurrent,streams={STREAMS}", "--constraint", f"kind=max_requests,count={REQUESTS}",
         "--data", f"kind=synthetic_text,prompt_tokens={PROMPT},output_tokens={OUTPUT}",
         "--tokenizer", f"kind=hf_auto,model={hf_dir}", "--output", f"kind=json,path={tmp_path / 'out.json'}"],
        capture_output=True, text=True, timeout=600)
    after = _metrics(url)
  finally:
    server.stop()
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  [benchmark] = json.loads((tmp_path / "out.json").read_text())["benchmarks"]
  assert benchmark["metrics"]["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0,
                                                    "total": REQUESTS}
  requests = benchmark["requests"]["successful"]
  assert [(r["prompt_tokens"], r["output_tokens"]) for r in requests] == [(PROMPT, OUTPUT)] * REQUESTS
  assert all(0 < r["time_to_first_token_ms"] <= r["request_latency"] * 1e3 for r in requests)
  served = {name: after[name] - before.get(name, 0.0) for name in after}
  assert served["jaxpar_generation_tokens_total"] == REQUESTS * OUTPUT
  assert served["jaxpar_time_to_first_token_seconds_count"] == REQUESTS
  assert served["jaxpar_inter_token_latency_seconds_count"] == REQUESTS * (OUTPUT - 1)
