"""Fine-tuning: low-rank adapters over a frozen base (LoRA, QLoRA) and their checkpoints,
merges and Hugging Face PEFT files. docs/finetuning.md says how to use them."""
