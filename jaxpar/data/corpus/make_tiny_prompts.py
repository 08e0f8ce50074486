"""Write the arithmetic prompts configs/grpo-tiny.yaml learns on (no download):

  python make_tiny_prompts.py tiny_chat.jsonl tiny_prompts.jsonl tiny_prompts_seen.jsonl

Every "What is a plus b?" and "What is a minus b?" (a >= b) over the digits, as reinforcement
learning rows {"prompt", "answer"}: the 37 that the bundled chat set (tiny_chat.jsonl, which
sft-tiny is trained on) never asks go to the first file, the 118 it asks to the second. An
SFT'd model was never shown the first file's answers: what it gets right there after
reinforcement learning it learnt from the reward alone. Not imported by jaxpar.
"""

import json
import sys


def questions():
  for a in range(10):
    for b in range(10):
      yield f"What is {a} plus {b}?", str(a + b)
  for a in range(10):
    for b in range(a + 1):
      yield f"What is {a} minus {b}?", str(a - b)


def main(chat: str, unseen: str, seen: str):
  with open(chat) as f:
    asked = {m["content"] for line in f for m in json.loads(line)["messages"] if m["role"] == "user"}
  with open(unseen, "w") as unseen_file, open(seen, "w") as seen_file:
    for prompt, answer in questions():
      (seen_file if prompt in asked else unseen_file).write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")


if __name__ == "__main__":
  main(*sys.argv[1:4])
