"""The suite's time by test file, from a `pytest --durations=0` log: what to shorten first.

    .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=0 > suite.log
    python benchmarks/test_durations.py suite.log [before.log] [--top 30]

Each file's setup + call + teardown seconds, summed over its tests (its share of the two
workers' time), and the slowest single items; with a second log, the two side by side.
"""

import argparse
import collections
import re

_LINE = re.compile(r"^([0-9.]+)s (setup|call|teardown)\s+(\S+)")
_TOTAL = re.compile(r"(\d+) passed.* in ([0-9.]+)s")


def read(path: str) -> tuple[dict[str, float], list[tuple[float, str]], str]:
  files, items, total = collections.Counter(), [], ""
  for line in open(path):
    if match := _LINE.match(line):
      seconds, _, test = float(match[1]), match[2], match[3]
      files[test.split("::")[0]] += seconds
      items.append((seconds, f"{match[2]:<8} {test}"))
    elif match := _TOTAL.search(line):
      total = f"{match[1]} passed in {float(match[2]) / 60:.1f} min"
  return files, sorted(items, reverse=True), total


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("log")
  parser.add_argument("before", nargs="?", help="an earlier log to compare with")
  parser.add_argument("--top", type=int, default=30)
  args = parser.parse_args()
  files, items, total = read(args.log)
  old, _, old_total = read(args.before) if args.before else ({}, [], "")
  print(f"{total}" + (f" (before: {old_total})" if old_total else ""))
  print(f"sum of test time {sum(files.values()):.0f} s" + (f" (before: {sum(old.values()):.0f} s)" if old else ""))
  print("\n| file | seconds |" + (" before |" if old else ""))
  print("| --- | --- |" + (" --- |" if old else ""))
  for name in sorted(set(files) | set(old), key=lambda n: -max(files.get(n, 0), old.get(n, 0)))[:args.top]:
    print(f"| {name} | {files.get(name, 0):.0f} |" + (f" {old.get(name, 0):.0f} |" if old else ""))
  print("\nslowest items:")
  for seconds, item in items[:15]:
    print(f"  {seconds:7.1f} s  {item}")


if __name__ == "__main__":
  main()
