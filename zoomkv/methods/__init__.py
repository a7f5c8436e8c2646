"""Every KV method zoomkv ships, registered by one explicit call each (``zoomkv.protocol.registry``).

A training-free method is one file with its config dataclass of published defaults; a trainable method is
one package holding its method, its modules and its training objective (``sekv/``, ``semantic_id/``).
To add a method: write it, then add its ``register_method`` line below (docs/ARCHITECTURE.md).
"""

from zoomkv.methods.chunkkv import ChunkKV, ChunkKVConfig
from zoomkv.methods.clusterkv import ClusterKV, ClusterKVConfig
from zoomkv.methods.compresskv import CompressKV, CompressKVConfig
from zoomkv.methods.full import Full, FullConfig
from zoomkv.methods.h2o import H2O, H2OConfig
from zoomkv.methods.infinigen import InfiniGen, InfiniGenConfig
from zoomkv.methods.oracle_topk import OracleTopK, OracleTopKConfig
from zoomkv.methods.pyramidkv import PyramidKV, PyramidKVConfig
from zoomkv.methods.quest import Quest, QuestConfig
from zoomkv.methods.sekv import SeKV, SeKVConfig, SeKVTraining
from zoomkv.methods.semantic_id import SemanticID, SemanticIDConfig, SemanticIDTraining
from zoomkv.methods.semanticache import SemantiCache, SemantiCacheConfig
from zoomkv.methods.sentencekv import SentenceKV, SentenceKVConfig
from zoomkv.methods.snapkv import SnapKV, SnapKVConfig
from zoomkv.methods.streamingllm import StreamingLLM, StreamingLLMConfig
from zoomkv.protocol.registry import (
    METHODS,
    TRAINING,
    get_method,
    get_training,
    list_methods,
    register_method,
)

# exact references
register_method("full", FullConfig, Full)
register_method("oracle_topk", OracleTopKConfig, OracleTopK)
# eviction: rows not kept are gone
register_method("streamingllm", StreamingLLMConfig, StreamingLLM)
register_method("snapkv", SnapKVConfig, SnapKV)
register_method("pyramidkv", PyramidKVConfig, PyramidKV)
register_method("chunkkv", ChunkKVConfig, ChunkKV)
register_method("h2o", H2OConfig, H2O)
register_method("compresskv", CompressKVConfig, CompressKV)
register_method("semanticache", SemantiCacheConfig, SemantiCache)
# recallable: every row kept on the host tier
register_method("quest", QuestConfig, Quest)
register_method("clusterkv", ClusterKVConfig, ClusterKV)
register_method("infinigen", InfiniGenConfig, InfiniGen)
register_method("sentencekv", SentenceKVConfig, SentenceKV)
# trainable
register_method("sekv", SeKVConfig, SeKV, training=SeKVTraining())
register_method("semantic_id", SemanticIDConfig, SemanticID, training=SemanticIDTraining())

__all__ = ["METHODS", "TRAINING", "get_method", "get_training", "list_methods", "register_method"]
