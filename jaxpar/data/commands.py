"""`jaxpar data tokenize SOURCE OUT --tokenizer ...`: write a token cache (jaxpar/data/cache.py)."""

from rich.console import Console

console = Console(soft_wrap=True)


def _cmd_tokenize(ns):
  from jaxpar.data import Column, load_tokenizer, write_cache
  from jaxpar.errors import DataError
  try:
    tokenizer = load_tokenizer(ns.tokenizer)
  except ValueError as e:
    raise DataError(str(e)) from None
  column = Column(ns.tokens_key, tokens=True) if ns.tokens_key else Column(ns.text_key)
  meta = write_cache(ns.source, ns.out, tokenizer, column, show_progress=not ns.no_progress,
                     echo=lambda text: console.print(text, markup=False, highlight=False))
  skipped = "".join(f", skipped {n} {what}" for what, n in meta.get("skipped", {}).items())
  console.print(f"[bold]tokenized[/bold] {ns.source} -> {ns.out}: {meta['documents']:,} documents, "
                f"{meta['tokens']:,} tokens ({meta['dtype']}) at {meta.get('tokens_per_s', 0):,.0f} tokens/s"
                f"{skipped}; train on it with data.source={ns.out} data.tokenizer={ns.tokenizer}")


def add_parsers(commands):
  data = commands.add_parser("data", help="prepare training data")
  data_commands = data.add_subparsers(dest="data_command", required=True)
  tokenize = data_commands.add_parser(
      "tokenize", help="tokenize a corpus once into a token cache that training reads directly",
      description="Tokenize SOURCE (a file, folder, glob of shards or `datasets` folder: .txt, .jsonl, "
      ".parquet, .arrow, .feather; text and JSON lines may be .gz or .zst) into the token cache OUT. "
      "Run the same command again to resume an interrupted run. Train on it with data.source=OUT.")
  tokenize.add_argument("source", metavar="SOURCE")
  tokenize.add_argument("out", metavar="OUT")
  tokenize.add_argument("--tokenizer", required=True, help="'byte' or a Hugging Face tokenizer.json")
  tokenize.add_argument("--text-key", default="text", help="the text field or column (default: text)")
  tokenize.add_argument("--tokens-key", help="a column of token-id lists to copy instead of text")
  tokenize.add_argument("--no-progress", action="store_true", help="no progress bar")
  tokenize.set_defaults(func=_cmd_tokenize)
