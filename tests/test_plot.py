"""`jaxpar plot`: a PNG with a panel per metric, one labelled line per run, eval loss when a
run logged one, a resumed run's repeated steps counted once (the figure is inspected, not
its pixels)."""

import json

import pytest

from jaxpar.cli import main
from jaxpar.plot import plot_runs

pytest.importorskip("matplotlib")


def _run(directory, steps, *, eval_every=0, lr=1e-3, repeat_from=None):
  directory.mkdir(parents=True)
  records = []
  for step in steps:
    record = {"step": step, "loss": 6.0 - step / 10, "lr": lr * step / len(steps), "tokens": 4096.0}
    if step > 1:  # the first step compiles: no speed
      record.update(tokens_per_s=4000.0 + step, mfu=0.25)
    records.append(record)
    if eval_every and step % eval_every == 0:
      records.append({"step": step, "eval/heldout/loss": 6.5 - step / 10})
  if repeat_from:  # resumed from an earlier checkpoint: those steps logged again, differently
    records += [{"step": s, "loss": 1.0, "lr": lr, "tokens_per_s": 1.0, "mfu": 0.5} for s in steps[repeat_from:]]
  (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  return directory


def test_plot_writes_a_png_with_every_panel_and_every_run_labelled(tmp_path):
  a = _run(tmp_path / "runs" / "a", range(1, 21), eval_every=5)
  b = _run(tmp_path / "runs" / "b", range(1, 11), lr=3e-3, repeat_from=8)
  png = tmp_path / "out.png"
  assert main(["plot", str(a), str(b), "--output", str(png)]) == 0
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000

  figure = plot_runs([a, b])
  loss, lr, speed, mfu = figure.axes
  assert [ax.get_title() for ax in figure.axes] == ["loss (eval dashed)", "learning rate", "tokens/s", "MFU (%)"]
  assert [t.get_text() for t in loss.get_legend().get_texts()] == ["a", "a eval/heldout/loss", "b"]
  assert figure.get_suptitle() == "jaxpar: a, b"
  assert speed.get_xlabel() == mfu.get_xlabel() == "step"
  for ax in (lr, speed, mfu):
    assert [line.get_label() for line in ax.lines] == ["a", "b"]
  evaluated = loss.lines[1]
  assert list(evaluated.get_xdata()) == [5, 10, 15, 20] and evaluated.get_linestyle() == "--"
  b_loss = loss.lines[2]
  assert list(b_loss.get_xdata()) == list(range(1, 11))  # steps 9, 10 once: their last record
  assert list(b_loss.get_ydata())[-2:] == [1.0, 1.0]
  assert list(speed.lines[0].get_xdata()) == list(range(2, 21))  # step 1 has no speed
  assert set(mfu.lines[0].get_ydata()) == {25.0}  # percent
  assert lr.lines[1].get_color() == loss.lines[2].get_color() != loss.lines[0].get_color()


def test_a_run_that_logged_nothing_yet_is_a_one_line_error(tmp_path, capsys):
  (tmp_path / "empty").mkdir()
  assert main(["plot", str(tmp_path / "empty")]) == 2
  assert "has no metrics.jsonl" in capsys.readouterr().err
