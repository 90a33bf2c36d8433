"""The stand-in's ``tensorrt_llm.llmapi`` (see the package's docstring): the two option classes the llmapi model
builds from model.yaml, and ``GuidedDecodingParams``, keeping their keyword arguments (a keyword TensorRT-LLM's
``GuidedDecodingParams`` lacks is a ``TypeError``, as there)."""
from .. import _Config


class KvCacheConfig(_Config):
    pass


class CudaGraphConfig(_Config):
    pass


class GuidedDecodingParams(_Config):
    FIELDS = ("json", "regex", "grammar", "json_object", "structural_tag")  # tensorrt_llm/sampling_params.py

    def __init__(self, **kwargs):
        unknown = sorted(set(kwargs) - set(self.FIELDS))
        if unknown:
            raise TypeError(f"GuidedDecodingParams.__init__() got an unexpected keyword argument '{unknown[0]}'")
        super().__init__(**kwargs)
