"""pagedllm: a paged-KV-cache LLM serving engine.

`from pagedllm import LLM, SamplingParams`. Heavy modules (torch) load on first use, so that
`import pagedllm.core` stays torch-free and `pagedllm --help` is instant.
"""

from pagedllm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "PoolingParams", "RequestOutput", "CompletionOutput", "EmbeddingRequestOutput",
           "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    if name == "PoolingParams":
        from pagedllm.pooling_params import PoolingParams

        return PoolingParams
    if name in ("RequestOutput", "CompletionOutput", "EmbeddingRequestOutput"):
        from pagedllm import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
