"""The stand-in's ``tensorrt_llm.llmapi`` (see the package's docstring): the two option classes the llmapi model
builds from model.yaml, keeping their keyword arguments."""
from .. import _Config


class KvCacheConfig(_Config):
    pass


class CudaGraphConfig(_Config):
    pass
