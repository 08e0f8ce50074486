"""Two processes x 4 CPU devices train as one 8-device mesh (gloo collectives), each
loading only its half of every global batch, and match the single-process run."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jaxpar.config import replace
from jaxpar.trainer import Trainer
from tests.helpers import small_config

WORKER = Path(__file__).with_name("multiprocess_worker.py")


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
  config = small_config(mesh={"fsdp": 8}, data={"seq_len": 32, "global_batch_size": 16},
                        train={"steps": 3}, tmp_path=tmp_path)
  config_json = json.dumps(config.model_dump(mode="json"))
  with socket.socket() as probe:  # a free loopback port for the coordinator
    probe.bind(("127.0.0.1", 0))
    port = str(probe.getsockname()[1])
  outs = [tmp_path / f"process{i}.json" for i in range(2)]
  workers = [subprocess.Popen([sys.executable, str(WORKER), str(i), port, str(outs[i]), config_json],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
  for worker in workers:
    output, _ = worker.communicate(timeout=300)
    assert worker.returncode == 0, output[-3000:]
  results = [json.loads(out.read_text()) for out in outs]
  assert all(r["devices"] == 8 and r["local_devices"] == 4 for r in results)
  single = replace(config, train={"run_dir": str(tmp_path / "single")})
  expected = [h["loss"] for h in Trainer(single).fit(show_progress=False).history]
  for result in results:
    assert result["losses"] == pytest.approx(expected, rel=1e-5)
