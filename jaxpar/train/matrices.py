"""Which parameters are hidden weight matrices, from their logical axis names: what Muon
orthogonalises and GaLore projects (the rest, embeddings, the output projection and vectors,
take AdamW)."""

# Axes that stack independent matrices (scanned layers, experts): each matrix is its own.
STACKED = ("layers", "experts")


def hidden_matrix(names: tuple) -> bool:
  """Two or more axes besides the stacked ones, and no vocabulary axis."""
  return "vocab" not in names and sum(n not in STACKED for n in names) >= 2
