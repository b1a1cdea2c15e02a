"""Multi-LoRA serving: PEFT adapters read and checked (peft.py), their low-rank products added to the base model's
linear layers per group of rows (layers.py), as vLLM's vllm.lora. `request.py`: LoRARequest at vLLM's import path."""
