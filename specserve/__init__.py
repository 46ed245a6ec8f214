"""specserve: a PyTorch LLM serving engine with load-adaptive EAGLE-3 speculative decoding."""

from specserve.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # the engine pulls in torch and the model code; import it only when asked for
    if name == "LLM":
        from specserve.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "RequestOutputKind", "SamplingParams"]
