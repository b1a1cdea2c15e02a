"""LoRARequest at vLLM's import path (vllm.lora.request.LoRARequest -> pagedllm.lora.request.LoRARequest); the type
itself is a wire value (messages.py), carried by EngineCoreRequest and the scheduler's NewRequestData."""

from pagedllm.messages import LoRARequest

__all__ = ["LoRARequest"]
