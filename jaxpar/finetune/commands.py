"""`jaxpar lora merge | export-peft | import-peft`: what to do with an adapter checkpoint."""

from rich.console import Console

console = Console(soft_wrap=True)


def _cmd_merge(ns):
  from jaxpar.finetune.merge import merge_checkpoint
  _, path = merge_checkpoint(ns.adapters, ns.out)
  console.print(f"[bold]merged[/bold] {ns.adapters} -> {path}: a plain checkpoint (no adapters); export it "
                f"with `jaxpar convert jaxpar-to-hf {ns.out} HF_DIR`", markup=True, highlight=False)


def _cmd_export_peft(ns):
  from jaxpar.finetune.peft import export_peft
  out = export_peft(ns.adapters, ns.out)
  console.print(f"[bold]exported[/bold] {ns.adapters} -> {out}: load it with "
                f"peft.PeftModel.from_pretrained(base_model, {str(out)!r})", markup=True, highlight=False)


def _cmd_import_peft(ns):
  from jaxpar.finetune.peft import import_peft
  config, path = import_peft(ns.peft_dir, ns.base, ns.out)
  lora = config.model.lora
  console.print(f"[bold]imported[/bold] {ns.peft_dir} -> {path}: rank {lora.rank}, alpha {lora.alpha:g}, "
                f"on {', '.join(lora.targets)} over {ns.base}", markup=True, highlight=False)


def add_parsers(commands):
  lora = commands.add_parser("lora", help="merge, export or import LoRA adapters")
  sub = lora.add_subparsers(dest="lora_command", required=True)
  merge = sub.add_parser("merge", help="fold adapters into their base: a plain checkpoint",
                         description="Write a new checkpoint OUT whose projections are base + alpha/rank * A @ B, "
                         "with no adapters left; `jaxpar convert jaxpar-to-hf` exports it.")
  merge.add_argument("adapters", metavar="ADAPTERS", help="an adapter checkpoint (run, checkpoints or step dir)")
  merge.add_argument("out", metavar="OUT", help="a new checkpoint directory")
  merge.set_defaults(func=_cmd_merge)
  export = sub.add_parser("export-peft", help="write adapters as a Hugging Face PEFT adapter directory",
                          description="Write OUT/adapter_model.safetensors and OUT/adapter_config.json, which "
                          "peft.PeftModel.from_pretrained loads onto the transformers export of the base.")
  export.add_argument("adapters", metavar="ADAPTERS", help="an adapter checkpoint (run, checkpoints or step dir)")
  export.add_argument("out", metavar="OUT", help="the PEFT adapter directory to write")
  export.set_defaults(func=_cmd_export_peft)
  imported = sub.add_parser("import-peft", help="read a Hugging Face PEFT LoRA adapter over a base checkpoint",
                            description="Write an adapter checkpoint OUT (step 0) from the PEFT adapter in "
                            "PEFT_DIR, over the jaxpar checkpoint BASE of the model it was trained on.")
  imported.add_argument("peft_dir", metavar="PEFT_DIR")
  imported.add_argument("base", metavar="BASE", help="the base model's jaxpar checkpoint (e.g. from hf-to-jaxpar)")
  imported.add_argument("out", metavar="OUT", help="a new checkpoint directory")
  imported.set_defaults(func=_cmd_import_peft)
