"""How many proposals a speculative round checks: adapted to each row's recent acceptance and
to what a wider pass costs, measured (PEARL's point, that the draft length should follow how
far drafts are being kept, made a rule over measured costs).

Each row keeps a decayed count of its proposals kept and of those tried (a proposal is tried
when every one before it was kept): its acceptance rate a, the chance the next proposal is
kept given the ones before were. Under that rate, a pass of width w (w proposals) yields
1 + a + a^2 + ... + a^w tokens for the row, on average (the target's own token included).
The passes are compiled for a few widths at start (`pass_widths`); each round runs the one
with the most tokens for the whole batch per second of a round at that width, the seconds an
average over that width's past rounds. Each width runs twice, widest first, before the
choice starts (its first round is not timed: a program's first run pays one-time costs), and
one not run for REFRESH rounds runs once more, so a width is not judged on old timings. Proposals cost the same to check whichever row they come from, so every row
gets the round's width; rows without proposals add one token at any width. A batch whose
drafts miss moves to narrow passes, one whose drafts hit to wide ones, and where a wide pass
costs little more than a narrow one (a step that streams its weights) it stays wide.
"""

DECAY = 0.7  # weight of a row's earlier rounds in its acceptance rate, per round
TIME_DECAY = 0.8  # weight of a width's earlier rounds in its average time, per round
REFRESH = 64  # rounds after which a width not chosen runs once more


def pass_widths(k: int) -> tuple[int, ...]:
  """The proposal counts a target pass is compiled for: 1, about half of k, and k."""
  return tuple(sorted({1, (k + 1) // 2, k}))


def expected_tokens(rate: float, width: int) -> float:
  """Tokens a row gets from a pass of `width` proposals kept each with probability `rate`
  (given the ones before it were), the target's own included."""
  return float(sum(rate ** j for j in range(width + 1)))


class WidthChooser:
  """The width of each round's pass, from the rows' rates and the widths' measured seconds."""

  def __init__(self, widths: tuple[int, ...]):
    self.widths = widths
    self.seconds: dict[int, float] = {}
    self.runs = dict.fromkeys(widths, 0)
    self.last = dict.fromkeys(widths, 0)  # the round each width last ran
    self.round = 0

  def choose(self, rates: list[float], others: int) -> int:
    """rates: the acceptance rate of each row with proposals this round; others: the rows
    decoding without (one token each, at any width)."""
    self.round += 1
    due = [w for w in self.widths if w not in self.seconds or self.round - self.last[w] > REFRESH]
    if due:
      return max(due)
    return max(self.widths, key=lambda w: (sum(expected_tokens(r, w) for r in rates) + others) / self.seconds[w])

  def record(self, width: int, seconds: float):
    self.runs[width] += 1
    self.last[width] = self.round
    if self.runs[width] == 1:
      return  # a first run pays one-time costs
    last = self.seconds.get(width)
    self.seconds[width] = seconds if last is None else TIME_DECAY * last + (1 - TIME_DECAY) * seconds


class RowRate:
  """One row's decayed counts of proposals kept and tried; rate() with a prior of one of two."""

  def __init__(self):
    self.kept = self.tried = 0.0

  def rate(self) -> float:
    return (self.kept + 1) / (self.tried + 2)

  def update(self, proposed: int, accepted: int):
    tried = accepted + (accepted < proposed)  # the first rejected proposal was tried too
    self.kept = DECAY * self.kept + accepted
    self.tried = DECAY * self.tried + tried
