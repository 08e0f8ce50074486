"""Write tiny_chat.jsonl: the small chat set configs/sft-tiny.yaml fine-tunes on (no download).

  python make_tiny_chat.py tiny_chat.jsonl

Conversations whose answers follow rules a ~1M-parameter model can learn in minutes: sums
and differences of small numbers, words spelt backwards, opposites, counting, and greetings,
each answered in a fixed format, some with a system prompt and a second exchange. Seeded, so
the file is the same on every run. Not imported by jaxpar.
"""

import json
import random
import sys

OPPOSITES = [("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("old", "new"),
             ("day", "night"), ("open", "closed"), ("light", "dark"), ("happy", "sad"), ("early", "late"),
             ("left", "right"), ("full", "empty"), ("wet", "dry"), ("high", "low"), ("loud", "quiet")]
WORDS = ["cat", "dog", "tree", "house", "river", "apple", "stone", "bird", "cloud", "ship", "lamp", "book",
         "road", "fish", "hill", "star", "moon", "rain", "wind", "door"]
GREETINGS = ["Hello!", "Hi there.", "Good morning.", "Hey!", "Good evening."]


def exchange(rng: random.Random) -> tuple[str, str]:
  """One (question, answer) pair."""
  kind = rng.randrange(5)
  if kind == 0:
    a, b = rng.randrange(10), rng.randrange(10)
    return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
  if kind == 1:
    a, b = sorted((rng.randrange(10), rng.randrange(10)), reverse=True)
    return f"What is {a} minus {b}?", f"{a} minus {b} is {a - b}."
  if kind == 2:
    word = rng.choice(WORDS)
    return f"Spell {word} backwards.", f"{word} backwards is {word[::-1]}."
  if kind == 3:
    word, opposite = rng.choice(OPPOSITES)
    if rng.random() < 0.5:
      word, opposite = opposite, word
    return f"What is the opposite of {word}?", f"The opposite of {word} is {opposite}."
  n = rng.randrange(2, 7)
  return f"Count to {n}.", " ".join(str(i) for i in range(1, n + 1)) + "."


def conversation(rng: random.Random) -> dict:
  messages = []
  if rng.random() < 0.3:
    messages.append({"role": "system", "content": "You are a brief assistant."})
  if rng.random() < 0.2:
    messages += [{"role": "user", "content": rng.choice(GREETINGS)},
                 {"role": "assistant", "content": "Hello! Ask me a question."}]
  for _ in range(rng.choice((1, 1, 2))):
    question, answer = exchange(rng)
    messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
  return {"messages": messages}


def main(path: str, conversations: int = 400, seed: int = 0):
  rng = random.Random(seed)
  with open(path, "w") as f:
    for _ in range(conversations):
      f.write(json.dumps(conversation(rng)) + "\n")


if __name__ == "__main__":
  main(sys.argv[1])
